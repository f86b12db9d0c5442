"""A chat turn's new tokens: the time to prefill T tokens after a context the cache holds,
for T from 1 to 64 (best of --repeats), in this process with the kernels as built.

    python benchmarks/prompt_tail.py MODEL [--context 1040] [--sizes 1,2,4,8,9,12,15,16,17,32,64]
"""

from __future__ import annotations

import argparse
import time

from infer.runtime.loader import load_model
from infer.runtime.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=1040, help="tokens the cache holds first")
    ap.add_argument("--sizes", default="1,2,4,6,8,9,12,15,16,17,24,32,48,64")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    lm = load_model(args.model, max_seq_len=args.context + max(sizes) + 1)
    session = Session(lm.model, args.context + max(sizes) + 1)
    held = [100 + i % 1000 for i in range(args.context)]
    session.prefill(held, 256)
    print("| new tokens | ms | tok/s |\n| ---: | ---: | ---: |")
    for n in sizes:
        best = float("inf")
        for _ in range(args.repeats):
            session.truncate(args.context)
            t0 = time.perf_counter()
            session.prefill(held + list(range(200, 200 + n)), 256)
            best = min(best, time.perf_counter() - t0)
        print(f"| {n} | {best * 1000:.1f} | {n / best:.0f} |")


if __name__ == "__main__":
    main()
