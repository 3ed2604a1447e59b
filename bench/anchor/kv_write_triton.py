#!/usr/bin/env python3
"""A Triton peer of kvfuse's fused KV write, timed the way bench_kv_write times its own.

The kernel has the fused write's semantics (kernels/kv_write/kv_write.cuh): bf16 K and V rows of
8 KV heads x 128 for T tokens, one int64 slot per token (negative: skipped), x / scale
cast to e4m3fn, stored into a paged [pages, 16, 8, 128] cache. Scales are read from
device memory, as the engine's are. Each program writes one token's K and V rows.

Timing is bench_kv_write's "graph" mode: 100 calls captured in one CUDA graph, two warm
replays, then the median of --rounds replays, time / 100; an empty Triton kernel is
timed the same way (the launch floor of a graph node). Before timing, the cache bytes
are compared with torch's own division and cast (a wrong kernel fails the run). Run on a CUDA machine with torch and Triton:

  python3 bench/anchor/kv_write_triton.py [--rounds 20] [--tokens 1,8,64,256]
"""
import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

HEADS, DIM, PAGE, SLOTS = 8, 128, 16, 131072
GRAPH_CALLS = 100


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, slot_ptr, k_cache, v_cache, k_scale, v_scale, stride_k, stride_v,
                    ROW: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, ROW)
    k = tl.load(k_ptr + t * stride_k + offs).to(tl.float32)
    v = tl.load(v_ptr + t * stride_v + offs).to(tl.float32)
    slot = tl.load(slot_ptr + t)
    ks = tl.load(k_scale)
    vs = tl.load(v_scale)
    if slot >= 0:
        tl.store(k_cache + slot * ROW + offs, (k / ks).to(tl.float8e4nv))
        tl.store(v_cache + slot * ROW + offs, (v / vs).to(tl.float8e4nv))


@triton.jit
def empty_kernel(x_ptr):
    pass


def graph_us(call, rounds):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()  # compiles and loads the kernel outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                call()
        for _ in range(2):
            graph.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(rounds):
            e0.record(stream)
            graph.replay()
            e1.record(stream)
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1000.0 / GRAPH_CALLS)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", default="1,8,64,256")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kv_write_triton: no CUDA device; nothing measured")
        return 0
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(7)
    row = HEADS * DIM
    k_cache = torch.zeros(SLOTS, row, dtype=torch.float8_e4m3fn, device=dev)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.tensor([0.37], dtype=torch.float32, device=dev)
    v_scale = torch.tensor([2.9], dtype=torch.float32, device=dev)
    print("kv_write_triton on %s, torch %s, triton %s; %d KV heads x %d, page %d, e4m3fn cache, %d slots"
          % (torch.cuda.get_device_name(), torch.__version__, triton.__version__, HEADS, DIM, PAGE, SLOTS))
    print("graph replay: %d calls in one graph, median of %d replays" % (GRAPH_CALLS, args.rounds))
    x = torch.zeros(1, device=dev)
    print("%8s  %-24s %10s" % ("T", "kernel", "us/call"))
    print("%8d  %-24s %10.3f" % (0, "empty triton kernel", graph_us(lambda: empty_kernel[(1,)](x), args.rounds)))
    status = 0
    for T in [int(t) for t in args.tokens.split(",")]:
        k = (torch.rand(T, row, generator=gen) * 2 - 1).to(torch.bfloat16).to(dev)
        v = (torch.rand(T, row, generator=gen) * 2 - 1).to(torch.bfloat16).to(dev)
        slots = torch.randperm(SLOTS, generator=gen)[:T].to(torch.int64).to(dev)

        def call():
            kv_write_kernel[(T,)](k, v, slots, k_cache, v_cache, k_scale, v_scale, k.stride(0), v.stride(0),
                                  ROW=row, num_warps=4)

        call()
        torch.cuda.synchronize()
        want_k = (k.float() / k_scale).to(torch.float8_e4m3fn)
        want_v = (v.float() / v_scale).to(torch.float8_e4m3fn)
        # Triton's fp32 division is not always correctly rounded: a byte may differ where
        # the quotient sits on a rounding boundary; more than 0.1% means a wrong kernel.
        differ = int((k_cache[slots].view(torch.uint8) != want_k.view(torch.uint8)).sum()) + int(
            (v_cache[slots].view(torch.uint8) != want_v.view(torch.uint8)).sum())
        if differ:
            print("kv_write_triton: T=%d: %d of %d cache bytes differ from torch's division and cast"
                  % (T, differ, 2 * T * row))
        if differ * 1000 > 2 * T * row:
            status = 1
        print("%8d  %-24s %10.3f" % (T, "triton fused fp8", graph_us(call, args.rounds)))
    return status


if __name__ == "__main__":
    sys.exit(main())
