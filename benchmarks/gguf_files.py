"""GGUF files in infer and in llama.cpp, rounds alternating: load, peak RSS, prefill and
decode tok/s, printed as a markdown table of ranges over the rounds.

    python benchmarks/gguf_files.py FILE [FILE ...] --llama-bench BIN
        [-p 128] [-n 64] [--rounds 3] [-t 2] [--json]

Each round runs `infer bench FILE -t T -p P -n N -r 1 --json`, then `BIN -m FILE -t T
-p P -n N -r 1 -o json`, one process at a time, on GGUF files (both read them). Peak RSS
is each process's own (wait4): llama.cpp's includes its compute buffers, infer's its
Python and torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def infer_round(path: str, args) -> dict:
    cmd = ["infer", "bench", path, "-t", str(args.threads), "-p", str(args.p)]
    out, _ = peak_rss([*cmd, "-n", str(args.n), "-r", "1", "--json"])
    r = json.loads(out)
    return {
        "load_s": r["load_s"],
        "rss_mb": r["peak_rss_bytes"] / 1e6,
        "prefill": r["prefill_tok_s"],
        "decode": r["decode_tok_s"],
    }


def llama_round(path: str, args) -> dict:
    cmd = [args.llama_bench, "-m", path, "-t", str(args.threads), "-p", str(args.p)]
    out, rss = peak_rss([*cmd, "-n", str(args.n), "-r", "1", "-o", "json"])
    tests = json.loads(out)
    speed = {("prefill" if t["n_prompt"] else "decode"): t["avg_ts"] for t in tests}
    return {"rss_mb": rss / 1e6, **speed}


def peak_rss(cmd: list[str]) -> tuple[str, int]:
    """stdout of `cmd` and the child's own peak RSS in bytes (wait4, not RUSAGE_CHILDREN,
    which is the largest of all children so far)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{' '.join(cmd)} failed")
    return out, usage.ru_maxrss * 1024


def span(values: list[float], digits: int) -> str:
    lo, hi = min(values), max(values)
    f = f"{{:,.{digits}f}}"
    return f.format(lo) if f.format(lo) == f.format(hi) else f"{f.format(lo)}-{f.format(hi)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens")
    ap.add_argument("-n", type=int, default=64, help="generated tokens")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="every round, as JSON")
    args = ap.parse_args()

    rounds = {f: {"infer": [], "llama.cpp": []} for f in args.files}
    for r in range(args.rounds):
        for f in args.files:
            rounds[f]["infer"].append(infer_round(f, args))
            rounds[f]["llama.cpp"].append(llama_round(f, args))
            print(f"round {r + 1}: {Path(f).name} done", file=sys.stderr)
    if args.json:
        print(json.dumps(rounds, indent=2))
        return
    print("| file | infer load | infer peak RSS | infer prefill | infer decode "
          "| llama.cpp peak RSS | llama.cpp prefill | llama.cpp decode |")  # fmt: skip
    print("| --- |" + " ---: |" * 7)
    for f, by in rounds.items():
        i, c = by["infer"], by["llama.cpp"]
        cells = [
            span([x["load_s"] for x in i], 2) + " s",
            span([x["rss_mb"] for x in i], 0) + " MB",
            span([x["prefill"] for x in i], 1),
            span([x["decode"] for x in i], 1),
            span([x["rss_mb"] for x in c], 0) + " MB",
            span([x["prefill"] for x in c], 1),
            span([x["decode"] for x in c], 1),
        ]
        print(f"| {Path(f).name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
