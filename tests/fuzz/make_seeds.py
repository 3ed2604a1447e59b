#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (scripts/ci/fuzz.sh calls it).

seeds/fuzz_safetensors: valid micro checkpoints of the shape fuzz_safetensors.cc's
config.json describes (BF16 with KV scales; F32 with an FP8 q_proj and its per-channel
weight_scale), a shard index, and degenerate files. seeds/fuzz_config: the shipped
configs, Hugging Face config.json files, a kv_scales_file and overrides.
"""
import json
import os
import struct
import sys

H, V, I, Q, K = 8, 8, 8, 8, 4  # hidden, vocab, intermediate, q_dim, kv_dim of the micro model


def tensors(dtype):
    t = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}
    p = "model.layers.0."
    t.update({p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
              p + "self_attn.q_proj.weight": [Q, H], p + "self_attn.k_proj.weight": [K, H],
              p + "self_attn.v_proj.weight": [K, H], p + "self_attn.o_proj.weight": [H, Q],
              p + "self_attn.q_proj.bias": [Q], p + "self_attn.k_proj.bias": [K], p + "self_attn.v_proj.bias": [K],
              p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H], p + "mlp.down_proj.weight": [H, I]})
    return {name: (dtype, shape) for name, shape in t.items()}


def value_bytes(dtype, n, x):
    if dtype == "F32":
        return struct.pack("<%df" % n, *([x] * n))
    if dtype == "BF16":
        return struct.pack("<%dH" % n, *([struct.unpack("<I", struct.pack("<f", x))[0] >> 16] * n))
    if dtype == "F8_E4M3":
        return bytes([0x38]) * n  # 1.0
    raise ValueError(dtype)


def safetensors(entries):
    """entries: {name: (dtype, shape, value)} -> file bytes."""
    header, data = {}, b""
    for name, (dtype, shape, x) in entries.items():
        n = 1
        for d in shape:
            n *= d
        b = value_bytes(dtype, n, x)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def main(out):
    st = os.path.join(out, "fuzz_safetensors")
    cf = os.path.join(out, "fuzz_config")
    os.makedirs(st, exist_ok=True)
    os.makedirs(cf, exist_ok=True)

    bf16 = {n: (d, s, 0.5) for n, (d, s) in tensors("BF16").items()}
    bf16["model.layers.0.self_attn.k_scale"] = ("F32", [], 0.25)
    bf16["model.layers.0.self_attn.v_scale"] = ("F32", [], 2.0)
    f32 = {n: (d, s, 0.5) for n, (d, s) in tensors("F32").items()}
    f32["model.layers.0.self_attn.q_proj.weight"] = ("F8_E4M3", [Q, H], 1.0)
    f32["model.layers.0.self_attn.q_proj.weight_scale"] = ("F32", [Q], 0.125)
    f32["model.layers.0.self_attn.q_proj.input_scale"] = ("F32", [], 1.0)
    f32["model.layers.0.self_attn.kv_scale"] = ("BF16", [1], 1.5)
    seeds = {
        "bf16_with_scales.safetensors": safetensors(bf16),
        "f32_fp8_q.safetensors": safetensors(f32),
        "empty_header.safetensors": struct.pack("<Q", 2) + b"{}",
        "metadata.safetensors": struct.pack("<Q", 32) + b'{"__metadata__":{"format":"pt"}}',
        "index.json": json.dumps({"metadata": {"total_size": 64},
                                  "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                 "b": "model-00002-of-00002.safetensors"}}).encode(),
    }
    for name, b in seeds.items():
        with open(os.path.join(st, name), "wb") as f:
            f.write(b)

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    cfg_dir = os.path.join(root, "config")
    for name in sorted(os.listdir(cfg_dir)):
        if name.endswith(".json"):
            with open(os.path.join(cfg_dir, name), "rb") as f, open(os.path.join(cf, "kvfuse_" + name), "wb") as g:
                g.write(f.read())
    hf = {
        "llama3": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                   "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
                   "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   "max_position_embeddings": 131072, "vocab_size": 128256},
        "qwen2_yarn": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                       "num_attention_heads": 4, "num_hidden_layers": 2, "max_position_embeddings": 32768,
                       "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                           "original_max_position_embeddings": 32768, "beta_fast": 32,
                                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                           "truncate": False},
                       "vocab_size": 100},
        "qwen2_swa": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                      "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
                      "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2,
                      "tie_word_embeddings": True, "vocab_size": 100},
        "mistral_layer_types": {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "num_hidden_layers": 2, "head_dim": 32,
                                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "vocab_size": 100},
        "scales": {"format": "kvfuse-kv-scales-v1", "fp8_max": 448, "num_layers": 4, "k_scale": [0.5, 1, 2, 4],
                   "v_scale": 0.25},
        "kvfuse_full": {"model": "tiny", "model_path": "", "kv_scales_file": "", "k_scale": None, "v_scale": [1, 2, 3, 4],
                        "swa_layers": [0, 2], "sliding_window": 32, "kv_cache_dtype": "fp8_e5m2"},
    }
    for name, j in hf.items():
        with open(os.path.join(cf, name + ".json"), "w") as f:
            json.dump(j, f)
    for i, text in enumerate(["kv_write=unfused", "k_scale=[0.5,1,1,1]", "model_path=/x", "swa_layers=alternate"]):
        with open(os.path.join(cf, "override_%d" % i), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main(sys.argv[1])
