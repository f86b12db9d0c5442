"""Prompts that arrive together with one long start, on `infer serve` or a llama-server:
how long until every answer is done, and how many prompt tokens the server says it
did not compute.

    python benchmarks/shared_start.py [MODEL] [--requests 4] [--system-tokens 1000]
        [--max-tokens 16] [--rounds 2] [--n] [--threads N] [--url URL | --llama-server BIN]

system  --requests chat requests sent at once, streamed and greedy: one system prompt of
        about --system-tokens tokens (new each round, so no slot holds it), each its own
        short question.
--n     instead one request for --requests answers (OpenAI's n) to such a prompt.

Each round reports the seconds from sending to the last answer's end, the median and
largest time to first token, and the cached prompt tokens the usage reports. Only
loopback addresses are accepted; the server started here stops at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from serve_batch import a_server, chunks_of
from serve_load import SENTENCE

QUESTIONS = ["Summarise the rules.", "Which rule is the oldest?", "Name three rules."]
QUESTIONS += ["What is rule 5 about?", "Is any rule repeated?", "Which rule matters most?"]
QUESTIONS += ["Translate rule 1 to French.", "How many rules are there?"]


def system_prompt(tokens: int, salt: int) -> str:
    """About `tokens` tokens of numbered rules, different for each `salt`."""
    rules = [f"Rule {salt}-{i}: {SENTENCE}" for i in range(max(1, tokens // 16))]
    return " ".join(rules)


async def one(client: httpx.AsyncClient, messages: list[dict], args) -> list[dict]:
    """A streamed request's answers (n of them with --n): when each first and last text
    came, and the usage."""
    extra = {"n": args.requests} if args.n else {}
    sent, first, last, usage = time.perf_counter(), {}, {}, {}
    async for chunk in chunks_of(client, messages, args.max_tokens, **extra):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                i = choice.get("index", 0)
                last[i] = time.perf_counter()
                first.setdefault(i, last[i])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return [{"sent": sent, "first": first[i], "last": last[i], "cached": cached} for i in first]


async def round_of(url: str, args, salt: int) -> dict:
    system = {"role": "system", "content": system_prompt(args.system_tokens, salt)}
    count = 1 if args.n else args.requests
    asks = [
        [system, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)
    ]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(client, m, args) for m in asks))
    answers = [a for request in done for a in request]
    ttft = [a["first"] - a["sent"] for a in answers]
    return {
        "all_done_s": round(max(a["last"] for a in answers) - t0, 3),
        "ttft_median_s": round(statistics.median(ttft), 3),
        "ttft_max_s": round(max(ttft), 3),
        "cached_tokens": sum(request[0]["cached"] for request in done if request),
        "answers": len(answers),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="the model (default: the registry's default)")
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--llama-server", metavar="BIN", help="start this llama-server instead")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n", action="store_true", help="one request for --requests answers")
    ap.add_argument("--ctx", type=int, default=2048, help="each slot's context")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()

    with a_server(args, slots=args.requests, ctx=args.ctx) as (server, url):
        salt = int(time.time()) % 100000
        rounds = [asyncio.run(round_of(url, args, salt + r)) for r in range(args.rounds)]
    what = f"one request, n={args.requests}" if args.n else f"{args.requests} requests"
    print(f"{server}: {what}, a system prompt of ~{args.system_tokens} tokens")
    for r in rounds:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
