#!/usr/bin/env python3
"""Reference check: kvfuse against Hugging Face transformers on small random models.

    python3 tests/hf_reference.py --kvfuse-bin build/kvfuse-eval [--device cpu --device cuda]

Without PyTorch and transformers it says so and exits 0. Nothing is downloaded: the
models are built from configs with fixed seeds.

For each of a Llama (GQA 2:1, rope_theta 5e5), a Qwen2 (q/k/v biases, tied embeddings),
a Mistral with a 32-token sliding window on every layer (GQA 4:1), a Qwen2 whose
upper two layers use a 32-token window (use_sliding_window + max_window_layers: kvfuse's
hybrid full + SWA pools; needs transformers >= 4.53, whose eager attention applies it),
and three scaled-RoPE models whose original context (64) the 150-token prompt passes:
a Llama with Llama 3.1's llama3 scaling (factor 8, low/high_freq_factor 1/4), a Llama
with linear scaling (factor 4), and a Qwen2 with yarn (factor 4, attention factor
0.1 ln 4 + 1 on cos and sin; max_position_embeddings 256 = 4 x 64, so that every
transformers release that reads original_max_position_embeddings derives the same
factor; releases before that used max_position_embeddings as the original context and
compute a different table). The scalings are passed as `rope_scaling`, which
transformers 4.x stores and 5.x converts to `rope_parameters`; save_pretrained writes
whichever layout the installed version uses, and kvfuse reads both:
  1. build the model with transformers, give it well-conditioned random weights (fixed
     seed; logits with a standard deviation of about 3, so greedy decoding is decisive),
     round them to bf16 and save_pretrained (safetensors);
  2. reference: the same bf16-valued weights in fp32, eager attention, TF32 off; greedy
     decoding of STEPS tokens for each prompt (prompt lengths 7, 61 and 150, the last
     longer than the window), recomputing the whole sequence at each step (no cache);
     then the logits of every step along the reference tokens (teacher forcing);
  3. kvfuse (kvfuse-eval --set model_path=DIR) on each device and KV dtype: its greedy
     tokens, and its logits along the reference tokens (prefill, then one token per
     decode step, so the paged cache and the decode path are what is measured);
  4. compare. With sigma the standard deviation of the reference logits:
       bf16 KV: cosine >= 0.9995 and max |diff| <= max(0.15 sigma, 3 x hf-bf16)
       fp8 KV:  cosine >= 0.995  and max |diff| <= max(0.3 sigma, 6 x hf-bf16)
     where hf-bf16 is transformers' own bf16 run's max |diff| from the fp32 reference
     (the noise floor of bf16 arithmetic). Seen with kvfuse's CPU backend against
     transformers 5.17 (sigma ~3): bf16 max |diff| 0.08-0.23, cosine >= 0.99987; fp8
     max |diff| 0.17-0.51, cosine >= 0.9988. Greedy tokens must equal the reference's for
     all STEPS steps, or diverge only where the reference's top-2 margin is within
     2 x max |diff| of that step (a near-tie that the measured deviation explains).
     fp8 runs with the default scales (1.0), with scales from kvfuse-calibrate
     (kv_scales_file), and with the same scales stored in the checkpoint as
     self_attn.k_scale / v_scale tensors; the last two must give identical logits.
Exit status: 0 all pass (or no PyTorch), 1 a check failed, 2 kvfuse-eval is missing.
"""
import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

STEPS = 32
PROMPT_LENS = (7, 61, 150)
VOCAB = 512
BOUNDS = {"bf16": (0.9995, 0.15, 3.0), "fp8_e4m3": (0.995, 0.3, 6.0)}  # (min cos, x sigma, x hf-bf16)

MODELS = {
    "llama": dict(cls="LlamaConfig", model="LlamaForCausalLM", seed=1,
                  cfg=dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=False)),
    "qwen2": dict(cls="Qwen2Config", model="Qwen2ForCausalLM", seed=2,
                  cfg=dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, use_sliding_window=False)),
    "mistral": dict(cls="MistralConfig", model="MistralForCausalLM", seed=3,
                    cfg=dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0, rms_norm_eps=1e-5,
                             tie_word_embeddings=False, sliding_window=32)),
    "qwen2-swa": dict(cls="Qwen2Config", model="Qwen2ForCausalLM", seed=4,
                      cfg=dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, use_sliding_window=True, sliding_window=32,
                               max_window_layers=2)),
    # Scaled RoPE over a 64-token original context.
    "llama-llama3": dict(cls="LlamaConfig", model="LlamaForCausalLM", seed=5,
                         cfg=dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
                                  tie_word_embeddings=False,
                                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama-linear": dict(cls="LlamaConfig", model="LlamaForCausalLM", seed=6,
                         cfg=dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                                  tie_word_embeddings=False, rope_scaling=dict(rope_type="linear", factor=4.0))),
    "qwen2-yarn": dict(cls="Qwen2Config", model="Qwen2ForCausalLM", seed=7,
                       cfg=dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                tie_word_embeddings=False, use_sliding_window=False, max_position_embeddings=256,
                                rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
}


def log(*a):
    print(*a, flush=True)


def build_model(torch, transformers, arch):
    m = MODELS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=64,
              max_position_embeddings=4096, hidden_act="silu", bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
    kw.update(copy.deepcopy(m["cfg"]))  # a model's own keys (max_position_embeddings) win
    try:
        cfg = getattr(transformers, m["cls"])(attn_implementation="eager", **kw)
    except TypeError:  # versions whose configs do not take it: attention is looked up at run time
        cfg = getattr(transformers, m["cls"])(**kw)
        cfg._attn_implementation = "eager"
    torch.manual_seed(m["seed"])
    model = getattr(transformers, m["model"])(cfg).eval()
    # Well-conditioned weights (HF's std-0.02 init gives near-uniform logits, where greedy
    # decoding is a coin toss): unit-RMS residual stream, logits with std ~3.
    g = torch.Generator().manual_seed(m["seed"])
    hidden = cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = p.shape[-1]
            if name.endswith("norm.weight"):
                v = 1.0 + 0.05 * torch.randn(p.shape, generator=g)
            elif name.endswith(".bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                # Tied: the embedding is also the output layer, whose scale sets the logits'.
                std = 3.0 / math.sqrt(hidden) if cfg.tie_word_embeddings else 1.0
                v = std * torch.randn(p.shape, generator=g)
            elif name == "lm_head.weight":
                v = 3.0 / math.sqrt(hidden) * torch.randn(p.shape, generator=g)
            elif "o_proj" in name or "down_proj" in name:
                v = 0.5 / math.sqrt(fan_in) * torch.randn(p.shape, generator=g)
            else:
                v = 1.0 / math.sqrt(fan_in) * torch.randn(p.shape, generator=g)
            p.copy_(v.to(p.dtype))
    return model.to(torch.bfloat16)


def forward_logits(torch, model, ids, device):
    with torch.no_grad():
        x = torch.tensor([ids], dtype=torch.long, device=device)
        return model(input_ids=x, use_cache=False).logits[0].float().cpu()


def reference(torch, model32, prompts, device):
    """Greedy tokens (full recompute per step) and teacher-forced logits rows [STEPS, vocab]."""
    out = []
    for p in prompts:
        seq = list(p)
        for _ in range(STEPS):
            seq.append(int(forward_logits(torch, model32, seq, device)[-1].argmax()))
        greedy = seq[len(p):]
        rows = forward_logits(torch, model32, seq[:-1], device)[len(p) - 1:]
        out.append((greedy, rows))
    return out


def compare(torch, rows, ref_rows):
    try:
        a = torch.tensor(rows, dtype=torch.float64)
    except (TypeError, ValueError):  # null (non-finite) entries
        return None
    b = ref_rows.to(torch.float64)
    if a.shape != b.shape or not torch.isfinite(a).all():
        return None
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    diff = (a - b).abs().amax(dim=-1)
    return dict(cos_min=float(cos.min()), cos_last=float(cos[0]), maxabs=float(diff.max()),
                maxabs_last=float(diff[0]), row_maxabs=[float(x) for x in diff])


def greedy_ok(torch, got, ref_greedy, ref_rows, row_maxabs):
    """Matched prefix length, and whether a divergence is a near-tie the deviation explains."""
    n = 0
    while n < len(ref_greedy) and n < len(got) and got[n] == ref_greedy[n]:
        n += 1
    if n == len(ref_greedy):
        return n, True, ""
    r = ref_rows[n]
    margin = float(r[ref_greedy[n]] - r[got[n]])
    ok = margin <= 2.0 * row_maxabs[n]
    return n, ok, "diverged at step %d: ref top-2 margin %.4f vs 2 x max|diff| %.4f" % (n, margin, 2 * row_maxabs[n])


def rope_type_of(rope):
    """The rope type of a transformers rope_scaling / rope_parameters dict, or of kvfuse-eval's."""
    rope = rope or {}
    return rope.get("rope_type", rope.get("type", "default"))


def run_kvfuse(binary, model_dir, device, kv, prompts, forced, workdir, extra=(), max_seq_len=512):
    inp = os.path.join(workdir, "in.json")
    outp = os.path.join(workdir, "out.json")
    with open(inp, "w") as f:
        json.dump({"prompts": prompts, "steps": STEPS, "forced": forced}, f)
    cmd = [binary, "--set", "model_path=" + model_dir, "--set", "device=" + device, "--set", "kv_cache_dtype=" + kv,
           "--set", "max_seq_len=%d" % max_seq_len, "--set", "num_pages=256", "--set", "max_batch_tokens=256",
           "--input", inp, "--output", outp]
    for e in extra:
        cmd += ["--set", e]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, (r.stderr or r.stdout).strip()
    with open(outp) as f:
        return json.load(f), ""


def calibrate(binary, model_dir, device, prompts, workdir, max_seq_len=512):
    cal = os.path.join(os.path.dirname(os.path.abspath(binary)), "kvfuse-calibrate")
    if not os.path.exists(cal):
        return None, "kvfuse-calibrate not found beside kvfuse-eval"
    pj = os.path.join(workdir, "calib_prompts.json")
    with open(pj, "w") as f:
        json.dump(prompts, f)
    out = os.path.join(workdir, "scales.json")
    r = subprocess.run([cal, "--set", "model_path=" + model_dir, "--set", "device=" + device,
                        "--set", "max_seq_len=%d" % max_seq_len, "--prompts", pj, "-o", out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, (r.stderr or r.stdout).strip()
    with open(out) as f:
        return json.load(f), out


def checkpoint_with_scales(model_dir, scales, dst):
    """A copy of the checkpoint with the scales as self_attn.k_scale / v_scale tensors."""
    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    for l, (k, v) in enumerate(zip(scales["k_scale"], scales["v_scale"])):
        t["model.layers.%d.self_attn.k_scale" % l] = torch.tensor(k, dtype=torch.float32)
        t["model.layers.%d.self_attn.v_scale" % l] = torch.tensor(v, dtype=torch.float32)
    save_file(t, path, metadata={"format": "pt"})


def devices_of(torch, transformers, asked, name):
    """The reference's device (the GPU torch sees, TF32 off, else the CPU) and kvfuse's
    devices (asked, or the CPU and that GPU); logs both."""
    gpu = torch.cuda.is_available()
    ref_device = "cuda" if gpu else "cpu"
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    devices = asked or (["cpu"] + (["hip" if torch.version.hip else "cuda"] if gpu else []))
    log("%s: torch %s, transformers %s; reference in fp32 on %s (eager attention, TF32 off); kvfuse on %s"
        % (name, torch.__version__, transformers.__version__, ref_device, ", ".join(devices)))
    return ref_device, devices


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvfuse-bin", default="build/kvfuse-eval")
    ap.add_argument("--device", action="append", help="kvfuse device (cpu, cuda, hip); default cpu plus the GPU torch sees")
    ap.add_argument("--arch", action="append", choices=sorted(MODELS))
    ap.add_argument("--keep", help="keep the model directories and JSON files here")
    ap.add_argument("--json-out", help="write every metric here")
    args = ap.parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        log("hf_reference: PyTorch and transformers are not installed (%s); skipping the reference check" % e)
        return 0
    if not os.path.exists(args.kvfuse_bin):
        log("hf_reference: %s not found; build it (tools/CMakeLists.txt) or pass --kvfuse-bin" % args.kvfuse_bin)
        return 2

    ref_device, devices = devices_of(torch, transformers, args.device, "hf_reference")

    work = args.keep or tempfile.mkdtemp(prefix="kvfuse-hfref-")
    os.makedirs(work, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    failures, report = [], []
    for arch in args.arch or sorted(MODELS):
        model16 = build_model(torch, transformers, arch)
        model_dir = os.path.join(work, arch)
        shutil.rmtree(model_dir, ignore_errors=True)
        try:
            model16.save_pretrained(model_dir, safe_serialization=True)
        except TypeError:  # versions that only write safetensors
            model16.save_pretrained(model_dir)
        model32 = copy.deepcopy(model16).float().to(ref_device)
        ref = reference(torch, model32, prompts, ref_device)
        sigma = float(torch.cat([r for _, r in ref]).std())
        hf16 = max(compare(torch, forward_logits(torch, model16.to(ref_device), p + gr[:-1], ref_device)[len(p) - 1:].tolist(),
                           rows)["maxabs"] for p, (gr, rows) in zip(prompts, ref))
        del model32
        cfg = model16.config
        window = getattr(cfg, "sliding_window", None)
        want_swa = list(getattr(cfg, "layer_types", None) or []) or (
            ["sliding_attention" if arch == "mistral" and window else "full_attention"] * cfg.num_hidden_layers)
        # transformers 5 keeps the scaling in rope_parameters, 4.x in rope_scaling.
        hf_rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        want_rope = rope_type_of(hf_rope)
        # kvfuse refuses max_seq_len beyond the model's positions (qwen2-yarn: 256).
        seq_cap = min(512, cfg.max_position_embeddings)
        log("\n%s: %d layers, window %s, tied %s, rope %s; reference logits sigma %.3f; hf-bf16 max|diff| %.4f"
            % (arch, cfg.num_hidden_layers, getattr(cfg, "sliding_window", None), cfg.tie_word_embeddings,
               want_rope, sigma, hf16))
        forced = [gr for gr, _ in ref]
        for device in devices:
            runs = [("bf16", "default", ()), ("fp8_e4m3", "default", ())]
            scales, scales_file = calibrate(args.kvfuse_bin, model_dir, device, prompts, work, seq_cap)
            if scales is None:
                failures.append("%s %s: kvfuse-calibrate failed: %s" % (arch, device, scales_file))
            else:
                runs.append(("fp8_e4m3", "kv_scales_file", ("kv_scales_file=" + scales_file,)))
                try:
                    sdir = model_dir + "-scales"
                    shutil.rmtree(sdir, ignore_errors=True)
                    checkpoint_with_scales(model_dir, scales, sdir)
                    runs.append(("fp8_e4m3", "checkpoint", (), sdir))
                except ImportError:
                    log("  (safetensors python package missing: checkpoint-scale run skipped)")
            logits_by_source = {}
            for run in runs:
                kv, source, extra = run[0], run[1], run[2]
                mdir = run[3] if len(run) > 3 else model_dir
                name = "%s %s %s scales=%s" % (arch, device, kv, source)
                res, err = run_kvfuse(args.kvfuse_bin, mdir, device, kv, prompts, forced, work, extra, seq_cap)
                if res is None:
                    failures.append("%s: kvfuse-eval failed: %s" % (name, err))
                    log("  %-44s FAIL (kvfuse-eval: %s)" % (name, err.splitlines()[-1] if err else "?"))
                    continue
                got = ["sliding_attention" if s else "full_attention" for s in res["model"]["layer_is_swa"]]
                if got != want_swa:
                    failures.append("%s: layer types %s, transformers has %s" % (name, got, want_swa))
                got_rope = rope_type_of(res["model"].get("rope_scaling"))
                if got_rope != want_rope:
                    failures.append("%s: rope type %s, transformers has %s" % (name, got_rope, want_rope))
                min_cos, x_sigma, x_hf = BOUNDS[kv]
                bound = max(x_sigma * sigma, x_hf * hf16)
                worst = dict(cos_min=1.0, cos_last=1.0, maxabs=0.0, maxabs_last=0.0)
                greedy_notes, ok = [], True
                for i, r in enumerate(res["results"]):
                    m = compare(torch, r["forced_logits"], ref[i][1])
                    if m is None:
                        ok = False
                        greedy_notes.append("prompt %d: non-finite or mis-shaped logits" % i)
                        continue
                    for k in ("cos_min", "cos_last"):
                        worst[k] = min(worst[k], m[k])
                    for k in ("maxabs", "maxabs_last"):
                        worst[k] = max(worst[k], m[k])
                    n, gok, note = greedy_ok(torch, r["greedy"], ref[i][0], ref[i][1], m["row_maxabs"])
                    ok = ok and gok
                    greedy_notes.append("%d/%d%s" % (n, STEPS, "" if not note else " (" + note + ")"))
                    logits_by_source.setdefault(source, []).append(r["forced_logits"])
                ok = ok and worst["cos_min"] >= min_cos and worst["maxabs"] <= bound
                log("  %-44s %s  last: cos %.6f max|diff| %.4f  all %d steps: cos >= %.6f max|diff| %.4f"
                    "  (bound cos >= %g, max|diff| <= %.3f)  greedy %s"
                    % (name, "PASS" if ok else "FAIL", worst["cos_last"], worst["maxabs_last"], STEPS,
                       worst["cos_min"], worst["maxabs"], min_cos, bound, ", ".join(greedy_notes)))
                if not ok:
                    failures.append(name)
                    if "sliding_attention" in want_swa and kv == "bf16":
                        # Diagnosis: an off-by-one window convention shows up as a better fit at W +- 1.
                        for w in (window - 1, window + 1):
                            alt, _ = run_kvfuse(args.kvfuse_bin, mdir, device, kv, prompts, forced, work,
                                                ("sliding_window=%d" % w,), seq_cap)
                            if alt:
                                d = max(compare(torch, r["forced_logits"], ref[i][1])["maxabs"]
                                        for i, r in enumerate(alt["results"]))
                                log("    diagnosis: with sliding_window=%d kvfuse's max|diff| is %.4f" % (w, d))
                report.append(dict(arch=arch, device=device, kv=kv, scales=source, ok=ok, bound=bound, sigma=sigma,
                                   hf_bf16_maxabs=hf16, greedy=greedy_notes, k_scale=res["k_scale"], **worst))
            if "kv_scales_file" in logits_by_source and "checkpoint" in logits_by_source:
                same = logits_by_source["kv_scales_file"] == logits_by_source["checkpoint"]
                log("  %-44s %s  (identical logits with the scales from a file and from checkpoint tensors)"
                    % ("%s %s fp8 file vs checkpoint scales" % (arch, device), "PASS" if same else "FAIL"))
                if not same:
                    failures.append("%s %s: kv_scales_file and checkpoint scales differ" % (arch, device))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    log("\nhf_reference: %s" % ("all checks passed" if not failures else "%d failed:\n  " % len(failures)
                                + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
