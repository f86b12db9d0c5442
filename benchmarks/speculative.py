"""Speculative decoding against plain decoding, on the tasks it is for and one it is not:

  rewrite    prompt lookup, a ~100-line Python file to give back with type hints
  code       a draft model (qwen2.5-coder-0.5b for the 1.5B), code questions
  no copy    prompt lookup and the draft on free writing, where few guesses are kept:
             guessing must stop, and the speed stay within 5 % of plain decoding's

    python benchmarks/speculative.py --model /work/models/qwen15/q15.gguf \\
        --draft qwen2.5-coder-0.5b [--rounds 3] [--n-gen 200] [--only TASK] [--json FILE]
    python benchmarks/speculative.py --quick    # the default model as its own draft

Each row is `infer bench --lookup / --draft` (runtime/bench_speculative.py): greedy
answers, plain and speculative in alternating rounds, the same tokens both ways; decode
speeds are medians. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from infer.runtime.bench_speculative import run_speculative_bench
from infer.runtime.registry import resolve

HERE = Path(__file__).resolve().parent
REWRITE_FILE = HERE / "rewrite_input.txt"  # runtime/session.py as of 2026-11-27, 176 lines
REWRITE = (
    "Add type hints to every function of this file that lacks them, and a one-line "
    "docstring to each function without one. Reply with the whole file and nothing else."
)
CODE = [
    (
        "Write a Python function that merges overlapping intervals in a list of (start, "
        "end) pairs, with a docstring and three doctest examples."
    ),
    (
        "Write a Python class LRUCache with get and put in O(1), using OrderedDict, and a "
        "short unittest for it."
    ),
]
NO_COPY = (
    "Invent five names for a new programming language, each with one sentence on what "
    "makes it unusual."
)


@dataclass
class Case:
    name: str
    prompt: str
    lookup: bool  # else the draft model


def cases(file: Path) -> list[Case]:
    rewrite = f"{REWRITE}\n\n{file.read_text()}"
    return [
        Case("rewrite", rewrite, lookup=True),
        *(Case(f"code {i + 1}", q, lookup=False) for i, q in enumerate(CODE)),
        Case("no copy", NO_COPY, lookup=True),
        Case("no copy", NO_COPY, lookup=False),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="name or file")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="name or file")
    ap.add_argument("--file", type=Path, default=REWRITE_FILE, help="the file to rewrite")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=200)
    ap.add_argument("--only", help="the tasks whose name holds this (e.g. 'code 1')")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="the default model, 16 tokens, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.model = args.draft = "smollm2-135m"
        args.rounds, args.n_gen = 1, 16
    model, draft = resolve(args.model), resolve(args.draft)
    print(f"{model.name}, drafts by prompt lookup or {draft.name}", file=sys.stderr)
    rows, results = [], []
    for case in cases(args.file):
        if args.only and args.only not in case.name:
            continue
        print(f"{case.name} ({'lookup' if case.lookup else draft.name}) ...", file=sys.stderr)
        r = run_speculative_bench(
            model.path,
            lookup=case.lookup,
            draft=None if case.lookup else draft.path,
            prompt=case.prompt,
            n_gen=args.n_gen,
            rounds=args.rounds,
            name=model.name,
            draft_name=draft.name,
        )
        results.append({"case": case.name, **r.as_dict()})
        s = r.stats
        rows.append(
            [
                case.name,
                r.drafter,
                str(r.answer_tokens),
                f"{100 * s.acceptance:.0f} %",
                f"{s.tokens_per_check:.2f}",
                f"{s.passes} / {s.plain_passes}",
                f"{r.plain_tok_s:.1f}",
                f"{r.speculative_tok_s:.1f}",
                f"{r.speedup:.2f}x",
                "yes" if r.same_answer else "NO",
            ]
        )
        print(f"  {' | '.join(rows[-1])}", file=sys.stderr)  # as it comes: runs are long
    head = ["task", "guesses by", "answer tok", "accepted", "tok/check", "checking/plain",
            "plain tok/s", "spec. tok/s", "speedup", "same"]  # fmt: skip
    print(f"| {' | '.join(head)} |")
    print(f"|{'---|' * len(head)}")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
