"""Decode speed at a long context with each KV cache format, in alternating rounds.

Each format's session holds `--ctx` positions of random keys and values (a prefill that
long takes minutes here; attention's cost does not depend on the values), then decodes
`--steps` tokens from there, the formats taking turns `--rounds` times; the table gives
the median tokens per second and each cache's size:

    python benchmarks/kv_cache.py MODEL [--ctx 8192] [--steps 8] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer.runtime.loader import load_model
from infer.runtime.session import Session


def filled(model, kind: str, ctx: int) -> Session:
    """A session whose cache holds `ctx` positions of random keys and values."""
    session = Session(model, kv_cache=kind)
    gen = torch.Generator().manual_seed(0)
    a = model.args
    with torch.inference_mode():
        for c in session.cache:
            k, v = (torch.randn(1, a.n_kv_heads, ctx, a.head_dim, generator=gen) for _ in "kv")
            c.update(0, k, v)
    session.tokens = [0] * ctx
    return session


def rate(session: Session, ctx: int, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        session.step(1)
    seconds = time.perf_counter() - t0
    session.truncate(ctx)  # the next round decodes at the same positions
    return steps / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kinds", default="f32,int8")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model, max_seq_len=a.ctx + a.steps + 1).model
    kinds = a.kinds.split(",")
    sessions = {k: filled(model, k, a.ctx) for k in kinds}
    for s in sessions.values():
        assert s.fused is not None, "the fused decode step does not run this model"
        rate(s, a.ctx, 1)  # warm-up
    got = {k: [] for k in kinds}
    for r in range(a.rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            got[k].append(rate(sessions[k], a.ctx, a.steps))
    base = statistics.median(got[kinds[0]])
    print(f"decode at {a.ctx} positions, {a.threads} threads, {a.rounds} rounds of {a.steps}")
    print(f"{'cache':>6} {'MB':>8} {'tok/s':>7} {'range':>13} {'x ' + kinds[0]:>7}")
    for k in kinds:
        mb = sum(c.nbytes for c in sessions[k].cache) * a.ctx / sessions[k].max_seq_len / 1e6
        m = statistics.median(got[k])
        span = f"{min(got[k]):.2f}-{max(got[k]):.2f}"
        print(f"{k:>6} {mb:8.1f} {m:7.2f} {span:>13} {m / base:7.2f}")


if __name__ == "__main__":
    main()
