"""Aggregate decode speed of one pass over R sequences (session.decode), R = 1, 2, 4, 8.

Each round decodes the same number of steps at every R, in alternating order, and the
table gives the median tokens per second over rounds (R tokens a step):

    python benchmarks/batched_decode.py MODEL [--steps 32] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer.runtime.loader import load_model
from infer.runtime.session import Session, decode


def rate(model, rows: int, steps: int) -> float:
    sessions = [Session(model, max_seq_len=512) for _ in range(rows)]
    last = [s.prefill([1, 504 + i, 3458, 282, 4649, 314]) for i, s in enumerate(sessions)]
    t0 = time.perf_counter()
    for _ in range(steps):
        out = decode(sessions, [[int(x.argmax())] for x in last])
        last = [o[-1] for o in out]
    return rows * steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model, max_seq_len=512).model
    sizes = [int(r) for r in a.rows.split(",")]
    got = {r: [] for r in sizes}
    for k in range(a.rounds):
        for r in sizes if k % 2 == 0 else sizes[::-1]:
            got[r].append(rate(model, r, a.steps))
    base = statistics.median(got[sizes[0]])
    print(f"{'rows':>4} {'tok/s':>8} {'x one':>6}")
    for r in sizes:
        m = statistics.median(got[r])
        print(f"{r:>4} {m:8.1f} {m / base:6.2f}")


if __name__ == "__main__":
    main()
