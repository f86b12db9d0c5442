"""Quantized matmul kernels: achieved GB/s against the machine's read bandwidth, and
prefill GEMM speed against float32 torch.

    python benchmarks/bench_kernels.py [--threads 1 2] [--isa avx512 avx2] [--quick]

Napkin math (llm.c style): decode's GEMV reads every weight byte once and does ~2 flops
per weight, so it is bound by memory bandwidth; GB/s = packed bytes (codes + scales +
mins) / seconds (the best sample), held against a streaming read on the same threads
taken just before each kernel sample (the median of the pairs' ratios). Weights
are cycled through copies totalling > 256 MB, so no call finds its matrix in the
last-level cache. Prefill's GEMM does 2 M flops per weight and is bound by arithmetic:
it is held against torch.nn.functional.linear on the same float32 shapes.

The machine is shared; every figure is the best of several runs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from infer.kernels_cpu import ops

SHAPES = [(4096, 4096), (11008, 4096)]  # (N, K): a 7B model's attention and MLP-up
FORMATS = [  # (name, bits, group size, symmetric)
    ("int8 g32 (Q8_0)", 8, 32, True),
    ("int8 per-channel", 8, 0, True),
    ("int4 g32 asym (Q4_1)", 4, 32, False),
    ("int4 g32 sym (Q4_0)", 4, 32, True),
    ("int4 g64 asym", 4, 64, False),
    ("int4 g128 sym", 4, 128, True),
]
CYCLE_BYTES = 256 << 20
BW_BYTES = 512 << 20  # one read-bandwidth sample: 512 MB, well past the L3


def packed(bits: int, g: int, sym: bool, N: int, K: int, gen: torch.Generator) -> dict:
    """Random packed tensors of one format (the kernels' speed does not depend on values)."""
    if bits == 8:
        q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
        s = torch.rand(N, K // g if g else 1, generator=gen) * 0.01
        return {"qweight": q, "scales": s.half() if g else s, "mins": None}
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    s = (torch.rand(N, K // g, generator=gen) * 0.01).half()
    m = None if sym else (torch.rand(N, K // g, generator=gen) * -0.1).half()
    return {"qweight": q, "scales": s, "mins": m}


def nbytes(w: dict) -> int:
    return sum(t.numel() * t.element_size() for t in w.values() if t is not None)


def call(bits, g, w, x, isa, threads):
    if bits == 8:
        return ops.q8_matmul(x, w["qweight"], w["scales"], g, isa=isa, threads=threads)
    return ops.q4_matmul(x, w["qweight"], w["scales"], w["mins"], g, isa=isa, threads=threads)


def best_time(fn, repeats: int, inner: int = 1) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def bench_gemv(isas, threads_list, repeats, shapes):
    gen = torch.Generator().manual_seed(0)
    print("\n## GEMV (M = 1, decode): GB/s of packed weights read")
    for N, K in shapes:
        for name, bits, g, sym in FORMATS:
            first = packed(bits, g, sym, N, K, gen)
            copies = [first] + [
                {k: None if v is None else v.clone() for k, v in first.items()}
                for _ in range(max(0, -(-CYCLE_BYTES // nbytes(first)) - 1))
            ]
            x = torch.randn(1, K, generator=gen)
            for isa in isas:
                for t in threads_list:
                    it = iter(range(1 << 62))

                    def run(copies=copies, bits=bits, g=g, x=x, isa=isa, t=t, it=it):
                        call(bits, g, copies[next(it) % len(copies)], x, isa, t)

                    # the scalar path is slow: a few matrices, not the whole cycle
                    n = 4 if isa == "scalar" else len(copies)
                    # The guest's bandwidth moves by tens of percent within seconds (and
                    # now and then reads at twice its usual rate): each kernel sample is
                    # paired with a read-bandwidth sample taken just before it, and the
                    # median of the pairs' ratios is the figure.
                    secs, ratios, bws = [], [], []
                    for _ in range(repeats if isa != "scalar" else 1):
                        bws.append(ops.read_bandwidth(BW_BYTES, threads=t, repeats=1))
                        secs.append(best_time(run, 1, inner=n))
                        ratios.append(nbytes(first) / secs[-1] / 1e9 / bws[-1])
                    sec = min(secs)
                    gbs = nbytes(first) / sec / 1e9
                    print(
                        f"{N:>6}x{K:<5} {name:<21} {isa:<10} {t} thr  {sec * 1e6:9.0f} us  "
                        f"{gbs:6.1f} GB/s  ({statistics.median(ratios):4.0%} of the read "
                        f"bandwidth, median of {len(ratios)} pairs; read "
                        f"{statistics.median(bws):4.1f} GB/s)"
                    )
            del copies


def bench_gemm(isas, threads_list, repeats, Ms, shapes):
    gen = torch.Generator().manual_seed(1)
    print("\n## GEMM (prefill): GFLOP/s, against torch float32 F.linear on the same shapes")
    for N, K in shapes:
        wf = torch.randn(N, K, generator=gen)
        for M in Ms:
            x = torch.randn(M, K, generator=gen)
            flops = 2 * M * N * K
            for t in threads_list:
                torch.set_num_threads(t)
                ref = best_time(functools.partial(F.linear, x, wf), repeats)
                print(f"{N:>6}x{K:<5} M={M:<4} {'torch float32':<32} {t} thr  "
                      f"{ref * 1e3:8.2f} ms  {flops / ref / 1e9:6.1f} GFLOP/s")  # fmt: skip
                for name, bits, g, sym in FORMATS:
                    w = packed(bits, g, sym, N, K, gen)
                    for isa in isas:
                        # the VNNI / dot variants differ only in the int4 GEMV
                        if isa == "scalar" or isa.endswith(("vnni", "dot")):
                            continue
                        sec = best_time(functools.partial(call, bits, g, w, x, isa, t), repeats)
                        print(
                            f"{N:>6}x{K:<5} M={M:<4} {name:<21} {isa:<10} {t} thr  "
                            f"{sec * 1e3:8.2f} ms  {flops / sec / 1e9:6.1f} GFLOP/s  "
                            f"({ref / sec:4.2f}x torch)"
                        )
    torch.set_num_threads(max(threads_list))


def main():
    global BW
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--isa", nargs="+", default=None, help="paths (default: all this CPU runs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="4096x4096 only, M = 128 only")
    p.add_argument("--no-gemv", action="store_true")
    p.add_argument("--no-gemm", action="store_true")
    args = p.parse_args()
    if not ops.available():
        raise SystemExit("the C extension is not built (pip install -e .)")
    isas = args.isa or ops.supported_isas()
    print(f"paths this CPU runs: {', '.join(ops.supported_isas())} (default {ops.isa()})")

    print("\n## Read bandwidth (streaming sum of 1 GB, best of 5)")
    BW = {}
    for t in args.threads:
        BW[t] = ops.read_bandwidth(1 << 30, threads=t)
        print(f"C stream read, {t} thr: {BW[t]:6.1f} GB/s")
    a = torch.ones(1 << 28)  # 1 GB of float32
    sec = best_time(a.sum, 3)
    print(
        f"torch sum of 1 GB float32, {torch.get_num_threads()} thr: {a.nbytes / sec / 1e9:6.1f} GB/s"
    )
    del a

    shapes = SHAPES[:1] if args.quick else SHAPES
    if not args.no_gemv:
        bench_gemv(isas, args.threads, args.repeats, shapes)
    if not args.no_gemm:
        Ms = [128] if args.quick else [7, 128]
        bench_gemm(isas, args.threads, max(2, args.repeats // 2), Ms, shapes)


if __name__ == "__main__":
    main()
