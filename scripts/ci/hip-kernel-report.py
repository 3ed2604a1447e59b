#!/usr/bin/env python3
"""Per-kernel resource table of kvfuse's HIP device code, and the gates CI applies.

Reads the machine code the build produced (not bitcode): for every object of the
kernel library (kernels/<family>/*.cu) it takes the offload bundle out of the object's
.hip_fatbin section, unbundles each gfx target's code object, and reads
  - the AMDHSA metadata (llvm-readelf --notes): VGPRs (arch + accumulation, as
    allocated), AGPRs, scratch (private segment bytes per lane), LDS (group segment
    bytes), the largest block the kernel allows;
  - the disassembly (llvm-objdump -d): the packed FP8 conversions and the MFMA
    (v_mfma_*) instructions of each kernel.

Occupancy (waves per SIMD) is computed, not measured, for blocks of the largest size
the kernel allows (its launch bounds; kernels launched smaller may fit more): gfx942
and gfx950 have 512 registers per SIMD lane shared by VGPRs and AGPRs, allocated in
granules of 8, at most 8 waves per SIMD and 4 SIMDs per CU; whole blocks must fit the
CU's registers and LDS (64 KiB a CU on gfx942, 160 KiB on gfx950). SGPRs do not limit
occupancy below 8 waves on these targets.

Gates (exit status 1 if any fails):
  - KV write (fused, RoPE fused with it, scatter, unfused scale/cast), RMSNorm (and the residual add fused
    with it), RoPE, sampling and argmax
    kernels: no scratch, and at least 4 waves per SIMD (TARGETS below): what the
    KV write's launch bounds promise (4 blocks of 256 threads a CU), and for the
    1024-thread sampling blocks what one resident block needs;
  - every fused FP8 KV-write kernel (with or without RoPE) contains the packed conversion of its format
    (v_cvt_pk_fp8_f32 for e4m3fn/e4m3fnuz, v_cvt_pk_bf8_f32 for e5m2) in the ISA of
    each arch whose hardware has that format: gfx942 all three (FNUZ hardware, OCP
    through the halving recipe), gfx950 e4m3fn and e5m2 (e4m3fnuz is not a gfx950
    format: there it is the scalar reference encoding, listed, not gated);
  - the MFMA probe kernels (kernels/attention/mfma/mfma_probe.cu, one per wrapper of kernels/attention/mfma/mfma.cuh):
    no scratch, and the matrix instruction each wrapper promises in the ISA of each
    arch (MFMA_PROBE below): 16x16x16 bf16/f16 on both, 16x16x32 bf16/f16 as one
    instruction on gfx950 and as two 16x16x16 on gfx942;
  - the MFMA attention kernels (kernels/attention/mfma/attention_mfma.cu, every head_dim x KV format x
    page mapping): no scratch, at least 2 waves per SIMD (its launch bounds: 2 blocks of
    4 waves a CU), matrix instructions in the ISA (MFMA_ATTENTION below: 16x16x16 on
    gfx942, 16x16x32 on gfx950), and the hardware FP8 decode where the arch has the
    format: v_cvt_pk_f32_fp8 for e4m3fnuz on gfx942, v_cvt_scalef32_pk_f16_fp8 for
    e4m3fn on gfx950 (the other e4m3 decodes by bit manipulation, e5m2 by a byte move);
  - the FP8-weight GEMV (kernels/gemm/gemv_fp8.cu: every row count, tiling, activation mode and
    e4m3 format, with and without its SiLU-mul epilogue), the activation quantizer and the FP8
    GEMM's epilogue: no scratch; at least 2 waves per SIMD for the GEMV (what its launch
    bounds promise, 4 blocks of 2 waves a CU: its many-row tilings hold up to 256 VGPRs of
    loads in flight and sums), 4 for the other two; the quantizing ones (the quantizer, the GEMV where it quantizes
    its activations, and the norm that quantizes its output, kernels/ops/norm_fp8.cu, gated
    at 4 waves as the other norm) contain the packed conversion of their format where the arch has it,
    as the KV write; every GEMV of the arch's hardware e4m3 format decodes its weights with
    that arch's instruction (v_cvt_pk_f32_fp8 for e4m3fnuz on gfx942,
    v_cvt_scalef32_pk_f32_fp8 for e4m3fn on gfx950);
  - every other attention kernel (the split path's merge): recorded;
  - model ops (model_op_report below): the kernels of kernels/ops/model_ops.cu and
    kernels/ops/sampling.cu reduce across lanes without ds_bpermute_b32 (DPP instead), take
    16-byte global loads where they have a vector path, and use no scratch.

Usage: scripts/ci/hip-kernel-report.py BUILD_DIR TOOL_DIR
  TOOL_DIR holds clang-offload-bundler, llvm-objcopy, llvm-readelf, llvm-objdump
  (the HIP compiler's own bin directory).
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ARCH = {  # LDS bytes per CU, max waves per SIMD
    "gfx942": (64 * 1024, 8),
    "gfx950": (160 * 1024, 8),
}
REGS_PER_LANE = 512
SIMDS_PER_CU = 4

# (family, name pattern, minimum waves per SIMD). First match wins.
TARGETS = [
    ("kv-write", r"^kv_write_fused_kernel<", 4),
    ("kv-write", r"^kv_write_token_kernel<", 4),
    ("kv-write", r"^kv_write_rope_kernel<", 4),
    ("kv-write", r"^kv_scatter_kernel", 4),
    ("kv-write", r"^kv_(scale|cast_fp8|cast_bf16)_kernel<", 4),
    ("norm", r"^rmsnorm_kernel<", 4),
    ("norm", r"^rmsnorm_fp8_kernel<", 4),
    ("rope", r"^rope_kernel", 4),
    ("sampling", r"^(sample_rows|argmax_rows)_kernel", 4),
    ("gemv-fp8", r"^gemv_fp8_kernel<", 2),
    ("gemv-fp8", r"^(quantize_rows_fp8_kernel<|fp8_gemm_epilogue_kernel)", 4),
    ("mfma", r"^mfma_probe_kernel<", 1),
    ("attention", r"^attention_mfma_kernel<", 2),
    ("attention", r"^attention_", None),
    ("other", r"", None),
]
FORMATS = {"0": "e4m3fn", "1": "e4m3fnuz", "2": "e5m2"}
# The FP8 GEMV's weight decode, per arch: (its hardware e4m3 format, the instruction;
# kernels/common/fp8_decode.cuh).
GEMV_FP8_DECODE = {"gfx942": ("e4m3fnuz", "v_cvt_pk_f32_fp8"), "gfx950": ("e4m3fn", "v_cvt_scalef32_pk_f32_fp8")}
KV_FORMATS = ["bf16", "e4m3fn", "e4m3fnuz", "e5m2"]  # kernels/common/kv_types.h KvFormat
# MFMA attention, per arch: the matrix instructions its bf16 / f16 operands become, and the
# hardware FP8 decode: (format, instruction) the kernels of that format must contain.
MFMA_ATTENTION = {
    "gfx942": (("v_mfma_f32_16x16x16_bf16", "v_mfma_f32_16x16x16_f16"), ("e4m3fnuz", "v_cvt_pk_f32_fp8")),
    "gfx950": (("v_mfma_f32_16x16x32_bf16", "v_mfma_f32_16x16x32_f16"), ("e4m3fn", "v_cvt_scalef32_pk_f16_fp8")),
}
MFMA_INSTRS = ["bf16_16x16x16", "f16_16x16x16", "bf16_16x16x32", "f16_16x16x32"]  # kernels/attention/mfma/mfma_probe.cuh
# (probe, arch) -> (mnemonic, how many) the kernel's ISA must contain.
MFMA_PROBE = {
    ("bf16_16x16x16", "gfx942"): ("v_mfma_f32_16x16x16_bf16", 1),
    ("bf16_16x16x16", "gfx950"): ("v_mfma_f32_16x16x16_bf16", 1),
    ("f16_16x16x16", "gfx942"): ("v_mfma_f32_16x16x16_f16", 1),
    ("f16_16x16x16", "gfx950"): ("v_mfma_f32_16x16x16_f16", 1),
    ("bf16_16x16x32", "gfx942"): ("v_mfma_f32_16x16x16_bf16", 2),
    ("bf16_16x16x32", "gfx950"): ("v_mfma_f32_16x16x32_bf16", 1),
    ("f16_16x16x32", "gfx942"): ("v_mfma_f32_16x16x16_f16", 2),
    ("f16_16x16x32", "gfx950"): ("v_mfma_f32_16x16x32_f16", 1),
}


def tool(tools, name, *fallbacks):
    """The compiler's own copy of a tool, else one on PATH (binutils' objcopy and c++filt
    do the same jobs as llvm-objcopy and llvm-cxxfilt, which not every ROCm ships)."""
    for cand in [os.path.join(tools, name), shutil.which(name)] + [shutil.which(f) for f in fallbacks]:
        if cand and os.access(cand, os.X_OK):
            return cand
    raise SystemExit("hip-kernel-report: %s not found in %s or on PATH" % (name, tools))


def run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def short_name(demangled):
    s = re.sub(r"^void ", "", demangled)
    s = s.replace("kvfuse::gpu::(anonymous namespace)::", "").replace("attention_detail::", "")
    s = s.replace("kvfuse::gpu::", "").replace("kvfuse::", "").replace("(anonymous namespace)::", "")
    s = re.sub(r"\(KvSrcDtype\)0", "bf16", s)
    s = re.sub(r"\(KvSrcDtype\)1", "f16", s)
    s = re.sub(r"\(Fp8Format\)(\d)", lambda m: FORMATS[m.group(1)], s)
    s = re.sub(r"\(KvFormat\)(\d)", lambda m: KV_FORMATS[int(m.group(1))], s)
    s = re.sub(r"\(KvKind\)(\d)", lambda m: ["bf16", "e4m3fn_hw", "e4m3fn_bits", "e4m3fnuz", "e5m2"][int(m.group(1))], s)
    s = s.replace("Fp8RowOp", "fp8").replace("Bf16RowOp", "bf16copy")
    s = re.sub(r"\(RowTeam\)(\d)", lambda m: ["warp_rows", "block_rows"][int(m.group(1))], s)
    s = re.sub(r"\(MfmaInstr\)(\d)", lambda m: MFMA_INSTRS[int(m.group(1))], s)
    s = re.sub(r"\(XMode\)(\d)", lambda m: ["bf16x", "codes", "quantize"][int(m.group(1))], s)
    return re.sub(r"\(.*\)$", "", s).replace(" ", "")


def kernels_of(code_object, tools):
    """[(symbol, {field: value})] from the AMDHSA metadata note."""
    notes = run(tool(tools, "llvm-readelf"), "--notes", code_object)
    out = []
    for line in notes.splitlines():
        # Kernel-level keys only: "  - .key: v" starts a kernel, "    .key: v" continues it
        # (the argument list is indented deeper).
        m = re.match(r"^(  - |    )\.(\w+):\s+(\S+)\s*$", line)
        if not m:
            continue
        if m.group(1) == "  - ":
            out.append({})
        if out:
            out[-1][m.group(2)] = m.group(3)
    return out


def isa_counts(code_object, arch, tools):
    """{symbol: [packed fp8 converts, packed bf8 converts, {v_mfma mnemonic: count},
    {FP8 decode mnemonic: count}]} from the disassembly."""
    asm = run(tool(tools, "llvm-objdump"), "-d", "--mcpu=" + arch, code_object)
    counts, cur = {}, None
    for line in asm.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            cur = m.group(1)
            counts[cur] = [0, 0, {}, {}]
        elif cur is not None:
            if "v_cvt_pk_fp8_f32" in line:
                counts[cur][0] += 1
            elif "v_cvt_pk_bf8_f32" in line:
                counts[cur][1] += 1
            else:
                mfma = re.search(r"\b(v_mfma_\w+)", line)
                if mfma:
                    counts[cur][2][mfma.group(1)] = counts[cur][2].get(mfma.group(1), 0) + 1
                dec = re.search(r"\b(v_cvt_pk_f32_fp8|v_cvt_scalef32_pk_f(?:16|32)_fp8)", line)
                if dec:
                    counts[cur][3][dec.group(1)] = counts[cur][3].get(dec.group(1), 0) + 1
    return counts


def occupancy(k, arch):
    lds_cu, max_waves = ARCH[arch]
    regs = int(k["vgpr_count"])
    granule = 8
    alloc = max(granule, (regs + granule - 1) // granule * granule)
    waves = min(max_waves, REGS_PER_LANE // alloc)
    # Whole blocks of the largest allowed size: how many fit a CU by registers and LDS.
    block_waves = (int(k["max_flat_workgroup_size"]) + 63) // 64
    blocks = waves * SIMDS_PER_CU // block_waves
    lds = int(k["group_segment_fixed_size"])
    if lds:
        blocks = min(blocks, lds_cu // lds)
    # Waves per SIMD averaged over the CU: one block of 2 waves on a CU is 0.5.
    return min(float(waves), blocks * block_waves / SIMDS_PER_CU)


# ---- Model ops ---------------------------------------------------------------------
# The row and elementwise kernels of kernels/ops/model_ops.cu and kernels/ops/sampling.cu. On
# CDNA a __shfl_xor is a ds_bpermute_b32 (an LDS round trip per 32-bit word and step);
# the warp reductions and scans of kernels/common/gpu.h use DPP there, so a reducing kernel
# with a ds_bpermute has fallen back to shuffles. A bf16 or fp32 row read by 2- or
# 4-byte loads moves 128 or 256 bytes per wave instruction: the kernels with a 16-byte
# path must contain global_load_dwordx4. (name pattern, no ds_bpermute, wide loads,
# scratch allowed). logprobs_rows keeps each thread's top-20 list in an array indexed at
# run time, which lives in scratch: recorded, not gated.
MODEL_OPS = [
    (r"^rmsnorm_kernel<(true|false)>$", True, True, False),
    (r"^(rope|silu_mul|residual_add)_kernel<true>$", False, True, False),
    (r"^(argmax_rows|sample_rows)_kernel$", True, True, False),
    (r"^logprobs_rows_kernel$", True, True, True),
    (r"", False, False, False),
]


def model_op_report(build, tools):
    """Prints the model-op kernels' table; returns its gate failures."""
    failures, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for src in ("model_ops", "sampling"):
            obj = os.path.join(build, "CMakeFiles", "kvfuse_kernels_gpu.dir", "kernels", "ops", src + ".cu.o")
            if not os.path.exists(obj):
                failures.append("model ops: no object " + obj)
                continue
            fatbin = os.path.join(tmp, src + ".fatbin")
            run(tool(tools, "llvm-objcopy", "objcopy"), "--dump-section=.hip_fatbin=" + fatbin, obj,
                os.path.join(tmp, "copy.o"))
            targets = run(tool(tools, "clang-offload-bundler"), "--list", "--type=o", "--input=" + fatbin)
            for target in targets.split():
                arch = target.rsplit("--", 1)[-1].split(":")[0]
                if not target.startswith("hip") or arch not in ARCH:
                    continue
                co = os.path.join(tmp, src + "." + arch + ".co")
                run(tool(tools, "clang-offload-bundler"), "--unbundle", "--type=o", "--input=" + fatbin,
                    "--targets=" + target, "--output=" + co)
                counts, cur = {}, None
                for line in run(tool(tools, "llvm-objdump"), "-d", "--mcpu=" + arch, co).splitlines():
                    m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
                    if m:
                        cur = m.group(1)
                        counts[cur] = dict(bperm=0, dpp=0, readlane=0, x4=0, narrow=0)
                    elif cur is not None:
                        c = counts[cur]
                        c["bperm"] += "ds_bpermute_b32" in line
                        c["dpp"] += bool(re.search(r"\b(quad_perm|row_\w+)[:\s]", line))
                        c["readlane"] += "v_readlane_b32" in line
                        c["x4"] += bool(re.search(r"\bglobal_load_dwordx4\b", line))
                        c["narrow"] += bool(re.search(r"\bglobal_load_(ushort|short_d16\w*|dword)\b", line))
                ks = kernels_of(co, tools)
                names = [k["name"] for k in ks]
                demangled = run(tool(tools, "llvm-cxxfilt", "c++filt"), *names).splitlines() if names else []
                for k, dm in zip(ks, demangled):
                    name = short_name(dm)
                    _, no_bperm, wide, scratch_ok = next(t for t in MODEL_OPS if re.search(t[0], name))
                    c = counts.get(k["name"], dict(bperm=0, dpp=0, readlane=0, x4=0, narrow=0))
                    scratch = int(k["private_segment_fixed_size"])
                    bad = []
                    if (scratch or k.get("uses_dynamic_stack") == "true") and not scratch_ok:
                        bad.append("scratch")
                    if no_bperm and c["bperm"]:
                        bad.append("ds_bpermute")
                    if wide and not c["x4"]:
                        bad.append("no global_load_dwordx4")
                    verdict = ("FAIL " + ",".join(bad)) if bad else ("ok" if no_bperm or wide else "recorded")
                    if bad:
                        failures.append("%s %s: %s" % (arch, name, verdict))
                    rows.append((arch, name, int(k["vgpr_count"]), scratch, c, verdict))
    rows.sort(key=lambda r: (r[1], r[0]))
    w = max([len(r[1]) for r in rows] + [6])
    hdr = "%-6s  %-*s  %5s %7s %6s %4s %8s %6s %6s  %s" % ("arch", w, "kernel", "VGPR", "scratch", "bperm", "dpp",
                                                          "readlane", "ldx4", "ld<16", "gate")
    print("hip-kernel-report: model ops (kernels/ops/model_ops.cu, kernels/ops/sampling.cu)")
    print(hdr)
    print("-" * len(hdr))
    for arch, name, vgpr, scratch, c, verdict in rows:
        print("%-6s  %-*s  %5d %7d %6d %4d %8d %6d %6d  %s" % (arch, w, name, vgpr, scratch, c["bperm"], c["dpp"],
                                                              c["readlane"], c["x4"], c["narrow"], verdict))
    print("hip-kernel-report: model-op columns: bperm = ds_bpermute_b32, dpp = instructions with a DPP control, "
          "readlane = v_readlane_b32, ldx4 = global_load_dwordx4, ld<16 = global loads of 2 or 4 bytes")
    return failures


def main():
    build, tools = sys.argv[1], sys.argv[2]
    objs = sorted(glob.glob(os.path.join(build, "CMakeFiles", "kvfuse_kernels_gpu.dir", "kernels", "**", "*.cu.o"),
                            recursive=True))
    if not objs:
        print("hip-kernel-report: no kernel objects under " + build)
        return 1
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for obj in objs:
            # A source whose kernels this vendor never instantiates (attention_unified.cu's
            # mma.sync kernel: HIP runs the MFMA kernel) has no device code at all.
            if ".hip_fatbin" not in run(tool(tools, "llvm-readelf", "readelf"), "-S", "-W", obj):
                print("hip-kernel-report: %s: no device code" % os.path.basename(obj))
                continue
            fatbin = os.path.join(tmp, "fatbin")
            run(tool(tools, "llvm-objcopy", "objcopy"), "--dump-section=.hip_fatbin=" + fatbin, obj,
                os.path.join(tmp, "copy.o"))
            targets = run(tool(tools, "clang-offload-bundler"), "--list", "--type=o", "--input=" + fatbin)
            for target in targets.split():
                arch = target.rsplit("--", 1)[-1].split(":")[0]
                if not target.startswith("hip") or arch not in ARCH:
                    continue
                co = os.path.join(tmp, arch + ".co")
                run(tool(tools, "clang-offload-bundler"), "--unbundle", "--type=o", "--input=" + fatbin,
                    "--targets=" + target, "--output=" + co)
                isa = isa_counts(co, arch, tools)
                names = [k["name"] for k in kernels_of(co, tools)]
                demangled = run(tool(tools, "llvm-cxxfilt", "c++filt"), *names).splitlines() if names else []
                for k, dm in zip(kernels_of(co, tools), demangled):
                    name = short_name(dm)
                    family, target_occ = next((f, t) for f, p, t in TARGETS if re.search(p, name))
                    fp8, bf8, mfma, decode = isa.get(k["name"], [0, 0, {}, {}])
                    rows.append(dict(arch=arch, src=os.path.basename(obj).replace(".o", ""), name=name, family=family,
                                     target=target_occ, vgpr=int(k["vgpr_count"]), agpr=int(k["agpr_count"]),
                                     scratch=int(k["private_segment_fixed_size"]),
                                     lds=int(k["group_segment_fixed_size"]),
                                     block=int(k["max_flat_workgroup_size"]), occ=occupancy(k, arch),
                                     dyn=k.get("uses_dynamic_stack") == "true", fp8=fp8, bf8=bf8, mfma=mfma,
                                     decode=decode,
                                     sym=k["name"]))

    rows.sort(key=lambda r: (r["src"], r["name"], r["arch"]))
    w = max(len(r["name"]) for r in rows)
    print("hip-kernel-report: %d kernels x arch from %d objects (machine code, AMDHSA metadata)" %
          (len(rows), len(objs)))
    hdr = "%-6s  %-*s  %5s %5s %7s %6s %5s %4s/%-4s %5s %4s  %s" % ("arch", w, "kernel", "VGPR", "AGPR", "scratch",
                                                                 "LDS", "block", "occ", "tgt", "pkcvt", "mfma",
                                                                 "gate")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        verdict = ""
        if r["target"] is not None:
            bad = []
            if r["scratch"] or r["dyn"]:
                bad.append("scratch")
            if r["occ"] < r["target"]:
                bad.append("occupancy")
            verdict = "FAIL " + ",".join(bad) if bad else "ok"
        fused = (re.match(r"^kv_write_(?:fused|token)_kernel<fp8<\w+,(\w+)>", r["name"]) or
                 re.match(r"^kv_write_rope_kernel<\d+,(e4m3fn|e4m3fnuz|e5m2)[,>]", r["name"]))
        if fused:
            fmt = fused.group(1)
            need = not (r["arch"] == "gfx950" and fmt == "e4m3fnuz")
            have = r["bf8"] if fmt == "e5m2" else r["fp8"]
            if need and have == 0:
                verdict = (verdict + " " if verdict != "ok" else "") + "FAIL no packed cvt"
            elif not need:
                verdict += " (scalar: not a gfx950 format)"
        # The FP8 GEMV, quantizer and quantizing norm: the packed encode where they quantize, the hardware decode
        # of the arch's own e4m3 format in every GEMV.
        quant = (re.match(r"^quantize_rows_fp8_kernel<(e4m3fn|e4m3fnuz),", r["name"]) or
                 re.match(r"^gemv_fp8_kernel<\d+,quantize,(e4m3fn|e4m3fnuz),", r["name"]) or
                 re.match(r"^rmsnorm_fp8_kernel<\w+,(e4m3fn|e4m3fnuz),", r["name"]))
        if quant and not (r["arch"] == "gfx950" and quant.group(1) == "e4m3fnuz") and r["fp8"] == 0:
            verdict = (verdict + " " if verdict != "ok" else "") + "FAIL no packed cvt"
        gemv = re.match(r"^gemv_fp8_kernel<\d+,\w+,(e4m3fn|e4m3fnuz),", r["name"])
        if gemv:
            hw_fmt, hw_cvt = GEMV_FP8_DECODE[r["arch"]]
            if gemv.group(1) == hw_fmt and r["decode"].get(hw_cvt, 0) == 0:
                verdict = (verdict + " " if verdict != "ok" else "") + "FAIL no " + hw_cvt
        probe = re.match(r"^mfma_probe_kernel<(\w+)>", r["name"])
        if probe:
            mnemonic, need = MFMA_PROBE[(probe.group(1), r["arch"])]
            have = r["mfma"].get(mnemonic, 0)
            if have != need:
                verdict = (verdict + " " if verdict != "ok" else "") + "FAIL %s x%d, want x%d" % (mnemonic, have, need)
            else:
                verdict += " (%s x%d)" % (mnemonic, have)
        attn = re.match(r"^attention_mfma_kernel<(\d+),(\w+),(\w+)>", r["name"])
        if attn:
            (bf16_mfma, f16_mfma), (hw_fmt, hw_cvt) = MFMA_ATTENTION[r["arch"]]
            want = bf16_mfma if attn.group(2) == "bf16" else f16_mfma
            if r["mfma"].get(want, 0) == 0:
                verdict = (verdict + " " if verdict != "ok" else "") + "FAIL no " + want
            if attn.group(2) == hw_fmt:
                if r["decode"].get(hw_cvt, 0) == 0:
                    verdict = (verdict + " " if verdict != "ok" else "") + "FAIL no " + hw_cvt
                else:
                    verdict += " (%s x%d)" % (hw_cvt, r["decode"][hw_cvt])
        if "FAIL" in verdict:
            failures.append("%s %s: %s" % (r["arch"], r["name"], verdict))
        print("%-6s  %-*s  %5d %5d %7d %6d %5d %4g/%-4s %5s %4s  %s" %
              (r["arch"], w, r["name"], r["vgpr"], r["agpr"], r["scratch"], r["lds"], r["block"], r["occ"],
               "-" if r["target"] is None else r["target"], r["fp8"] + r["bf8"] or "",
               sum(r["mfma"].values()) or "", verdict or "recorded"))
    for arch in ARCH:
        writes = ("kv_write_fused_kernel<fp8", "kv_write_token_kernel<fp8")
        n = sum(r["fp8"] + r["bf8"] for r in rows if r["arch"] == arch and r["name"].startswith(writes))
        fused = sum(1 for r in rows if r["arch"] == arch and r["name"].startswith(writes))
        print("hip-kernel-report: %s: %d packed FP8 conversions in %d fused FP8 KV-write kernels" % (arch, n, fused))
        rope = [r for r in rows if r["arch"] == arch and r["name"].startswith("kv_write_rope_kernel<")]
        print("hip-kernel-report: %s: %d packed FP8 conversions in %d RoPE + KV-write kernels" %
              (arch, sum(r["fp8"] + r["bf8"] for r in rope), len(rope)))
        if not rope:
            failures.append("%s: no RoPE + KV-write kernels (kernels/kv_write/kv_write_rope.cu)" % arch)
    for arch in ARCH:
        probes = [r for r in rows if r["arch"] == arch and r["name"].startswith("mfma_probe_kernel<")]
        print("hip-kernel-report: %s: MFMA probe: %s" % (arch, ", ".join(
            "%s %s" % (r["name"][len("mfma_probe_kernel<"):-1],
                       " ".join("%s x%d" % kv for kv in sorted(r["mfma"].items())) or "no v_mfma")
            for r in probes) or "no probe kernels"))
        if len(probes) != len(MFMA_INSTRS):
            failures.append("%s: %d MFMA probe kernels, want %d" % (arch, len(probes), len(MFMA_INSTRS)))
    for arch in ARCH:
        attn = [r for r in rows if r["arch"] == arch and r["name"].startswith("attention_mfma_kernel<")]
        print("hip-kernel-report: %s: MFMA attention: %d kernels, VGPR %s, scratch %s, occupancy %s waves/SIMD, "
              "%d matrix instructions, %d hardware FP8 decodes" % (
                  arch, len(attn), "%d..%d" % (min(r["vgpr"] for r in attn), max(r["vgpr"] for r in attn)) if attn
                  else "-", max([r["scratch"] for r in attn] or [0]),
                  "%g..%g" % (min(r["occ"] for r in attn), max(r["occ"] for r in attn)) if attn else "-",
                  sum(sum(r["mfma"].values()) for r in attn), sum(sum(r["decode"].values()) for r in attn)))
        if len(attn) != 3 * 4 * 2:  # head dims x KV formats x page mappings
            failures.append("%s: %d MFMA attention kernels, want 24" % (arch, len(attn)))
    for arch in ARCH:
        if not any(r["arch"] == arch for r in rows):
            failures.append("no code object for " + arch)
    failures += model_op_report(build, tools)
    print("hip-kernel-report: columns: VGPR = arch+acc registers allocated per lane, scratch = bytes per lane, "
          "LDS = bytes per block, block = largest block allowed, occ/tgt = waves per SIMD computed / gated minimum, "
          "pkcvt = v_cvt_pk_{fp8,bf8}_f32 in the kernel, mfma = v_mfma_* in the kernel")
    if failures:
        for f in failures:
            print("hip-kernel-report: FAIL " + f)
        return 1
    print("hip-kernel-report: all gates pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
