"""Speculative decoding against plain decoding, on the tasks it is for and one it is not:

  rewrite    prompt lookup, a ~100-line Python file to give back with type hints
  code       a draft model (qwen2.5-coder-0.5b for the 1.5B), code questions
  no copy    prompt lookup and the draft on free writing, where few guesses are kept:
             guessing must stop, and the speed stay within 5 % of plain decoding's

    python benchmarks/speculative.py --model /work/models/qwen15/q15.gguf \\
        --draft qwen2.5-coder-0.5b [--rounds 3] [--n-gen 200] [--only TASK] [--json FILE]
    python benchmarks/speculative.py --quick    # the default model as its own draft
    python benchmarks/speculative.py --model q15.gguf --draft q05.gguf --llama-cpp BIN_DIR

Each row is `infer bench --lookup / --draft` (runtime/bench_speculative.py): greedy
answers, plain and speculative in alternating rounds, the same tokens both ways; decode
speeds are medians. Prints a markdown table. With --llama-cpp (a directory holding a
llama.cpp build's llama-completion and llama-speculative-simple; GGUF files),
after each task llama.cpp answers the same chat text, plain and speculative
(`--spec-type ngram-simple` for lookup, `draft-simple` for the draft) in alternating
rounds, each on 2 threads: a second table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infer.runtime.bench_speculative import run_speculative_bench
from infer.runtime.files.sources import open_source
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


def llama_cpp(bin_dir: Path, model: Path, draft: Path | None, text: str, n_gen: int, rounds: int):
    """llama.cpp on the chat `text`: (plain tok/s, speculative tok/s, % of guesses kept),
    medians of `rounds` alternating runs; prompt lookup when `draft` is None."""
    spec = ["--spec-type", "ngram-simple"] if draft is None else ["--spec-type", "draft-simple",
            "-md", str(draft), "-td", "2"]  # fmt: skip
    plain, fast, kept = [], [], []
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        for _ in range(rounds):
            out = _run([bin_dir / "llama-completion", "-m", model, "-t", 2, "-n", n_gen,
                        "--temp", 0, "-f", f.name, "-c", 8192, "-b", 8192, "-no-cnv"])  # fmt: skip
            plain.append(float(re.findall(r" eval time .*?([\d.]+) tokens per second", out)[-1]))
            out = _run([bin_dir / "llama-speculative-simple", "-m", model, *spec, "-t", 2,
                        "-n", n_gen, "--temp", 0, "-f", f.name, "-c", 8192, "-b", 8192])  # fmt: skip
            fast.append(float(re.search(r"decoded .* speed:\s*([\d.]+) t/s", out)[1]))
            kept.append(float(re.search(r"accept\s*=\s*([\d.]+)%", out)[1]))
    return statistics.median(plain), statistics.median(fast), statistics.median(kept)


def _run(cmd: list) -> str:
    r = subprocess.run(
        [str(c) for c in cmd],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    if r.returncode:
        sys.exit(f"{cmd[0]} failed:\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


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
    ap.add_argument("--llama-cpp", type=Path, metavar="BIN_DIR", help="also llama.cpp's build here")
    args = ap.parse_args()
    if args.quick:
        args.model = args.draft = "smollm2-135m"
        args.rounds, args.n_gen = 1, 16
    model, draft = resolve(args.model), resolve(args.draft)
    print(f"{model.name}, drafts by prompt lookup or {draft.name}", file=sys.stderr)
    rows, peer, results = [], [], []
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
        if args.llama_cpp:
            chat = (
                open_source(model.path)
                .tokenizer()
                .apply_chat_template([{"role": "user", "content": case.prompt}])
            )
            d = None if case.lookup else draft.path
            p, f, kept = llama_cpp(args.llama_cpp, model.path, d, chat, args.n_gen, args.rounds)
            peer.append(
                [case.name, r.drafter, f"{kept:.0f} %", f"{p:.1f}", f"{f:.1f}", f"{f / p:.2f}x"]
            )
            results[-1]["llama_cpp"] = {"plain_tok_s": p, "speculative_tok_s": f, "accepted": kept}
            print(f"  llama.cpp: {' | '.join(peer[-1])}", file=sys.stderr)
    head = ["task", "guesses by", "answer tok", "accepted", "tok/check", "checking/plain",
            "plain tok/s", "spec. tok/s", "speedup", "same"]  # fmt: skip
    print(f"| {' | '.join(head)} |")
    print(f"|{'---|' * len(head)}")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    if peer:
        head = ["task", "guesses by", "accepted", "plain tok/s", "spec. tok/s", "speedup"]
        print(f"\nllama.cpp, the same chat text:\n\n| {' | '.join(head)} |")
        print(f"|{'---|' * len(head)}")
        for row in peer:
            print(f"| {' | '.join(row)} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
