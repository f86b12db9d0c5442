"""Decode speed with a JSON schema against without, step by step in lockstep.

    python benchmarks/structured_speed.py MODEL.gguf [--tokens 128] [--rounds 3]

Two sessions decode greedily after the same chat prompt, one plain and one under a schema
(runtime/structured.py) whose array needs more items than `--tokens`, so the constrained
answer never ends early. Their steps alternate, one each in turn, as ab_extension.py
alternates builds: the busy machine's swings then hit both alike. A step is a forward
pass and the sampling after it (with the mask and the advance under the schema). Prints
each round's tok/s of both, their ratio, and what mask and advance cost per token.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from infer.runtime.generate import generate, make_sampler
from infer.runtime.loader import load_model
from infer.runtime.session import Session
from infer.runtime.structured import compile_format

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1000},
    },
    "required": ["name", "age", "color", "tags"],
}
PROMPT = "Describe a made-up person as JSON: name, age, favourite colour and many tags."


class Timed:
    """A constraint that adds up the seconds its mask and advance take."""

    def __init__(self, constraint):
        self.constraint, self.seconds, self.steps = constraint, 0.0, 0

    def mask(self, logits):
        t0 = time.perf_counter()
        out = self.constraint.mask(logits)
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        return out

    def advance(self, token):
        t0 = time.perf_counter()
        self.constraint.advance(token)
        self.seconds += time.perf_counter() - t0


def lockstep(model, prompt, n, constraint) -> tuple[list[float], list[float]]:
    """The seconds of each decode step (after the first token) of a plain and a
    constrained answer, their steps taken in turn."""
    greedy = make_sampler(temperature=0)
    plain = generate(Session(model), prompt, greedy, n)
    constrained = generate(Session(model), prompt, greedy, n, constraint=constraint)
    next(plain), next(constrained)  # the prefills
    times = ([], [])
    for _ in range(n - 1):
        for tokens, seconds in zip((plain, constrained), times):
            t0 = time.perf_counter()
            next(tokens)
            seconds.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, torch.float32, max_seq_len=1024)
    tok = lm.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
    t0 = time.perf_counter()
    grammar = compile_format(tok, SCHEMA)
    print(f"{args.model.name}: compile (with the tokenizer) {time.perf_counter() - t0:.3f} s")
    lockstep(lm.model, prompt, 8, grammar.matcher())  # warm-up
    ratios = []
    for r in range(args.rounds):
        timed = Timed(grammar.matcher())
        plain, constrained = lockstep(lm.model, prompt, args.tokens, timed)
        ratios.append(sum(plain) / sum(constrained))
        print(
            f"round {r + 1}: plain {len(plain) / sum(plain):.1f} tok/s, schema "
            f"{len(constrained) / sum(constrained):.1f} tok/s ({ratios[-1]:.1%}), "
            f"mask+advance {1e6 * timed.seconds / timed.steps:.0f} us/token"
        )
    print(f"ratio: median {statistics.median(ratios):.1%}, {min(ratios):.1%}-{max(ratios):.1%}")


if __name__ == "__main__":
    main()
