"""Seconds to build a model's tokenizer and to load it, best of N in one process.

    python benchmarks/tokenizer_load.py [-n 3] MODEL [MODEL ...]

MODEL is a path or a registry name (not downloaded). Each repeat opens the file afresh:
`open_source(path).tokenizer()` (the GGUF metadata decoded, the tokenizer built), then
`load_model(path)` (header, tokenizer and weights). Compare two trees by running it with
each on PYTHONPATH, in alternating rounds, under /work/bench/frozen.sh.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from infer.runtime.files.sources import open_source
from infer.runtime.loader import load_model
from infer.runtime.registry import resolve


def best(n: int, run, path: Path) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        run(path)
        times.append(time.perf_counter() - t0)
    return min(times)


def build_tokenizer(path: Path) -> None:
    open_source(path).tokenizer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("-n", type=int, default=3, help="repeats (the best is printed)")
    args = parser.parse_args()
    for name in args.models:
        path = Path(name) if Path(name).exists() else resolve(name, download=False).path
        tok = best(args.n, build_tokenizer, path)
        load = best(args.n, load_model, path)
        print(f"{path.name}: tokenizer {tok:.3f} s, load_model {load:.3f} s (best of {args.n})")


if __name__ == "__main__":
    main()
