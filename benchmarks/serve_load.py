"""Load on `infer serve`: throughput and time to first token under concurrent requests,
and what the prefix cache saves on a long shared system prompt.

    python benchmarks/serve_load.py [MODEL] [--requests 40] [--concurrency 4]
        [--max-tokens 64] [--max-seconds 120] [--url http://127.0.0.1:11435]
        [--prefix-tokens 1000] [--json]

Without --url it starts `infer serve MODEL --port 0` itself (default model: the
registry's) and stops it at the end. Only loopback addresses are accepted.

load    --requests streamed chat completions (POST /v1/chat/completions, stream and
        include_usage), --concurrency at a time, each a different question, sampled
        with its own seed; none starts after --max-seconds, and the ones in flight then
        are cancelled and counted as errors. Reports requests/s and generated tok/s
        over the wall time, time to first token (arrival of the first text chunk, as
        the client sees it: queueing, prefill, first sample, HTTP) p50/p99, latency
        p50/p99, errors.
prefix  (--prefix-tokens > 0) a system prompt of about that many tokens, new each round
        (a number at its start, so that no slot holds it), then two requests sharing
        it with different questions, one token each: the second's TTFT over the
        first's. Three rounds; the median ratio. Goal: <= 0.15.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

QUESTIONS = [
    "What is the capital of France?",
    "Give three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn rain.",
    "What causes the seasons on Earth?",
    "Name four primary colours used in printing.",
    "How do I reverse a list in Python?",
    "Summarise the plot of Romeo and Juliet briefly.",
]
SENTENCE = "Keep every answer short, kind, accurate and written in plain English."


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


async def stream_chat(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed chat completion: TTFT, latency, generated tokens, cached tokens."""
    t0 = time.perf_counter()
    ttft, usage = None, {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    return {
        "ttft": ttft if ttft is not None else latency,
        "latency": latency,
        "tokens": usage.get("completion_tokens", 0),
        "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "prompt": usage.get("prompt_tokens", 0),
    }


async def load(url: str, model: str | None, args) -> dict:
    results, errors = [], []
    sem = asyncio.Semaphore(args.concurrency)
    deadline = time.perf_counter() + args.max_seconds

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with sem:
            if time.perf_counter() >= deadline:
                errors.append("not started: --max-seconds passed")
                return
            body = {
                "model": model,
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                "max_tokens": args.max_tokens,
                "temperature": 0.7,
                "seed": i,
            }
            try:
                left = max(0.1, deadline - time.perf_counter())
                results.append(await asyncio.wait_for(stream_chat(client, body), left))
            except (httpx.HTTPError, RuntimeError, asyncio.TimeoutError) as e:
                errors.append(f"{type(e).__name__}: {e}")

    timeout = httpx.Timeout(args.max_seconds, connect=10)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, client) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results] or [0.0]
    latency = [r["latency"] for r in results] or [0.0]
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "ok": len(results),
        "errors": len(errors),
        "error_kinds": sorted(set(errors))[:5],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 3),
        "generated_tok_s": round(tokens / wall, 1),
        "generated_tokens": tokens,
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
        "latency_p50_s": round(percentile(latency, 50), 3),
        "latency_p99_s": round(percentile(latency, 99), 3),
    }


async def prefix(url: str, model: str | None, n_tokens: int, rounds: int = 3) -> dict:
    """TTFT of a request whose ~n_tokens system prompt no slot holds, then of one that
    shares it."""
    repeats = max(1, n_tokens // 14)  # SENTENCE is about 14 tokens in a BPE vocabulary
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for r in range(rounds):
            system = f"Session {time.time_ns()}-{r}. " + " ".join([SENTENCE] * repeats)
            pair = []
            for question in QUESTIONS[:2]:
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ]
                body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
                pair.append(await stream_chat(client, body))
            first, second = pair
            out.append(
                {
                    "prompt_tokens": first["prompt"],
                    "first_ttft_s": round(first["ttft"], 4),
                    "first_cached": first["cached"],
                    "second_ttft_s": round(second["ttft"], 4),
                    "second_cached": second["cached"],
                    "ratio": round(second["ttft"] / first["ttft"], 3),
                }
            )
    return {"rounds": out, "median_ratio": statistics.median(o["ratio"] for o in out)}


def start_server(model: str | None, log: Path, extra=()) -> tuple[subprocess.Popen, str]:
    """`infer serve MODEL --port 0 EXTRA...`, its stderr in `log`; (process, its URL)."""
    cmd = [sys.executable, "-m", "infer.cli.main", "serve", *([model] if model else []), *extra]
    with log.open("w") as stderr:
        proc = subprocess.Popen([*cmd, "--port", "0"], stderr=stderr, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"serving on (http://\S+)", log.read_text())
        if m:
            return proc, m[1]
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text()}")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        sys.exit(f"--url must be a loopback address, not {host!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="the model to ask for (default: the server's)")
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="0: skip the prefix test")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        try:
            if args.url:
                check_loopback(args.url)
                url = args.url.rstrip("/")
            else:
                proc, url = start_server(args.model, log)
            report = {"url": url, "load": asyncio.run(load(url, args.model, args))}
            if args.prefix_tokens > 0:
                report["prefix"] = asyncio.run(prefix(url, args.model, args.prefix_tokens))
        finally:
            if proc is not None:
                proc.terminate()
                if (code := proc.wait(30)) != 0:
                    print(f"the server exited {code}:\n{log.read_text()}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    lo = report["load"]
    print(
        f"load: {lo['ok']}/{lo['requests']} ok, {lo['errors']} errors, concurrency "
        f"{lo['concurrency']}, {lo['wall_s']} s | {lo['requests_per_s']} req/s, "
        f"{lo['generated_tok_s']} generated tok/s | TTFT p50 {lo['ttft_p50_s']} s, "
        f"p99 {lo['ttft_p99_s']} s | latency p50 {lo['latency_p50_s']} s, "
        f"p99 {lo['latency_p99_s']} s"
    )
    for e in lo["error_kinds"]:
        print(f"  error: {e}")
    if "prefix" in report:
        for r in report["prefix"]["rounds"]:
            print(
                f"prefix: {r['prompt_tokens']} prompt tokens | first TTFT "
                f"{r['first_ttft_s'] * 1000:.0f} ms ({r['first_cached']} cached), second "
                f"{r['second_ttft_s'] * 1000:.0f} ms ({r['second_cached']} cached) | "
                f"ratio {r['ratio']:.3f}"
            )
        print(f"prefix: median ratio {report['prefix']['median_ratio']:.3f} (goal <= 0.15)")


if __name__ == "__main__":
    main()
