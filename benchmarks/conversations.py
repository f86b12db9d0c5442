"""More conversations than slots, on `infer serve` or a llama-server: a user going from
chat to chat, each turn re-sending the whole conversation. What each turn after the
first waits for its first token, and the prompt tokens the server says it reused.

    python benchmarks/conversations.py [MODEL] [--chats 6] [--slots 2] [--turns 3]
        [--system-tokens 600] [--max-tokens 16] [--threads N] [--cache-ram SIZE]
        [--url URL | --llama-server BIN]

Turn t of every chat, then turn t + 1 of every chat: one request at a time, streamed and
greedy, each chat with a system prompt of its own (new each run). With --chats above
--slots, a chat's earlier turns are no longer in any slot when its next turn comes, and
only a prompt cache in memory (infer's --cache-ram, llama-server's --cache-ram) keeps
them. Only loopback addresses are accepted; the server started here stops at the end.
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


async def turn(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    sent, first, text, usage = time.perf_counter(), None, [], {}
    async for chunk in chunks_of(client, messages, max_tokens):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    prompt = usage.get("prompt_tokens", 0)
    return {"ttft": (first or time.perf_counter()) - sent, "text": "".join(text),
            "prompt": prompt, "cached": cached}  # fmt: skip


async def run(url: str, args) -> dict:
    salt = int(time.time()) % 100000
    chats = []
    for c in range(args.chats):
        rules = [f"Rule {salt}-{c}-{i}: {SENTENCE}" for i in range(args.system_tokens // 16)]
        chats.append([{"role": "system", "content": " ".join(rules)}])
    later, prompts, cached = [], 0, 0
    t0 = time.perf_counter()
    # a connection a request: llama-server may close an idle kept-alive one under us
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=fresh) as client:
        for t in range(args.turns):
            for chat in chats:
                chat.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                r = await turn(client, chat, args.max_tokens)
                chat.append({"role": "assistant", "content": r["text"]})
                if t > 0:
                    later.append(r["ttft"])
                    prompts += r["prompt"]
                    cached += r["cached"]
    return {
        "total_s": round(time.perf_counter() - t0, 2),
        "later_turns_ttft_median_s": round(statistics.median(later), 3) if later else None,
        "later_turns_prompt_tokens": prompts,
        "later_turns_cached_tokens": cached,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="the model (default: the registry's default)")
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--llama-server", metavar="BIN", help="start this llama-server instead")
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=2048, help="each slot's context")
    ap.add_argument("--cache-ram", help="infer serve's --cache-ram (default: its own)")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()

    extra = ("--cache-ram", args.cache_ram) if args.cache_ram else ()
    with a_server(args, slots=args.slots, ctx=args.ctx, extra=extra) as (server, url):
        report = asyncio.run(run(url, args))
    cache = f", --cache-ram {args.cache_ram}" if args.cache_ram and not args.llama_server else ""
    print(f"{server}{cache}: {args.chats} chats on {args.slots} slots, {args.turns} turns")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
