#!/usr/bin/env python3
"""Reference check of FP8 checkpoints: kvfuse against Hugging Face transformers.

    python3 tests/hf_reference_fp8.py --kvfuse-bin build/kvfuse-eval [--device cpu --device cuda]

Without PyTorch and transformers it says so and exits 0. Nothing is downloaded. The
models are tests/hf_reference.py's Llama (GQA 2:1) and Qwen2 (q/k/v biases, tied
embeddings), built and given bf16 weights the same way, then written as FP8 checkpoints
in three layouts:
  ct-dynamic      compressed-tensors (llm-compressor's FP8_DYNAMIC): weights per channel,
                  activations quantized per token at run time (W8A8);
  ct-weight-only  compressed-tensors, weights per channel, no input_activations (W8A16);
  quark-static    Quark: weights per tensor, activations static per tensor (W8A8), their
                  input_scale calibrated on the prompts (largest |input| / 448).
Every q/k/v/o/gate/up/down projection is stored as F8_E4M3 codes (scale = largest |w| /
448 of the row or the tensor, codes rounded to nearest even) with F32 scales; the
embeddings, norms and lm_head stay bf16 (`ignore` / `exclude`: lm_head).

Reference: the model in fp32 with each projection's weight replaced by its dequantized
value (code x scale) and, for W8A8, each projection's input quantized as the checkpoint
declares and dequantized: s = max(amax(row) / 448, 1 / (448 x 512)) per token, or the
input_scale; codes = e4m3(x x (1 / s)) saturated at +-448, rounded to nearest even; x' =
codes x s. That is the arithmetic kvfuse states (kernels/cpu/gemm/gemm_fp8.h), with fp32
activations where kvfuse's are bf16. kvfuse-eval then runs each checkpoint on each device
(bf16 KV cache): greedy tokens, and logits along the reference's tokens, compared as
tests/hf_reference.py compares them. Bounds, with sigma the reference logits' standard
deviation and hf-bf16 the max |diff| of the same reference model run in bf16 (the noise
floor of bf16 arithmetic):
  W8A16: cosine >= 0.9995 and max |diff| <= max(0.15 sigma, 3 x hf-bf16) (hf_reference's
         bf16 bound: the weights are exact, only bf16 activations differ);
  W8A8:  cosine >= min(0.999, 1 - 2 (1 - hf-bf16 cosine)) and max |diff| <= max(0.3 sigma,
         6 x hf-bf16): an activation that a rounding moves across an FP8 rounding boundary
         moves by a whole e4m3 step, so the reference itself, run in bf16, can be farther
         than 0.999 from its fp32 run (on Qwen2, 2026-12-05); kvfuse may be twice as far.
Greedy tokens must equal the reference's, or diverge only at a near-tie (the reference's
top-2 margin within 2 x max |diff| at that step). Exit status: 0 all pass (or no PyTorch),
1 a check failed, 2 kvfuse-eval is missing.
"""
import argparse
import copy
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_reference as H  # noqa: E402

ARCHS = ("llama", "qwen2")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
MIN_ACT_SCALE = 1.0 / (448.0 * 512.0)
BOUNDS = {"W8A16": (0.9995, 0.15, 3.0), "W8A8": (0.999, 0.3, 6.0)}  # (min cos, x sigma, x hf-bf16)

CT_DYNAMIC = {
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True,
                              "type": "float"},
        "output_activations": None,
        "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "strategy": "channel", "symmetric": True, "type": "float"}}},
    "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}
CT_WEIGHT_ONLY = copy.deepcopy(CT_DYNAMIC)
CT_WEIGHT_ONLY["config_groups"]["group_0"]["input_activations"] = None
QUARK_FP8 = {"dtype": "fp8_e4m3", "is_dynamic": False, "qscheme": "per_tensor", "symmetric": True}
QUARK_STATIC = {
    "quant_method": "quark", "exclude": ["lm_head"],
    "export": {"kv_cache_group": [], "weight_format": "real_quantized"},
    "global_quant_config": {"weight": QUARK_FP8, "input_tensors": QUARK_FP8, "output_tensors": None, "bias": None}}
# name: (quantization_config, weight scales per channel, activations: None | "dynamic" | "static")
LAYOUTS = {
    "ct-dynamic": (CT_DYNAMIC, True, "dynamic"),
    "ct-weight-only": (CT_WEIGHT_ONLY, True, None),
    "quark-static": (QUARK_STATIC, False, "static"),
}


def projections(model):
    """(name, module) of every projection the checkpoint stores in FP8."""
    return [(n, m) for n, m in model.named_modules() if n.split(".")[-1] in TARGETS]


def quantize_weight(torch, w, per_channel):
    """e4m3fn codes and fp32 scales ([n, 1] per channel, [] per tensor) of a weight [n, k]."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def fake_quant(torch, x, act, static_scale):
    """x quantized to e4m3 as the checkpoint declares, and dequantized (in x's dtype)."""
    dtype = x.dtype
    x = x.float()
    if act == "dynamic":
        s = torch.clamp(x.abs().amax(dim=-1, keepdim=True) / FP8_MAX, min=MIN_ACT_SCALE)
    else:
        s = torch.tensor(static_scale, dtype=torch.float32, device=x.device)
    q = (x * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).to(dtype)


def calibrate_inputs(torch, model, prompts, device):
    """Each projection's largest |input| over the prompts (the quark-static input scales)."""
    amax, hooks = {}, []
    for name, mod in projections(model):
        def hook(_m, args, name=name):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        hooks.append(mod.register_forward_pre_hook(hook))
    for p in prompts:
        H.forward_logits(torch, model, p, device)
    for h in hooks:
        h.remove()
    return amax


def write_fp8(torch, model16, layout, input_scales, model_dir, dst):
    """model_dir's checkpoint with its projections in FP8 as `layout` stores them, into dst;
    returns {projection: (codes, scale)}."""
    from safetensors.torch import load_file, save_file
    quant, per_channel, act = LAYOUTS[layout]
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(model_dir, dst)
    path = os.path.join(dst, "model.safetensors")
    t = load_file(path)
    q = {}
    for name, mod in projections(model16):
        codes, scale = quantize_weight(torch, mod.weight.detach().cpu(), per_channel)
        q[name] = (codes, scale)
        t[name + ".weight"] = codes.contiguous()
        t[name + ".weight_scale"] = scale.contiguous()
        if act == "static":
            t[name + ".input_scale"] = torch.tensor(input_scales[name], dtype=torch.float32)
    save_file(t, path, metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return q


def reference_model(torch, model16, q, layout, input_scales, device, dtype):
    """The model computing what the FP8 checkpoint declares, in `dtype` (fp32: the reference;
    bf16: its noise floor)."""
    _, _, act = LAYOUTS[layout]
    model = copy.deepcopy(model16).float()
    mods = dict(projections(model))
    with torch.no_grad():
        for name, (codes, scale) in q.items():
            mods[name].weight.copy_(codes.float() * scale)
    if act is not None:
        for name, mod in mods.items():
            mod.register_forward_pre_hook(
                lambda _m, args, s=input_scales.get(name): (fake_quant(torch, args[0], act, s),) + tuple(args[1:]))
    return model.to(device=device, dtype=dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvfuse-bin", default="build/kvfuse-eval")
    ap.add_argument("--device", action="append", help="kvfuse device (cpu, cuda, hip); default cpu plus the GPU torch sees")
    ap.add_argument("--arch", action="append", choices=ARCHS)
    ap.add_argument("--layout", action="append", choices=sorted(LAYOUTS))
    ap.add_argument("--keep", help="keep the model directories and JSON files here")
    ap.add_argument("--json-out", help="write every metric here")
    args = ap.parse_args()
    try:
        import torch
        import transformers
        import safetensors  # noqa: F401
    except ImportError as e:
        H.log("hf_reference_fp8: PyTorch, transformers or safetensors is not installed (%s); skipping" % e)
        return 0
    if not os.path.exists(args.kvfuse_bin):
        H.log("hf_reference_fp8: %s not found; build it (tools/CMakeLists.txt) or pass --kvfuse-bin" % args.kvfuse_bin)
        return 2
    ref_device, devices = H.devices_of(torch, transformers, args.device, "hf_reference_fp8")
    work = args.keep or tempfile.mkdtemp(prefix="kvfuse-hfref-fp8-")
    os.makedirs(work, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, H.VOCAB, (n,), generator=g).tolist() for n in H.PROMPT_LENS]
    failures, report = [], []
    for arch in args.arch or ARCHS:
        model16 = H.build_model(torch, transformers, arch)
        bf16_dir = os.path.join(work, arch)
        shutil.rmtree(bf16_dir, ignore_errors=True)
        model16.save_pretrained(bf16_dir, safe_serialization=True)
        input_scales = {n: a / FP8_MAX for n, a in
                        calibrate_inputs(torch, copy.deepcopy(model16).float().to(ref_device), prompts,
                                         ref_device).items()}
        for layout in args.layout or sorted(LAYOUTS):
            kind = "W8A16" if LAYOUTS[layout][2] is None else "W8A8"
            mdir = os.path.join(work, "%s-%s" % (arch, layout))
            q = write_fp8(torch, model16, layout, input_scales, bf16_dir, mdir)
            ref_model = reference_model(torch, model16, q, layout, input_scales, ref_device, torch.float32)
            ref = H.reference(torch, ref_model, prompts, ref_device)
            del ref_model
            sigma = float(torch.cat([r for _, r in ref]).std())
            # The same model in bf16: the noise floor of bf16 arithmetic on these weights.
            model_bf16 = reference_model(torch, model16, q, layout, input_scales, ref_device, torch.bfloat16)
            floor = [H.compare(torch, H.forward_logits(torch, model_bf16, p + gr[:-1], ref_device)[len(p) - 1:]
                               .tolist(), rows) for p, (gr, rows) in zip(prompts, ref)]
            hf16 = max(m["maxabs"] for m in floor)
            hf16_cos = min(m["cos_min"] for m in floor)
            del model_bf16
            H.log("\n%s %s (%s): reference logits sigma %.3f; hf-bf16 max|diff| %.4f, cos >= %.6f"
                  % (arch, layout, kind, sigma, hf16, hf16_cos))
            forced = [gr for gr, _ in ref]
            min_cos, x_sigma, x_hf = BOUNDS[kind]
            if kind == "W8A8":  # no stricter than twice the bf16 run's own distance (in 1 - cos)
                min_cos = min(min_cos, 1.0 - 2.0 * (1.0 - hf16_cos))
            bound = max(x_sigma * sigma, x_hf * hf16)
            for device in devices:
                name = "%s %s %s" % (arch, layout, device)
                res, err = H.run_kvfuse(args.kvfuse_bin, mdir, device, "bf16", prompts, forced, work)
                if res is None:
                    failures.append("%s: kvfuse-eval failed: %s" % (name, err))
                    H.log("  %-36s FAIL (kvfuse-eval: %s)" % (name, err.splitlines()[-1] if err else "?"))
                    continue
                worst = dict(cos_min=1.0, maxabs=0.0)
                notes, ok = [], True
                for i, r in enumerate(res["results"]):
                    m = H.compare(torch, r["forced_logits"], ref[i][1])
                    if m is None:
                        ok = False
                        notes.append("prompt %d: non-finite or mis-shaped logits" % i)
                        continue
                    worst["cos_min"] = min(worst["cos_min"], m["cos_min"])
                    worst["maxabs"] = max(worst["maxabs"], m["maxabs"])
                    n, gok, note = H.greedy_ok(torch, r["greedy"], ref[i][0], ref[i][1], m["row_maxabs"])
                    ok = ok and gok
                    notes.append("%d/%d%s" % (n, H.STEPS, "" if not note else " (" + note + ")"))
                ok = ok and worst["cos_min"] >= min_cos and worst["maxabs"] <= bound
                H.log("  %-36s %s  all %d steps: cos >= %.6f max|diff| %.4f  (bound cos >= %g, max|diff| <= %.3f)"
                      "  greedy %s" % (name, "PASS" if ok else "FAIL", H.STEPS, worst["cos_min"], worst["maxabs"],
                                       min_cos, bound, ", ".join(notes)))
                if not ok:
                    failures.append(name)
                report.append(dict(arch=arch, layout=layout, kind=kind, device=device, ok=ok, bound=bound, sigma=sigma,
                                   hf_bf16_maxabs=hf16, hf_bf16_cos=hf16_cos, min_cos=min_cos, greedy=notes, **worst))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    H.log("\nhf_reference_fp8: %s" % ("all checks passed" if not failures else "%d failed:\n  " % len(failures)
                                     + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
