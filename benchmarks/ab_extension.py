"""Two builds of the C extension in one process, alternating call by call: the A/B that
this shared machine's minute-to-minute swings (10-30 %) do not blur, as they hit both
builds alike. Separate processes run minutes apart cannot resolve a 10-20 % change here.

    # OTHER.so: kernels_cpu/_C*.so of another commit (a clone built with pip install -e .)
    python benchmarks/ab_extension.py OTHER.so                       # int4 matmuls, M 1-8
    python benchmarks/ab_extension.py OTHER.so --rows 16 128 --shapes 2048x2048 8192x2048
    python benchmarks/ab_extension.py OTHER.so --rows 128 --shapes 8960x1536 --format q4_k
    python benchmarks/ab_extension.py OTHER.so --model DIR --tokens 2 4 8 64 [--decode 64]

The kernel mode times a matmul (2 threads; int4 g32 asymmetric (or g64, g128: int4-g64, int4-g128), int5 symmetric, int6, int8
g32 or q4_k)
on cold copies of each shape for M rows of x; the model mode times a whole prompt's forward, and with --decode single-token steps
(the fused decode step) after the last prompt. Both print medians for this tree's
build ("this") and the other ("other"), and this / other as a speed ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from importlib.machinery import ExtensionFileLoader
from pathlib import Path

import torch
from bench_kernels import packed  # benchmarks/

from infer.kernels_cpu import ops

SHAPES = [(576, 576), (1536, 576), (576, 1536), (768, 2048), (2048, 768), (2048, 2048)]
ROWS = [1, 2, 4, 5, 6, 8]
COLD_BYTES = 64 << 20  # copies of each matrix, so no call finds it in the last-level cache


def load_other(path: Path):
    """The extension at `path` as a module of its own (its own pool and threads)."""
    name = "other._C"
    loader = ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def use(module) -> None:
    """Route every binding (the matmuls, the LUT kernels, the fused decode step) to module."""
    ops._C = module


def alternate(builds: dict, run, rounds: int) -> dict[str, float]:
    """Median seconds of run() per build, the builds taking turns `rounds` times."""
    times = {name: [] for name in builds}
    for _ in range(rounds):
        for name, module in builds.items():
            use(module)
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def weights(fmt: str, N: int, K: int, gen: torch.Generator) -> dict:
    """Random weights of one format (the kernels' speed does not depend on values)."""
    if fmt.startswith("int4"):  # int4, int4-g64, int4-g128
        return packed(4, _group(fmt), False, N, K, gen)
    if fmt == "int8":  # GGUF Q8_0's layout: int8 codes, a float16 scale per 32
        return packed(8, 32, True, N, K, gen)
    if fmt == "int5":
        w = packed(4, 32, True, N, K, gen)
        return {**w, "qh": torch.randint(0, 256, (N, K // 8), dtype=torch.uint8, generator=gen)}
    if fmt == "int6":  # Q6_K blocks: float16 d in the last two bytes
        b = torch.randint(0, 256, (N, K // 256, 210), dtype=torch.uint8, generator=gen)
        b[..., 208:] = (torch.rand(N, K // 256, 1, generator=gen) * 1e-3).half().view(torch.uint8)
        return {"qweight": b.view(N, -1)}
    b = torch.randint(0, 256, (N, K // 256, 144), dtype=torch.uint8, generator=gen)
    b[..., :4] = (torch.rand(N, K // 256, 2, generator=gen) * 1e-3).half().view(torch.uint8)
    return {"qweight": b.view(N, -1)}


def _group(fmt: str) -> int:
    """int4's group size: 32, or what "int4-gG" names."""
    return int(fmt.partition("-g")[2] or 32)


def matmul(fmt: str, x: torch.Tensor, w: dict, threads: int) -> torch.Tensor:
    if fmt.startswith("int4"):
        return ops.q4_matmul(x, w["qweight"], w["scales"], w["mins"], _group(fmt), threads=threads)
    if fmt == "int8":
        return ops.q8_matmul(x, w["qweight"], w["scales"], 32, threads=threads)
    if fmt == "int5":
        return ops.q5_matmul(x, w["qweight"], w["qh"], w["scales"], None, threads=threads)
    if fmt == "int6":
        return ops.q6_matmul(x, w["qweight"], threads=threads)
    return ops.q4k_matmul(x, w["qweight"], threads=threads)


def bench_kernels(builds: dict, threads: int, shapes: list, rows: list[int], fmt: str) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{fmt} matmul, {threads} threads, median us: this / other (speed ratio)")
    print("| N x K | " + " | ".join(f"M = {m}" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for N, K in shapes:
        copies = [weights(fmt, N, K, gen) for _ in range(max(2, COLD_BYTES // (N * K // 2)))]
        cells = []
        for M in rows:
            x = torch.randn(M, K, generator=gen)

            def run(x=x, copies=copies):
                for w in copies:
                    matmul(fmt, x, w, threads)

            t = alternate(builds, run, rounds=7)
            n = len(copies)
            cells.append(
                f"{t['this'] / n * 1e6:.0f} / {t['other'] / n * 1e6:.0f} "
                f"({t['other'] / t['this']:.2f}x)"
            )
        print(f"| {N} x {K} | " + " | ".join(cells) + " |", flush=True)


def bench_model(builds: dict, path: Path, tokens: list[int], decode_n: int, rounds: int) -> None:
    from infer.runtime.loader import load_model
    from infer.runtime.session import Session

    lm = load_model(path, torch.float32, max_seq_len=max(tokens) + decode_n + 1)
    model, gen = lm.model, torch.Generator().manual_seed(0)

    def report(what: str, n: int, t: dict) -> None:
        print(
            f"  {what}: {n / t['this']:7.1f} / {n / t['other']:7.1f} tok/s "
            f"({t['other'] / t['this']:.2f}x)",
            flush=True,
        )

    print(f"{path.name}, medians, this / other (speed ratio):")
    session = Session(model)
    with torch.inference_mode():
        for T in tokens:
            prompt = torch.randint(0, model.args.vocab_size, (1, T), generator=gen)
            forward = lambda prompt=prompt: session.forward(prompt[0].tolist(), 0)
            alternate(builds, forward, rounds=1)  # warm
            report(f"{T:4d}-token prompt", T, alternate(builds, forward, rounds))
        if decode_n:  # one token at a time after the last prompt (the fused step)
            T = tokens[-1]
            token = prompt[0, -1:].tolist()

            def steps():
                for pos in range(T, T + decode_n):
                    session.forward(token, pos)

            alternate(builds, steps, rounds=1)  # warm
            report(f"decode {decode_n} at {T}", decode_n, alternate(builds, steps, rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", type=Path, help="the other build's extension (a .so file)")
    ap.add_argument("--model", type=Path, help="time a model's prompts instead of kernels")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 8, 64])
    ap.add_argument("--decode", type=int, default=0, help="--model: also time this many steps")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS, help="kernels: rows of x")
    formats = ["int4", "int4-g64", "int4-g128", "int5", "int6", "int8", "q4_k"]
    ap.add_argument("--format", choices=formats, default="int4")
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=[f"{n}x{k}" for n, k in SHAPES],
        help="kernels: weight shapes, N x K",
    )
    args = ap.parse_args()
    if not args.other.is_file():
        ap.error(f"no such file: {args.other}")
    torch.set_num_threads(args.threads)
    builds = {"this": ops._C, "other": load_other(args.other)}
    if args.model is None:
        torch.set_num_threads(1)  # torch's threads would spin on the kernels' cores
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
        bench_kernels(builds, args.threads, shapes, args.rows, args.format)
    else:
        bench_model(builds, args.model, args.tokens, args.decode, args.rounds)


if __name__ == "__main__":
    main()
