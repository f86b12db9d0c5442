"""LUT kernels (lut1..lut4, kernels_cpu/csrc/lut*.c): decode GEMV time and GB/s per bit
width, against the machine's read bandwidth, float32 torch and the int4 kernel; prefill
GEMM against float32 torch; the error the int8 activation tables add.

    python benchmarks/bench_lut.py [--threads 1 2] [--isa avx512vnni avx2] [--quick]

Napkin math (llm.c style): a b-bit GEMV reads b/8 bytes per weight plus 4 bytes of f16
scale and min per group of 64 (0.5 bits per weight): 4096 x 4096 at lut2 is 5.2 MB, so
at 30 GB/s it cannot take less than 0.17 ms. Its arithmetic is b table lookups (a byte
shuffle lane each) per 4 weights, no multiplications: a 64-byte vpermi2b does 64
lookups, so a core at ~4 GHz and 2 shuffles a cycle looks up ~500 G weight-bits/s,
several times what memory delivers; what is left is the transposes, index arithmetic,
the integer sums and the float epilogue, which decide how close a core gets to memory.
Weights are cycled through copies totalling > 256 MB, so no call finds its matrix in
the last-level cache ("cold", as decode reads them).

The machine is shared, and a call that loses its core to another process for a time
slice takes milliseconds: every figure is the median over single calls (over all the
copies, several rounds), which such outliers do not move; averages would measure the
machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from infer.kernels_cpu import ops, reference
from infer.quant.formats.base import FORMATS

SHAPES = [(4096, 4096), (11008, 4096)]  # (N, K): a 7B model's attention and MLP-up
BITS = [1, 2, 3, 4]
GROUP = 64
CYCLE_BYTES = 256 << 20


def layer(bits: int, N: int, K: int, gen: torch.Generator):
    """A lutN layer of random codes, scales and mins (speed does not depend on values)."""
    q = torch.randint(0, 256, (bits, N, K // 8), dtype=torch.uint8, generator=gen)
    s = (torch.rand(N, K // GROUP, generator=gen) * 0.01).half()
    m = (torch.rand(N, K // GROUP, generator=gen) * -0.02).half()
    return q, s, m


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def median_time(fn, repeats: int, inner: int = 1) -> float:
    """Median seconds of single calls of fn, repeats * inner of them."""
    fn()  # warm-up
    times = []
    for _ in range(repeats * inner):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_cycled(fn, x, copies, repeats: int, **kw) -> float:
    """Median seconds of fn(x, *w, GROUP, **kw) over every copy w, repeats rounds."""
    fn(x, *copies[0], GROUP, **kw)  # warm-up
    times = []
    for _ in range(repeats):
        for w in copies:
            t0 = time.perf_counter()
            fn(x, *w, GROUP, **kw)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cycled(first, total: int):
    """`first` and clones of it, > total bytes in all, for cold-cache calls."""
    n = max(1, -(-total // nbytes(first)))
    return [first] + [tuple(t.clone() for t in first) for _ in range(n - 1)]


def bench_gemv(isas, threads_list, repeats, shapes):
    gen = torch.Generator().manual_seed(0)
    print("\n## GEMV (M = 1, decode), cold weights: time and GB/s of packed bytes")
    for threads in threads_list:
        bw = ops.read_bandwidth(threads=threads)
        print(f"\nthreads {threads}: read bandwidth {bw:.1f} GB/s (streaming sum of 1 GB)")
        print(
            "| shape | format | MB | "
            + " | ".join(f"{ops.lut_kernel_isa(i)} ms (GB/s, % of bw)" for i in isas)
            + " | float32 torch ms | int4 g64 kernel ms |"
        )
        print("|---|---|---|" + "---|" * len(isas) + "---|---|")
        torch.set_num_threads(threads)
        for N, K in shapes:
            x = torch.randn(1, K, generator=gen)
            wf = torch.randn(N, K, generator=gen) * 0.02  # 4 bytes a weight: no cache
            t_f32 = median_time(lambda x=x, wf=wf: F.linear(x, wf), repeats, 3)
            q4 = cycled(
                (
                    torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen),
                    (torch.rand(N, K // GROUP, generator=gen) * 0.01).half(),
                    (torch.rand(N, K // GROUP, generator=gen) * -0.02).half(),
                ),
                CYCLE_BYTES,
            )
            t_q4 = median_cycled(ops.q4_matmul, x, q4, repeats, threads=threads)
            for bits in BITS:
                copies = cycled(layer(bits, N, K, gen), CYCLE_BYTES)
                size = nbytes(copies[0])
                cells = []
                for isa in isas:
                    t = median_cycled(ops.lut_matmul, x, copies, repeats, isa=isa, threads=threads)
                    gbs = size / t / 1e9
                    cells.append(f"{t * 1e3:.3f} ({gbs:.1f}, {100 * gbs / bw:.0f}%)")
                print(
                    f"| {N}x{K} | lut{bits} | {size / 1e6:.1f} | "
                    + " | ".join(cells)
                    + f" | {t_f32 * 1e3:.3f} | {t_q4 * 1e3:.3f} |",
                    flush=True,
                )


def bench_gemm(isa, threads_list, repeats, shapes, Ms):
    gen = torch.Generator().manual_seed(1)
    print(f"\n## GEMM (prefill), {ops.lut_kernel_isa(isa)}: ms, and speed-up over float32 torch")
    print("(weights and tables stay in cache across calls: these are compute-bound)")
    print("| threads | shape | M | float32 torch | " + " | ".join(f"lut{b}" for b in BITS) + " |")
    print("|---|---|---|---|" + "---|" * len(BITS))
    for threads in threads_list:
        torch.set_num_threads(threads)
        for N, K in shapes:
            wf = torch.randn(N, K, generator=gen) * 0.02
            layers = {b: layer(b, N, K, gen) for b in BITS}
            for M in Ms:
                x = torch.randn(M, K, generator=gen)
                tf = median_time(lambda x=x, wf=wf: F.linear(x, wf), repeats)
                cells = []
                for b in BITS:
                    t = median_time(
                        lambda x=x, w=layers[b], t=threads: ops.lut_matmul(
                            x, *w, GROUP, isa=isa, threads=t
                        ),
                        repeats,
                    )
                    cells.append(f"{t * 1e3:.2f} ({tf / t:.1f}x)")
                print(
                    f"| {threads} | {N}x{K} | {M} | {tf * 1e3:.2f} | " + " | ".join(cells) + " |",
                    flush=True,
                )


def bench_accuracy():
    """Relative error of y against the exact x W^T, from the format (lutN against float
    W) and from the kernel's int8 tables (against the exact product of the lutN W)."""
    gen = torch.Generator().manual_seed(2)
    N, K = 1024, 2048
    w = torch.randn(N, K, generator=gen) * 0.02
    # hidden-state-like activations: mostly normal, a few large channels
    x = torch.randn(16, K, generator=gen)
    x[:, torch.randperm(K, generator=gen)[:8]] *= 20
    y_float = x @ w.T
    print("\n## Accuracy (N = 1024, K = 2048, 16 activation rows with outlier channels)")
    print("| format | rel. error of format (vs float W) | rel. error of int8 tables (vs exact) |")
    print("|---|---|---|")
    for b in BITS:
        q = FORMATS[f"lut{b}"].from_float(w, group_size=GROUP)
        exact = reference.lut_matmul_exact(x, q.qweight, q.scales, q.mins, GROUP)
        y = ops.lut_matmul(x, q.qweight, q.scales, q.mins, GROUP)
        fmt = ((exact - y_float).norm() / y_float.norm()).item()
        tab = ((y - exact).norm() / exact.norm()).item()
        print(f"| lut{b} | {fmt:.4f} | {tab:.4f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--isa", nargs="+", default=None, help="paths (default: the best, avx2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the 4096 x 4096 shape only")
    args = ap.parse_args()
    if not ops.available():
        raise SystemExit("the C extension is not built")
    isas = args.isa or list(
        dict.fromkeys([ops.isa(), *(["avx2"] * ("avx2" in ops.supported_isas()))])
    )
    shapes = SHAPES[:1] if args.quick else SHAPES
    print(f"paths: {', '.join(f'{i} -> lut {ops.lut_kernel_isa(i)}' for i in isas)}")
    bench_accuracy()
    bench_gemv(isas, args.threads, args.repeats, shapes)
    bench_gemm(isas[0], args.threads, max(2, args.repeats // 2), shapes, [7, 64, 256])


if __name__ == "__main__":
    main()
