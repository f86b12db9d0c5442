"""Continuous batching on `infer serve`, or on a llama-server for comparison: aggregate
decode throughput at 1, 2, 4 and 8 concurrent streams, and the time to first token of a
request that arrives while 3 others decode against one on an idle server.

    python benchmarks/serve_batch.py [MODEL] [--streams 1,2,4,8] [--max-tokens 128]
        [--rounds 3] [--probe-tokens 200] [--ctx 1024] [--threads N]
        [--url URL | --llama-server BIN] [--json]

Without --url it starts `infer serve MODEL --parallel MAX(streams)` (default model: the
registry's), or with --llama-server BIN `BIN -m MODEL.gguf -np MAX -c MAX*ctx`, on a free
loopback port, and stops it at the end. Both are asked the same thing the same way:
streamed POST /v1/chat/completions, greedy; only loopback addresses are accepted.

decode  for each N of --streams: N streams at once, each a story prompt of its own
        (they run --max-tokens tokens on the default model), --rounds times. Aggregate
        decode tok/s = the tokens after each stream's first, over the time from the
        first stream's first token to the last stream's last. Also the mean of each
        stream's own tok/s and the median TTFT; the best round of each N.
ttft    a prompt of about --probe-tokens tokens (new each time, so no cache holds it),
        answered with 4 tokens: first on an idle server, then sent once 3 background
        streams each have their first token (they are closed after it). --rounds each;
        medians, and whether the 3 were still decoding when the probe's first token came.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_load import SENTENCE, check_loopback, start_server

TOPICS = ["a dragon", "the sea", "a robot", "a city at night"]
TOPICS += ["a lost cat", "the moon", "a train journey", "an old library"]


async def stream(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion: when it was sent, when its first and last
    text came (perf_counter), and its completion tokens (usage, else text chunks)."""
    sent, first, last, chunks, usage = time.perf_counter(), None, None, 0, {}
    async for chunk in chunks_of(client, messages, max_tokens):
        usage = chunk.get("usage") or usage
        if content(chunk):
            last = time.perf_counter()
            first = first or last
            chunks += 1
    last = last or time.perf_counter()
    first = first or last
    tokens = usage.get("completion_tokens", chunks)
    return {"sent": sent, "first": first, "last": last, "tokens": tokens}


async def chunks_of(client: httpx.AsyncClient, messages: list[dict], max_tokens: int, **fields):
    """The JSON chunks of a streamed greedy chat completion (`fields`: more of its body)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body.update(fields)
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"]))
                yield chunk


def content(chunk: dict) -> str:
    choices = chunk.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


def story(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


async def decode_round(client: httpx.AsyncClient, n: int, max_tokens: int) -> dict:
    runs = await asyncio.gather(*(stream(client, story(i), max_tokens) for i in range(n)))
    span = max(r["last"] for r in runs) - min(r["first"] for r in runs)
    after_first = sum(r["tokens"] - 1 for r in runs)
    own = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in runs if r["last"] > r["first"]]
    return {
        "streams": n,
        "tokens": sum(r["tokens"] for r in runs),
        "aggregate_tok_s": round(after_first / span, 2) if span > 0 else 0.0,
        "per_stream_tok_s": round(statistics.mean(own), 2) if own else 0.0,
        "ttft_s": round(statistics.median(r["first"] - r["sent"] for r in runs), 3),
    }


def probe_messages(n_tokens: int) -> list[dict]:
    repeats = max(1, n_tokens // 14)  # SENTENCE is about 14 tokens in a BPE vocabulary
    system = f"Note {time.time_ns()}. " + " ".join([SENTENCE] * repeats)
    return [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]


async def ttft(client: httpx.AsyncClient, n_tokens: int, busy: bool) -> dict:
    """One probe's TTFT, on an idle server or behind 3 decoding streams."""
    started = [asyncio.Event() for _ in range(3 if busy else 0)]

    async def decoding(i: int) -> None:
        try:
            async for chunk in chunks_of(client, story(i), 400):
                if content(chunk):
                    started[i].set()
        finally:  # ended early or failed: the probe goes anyway, not counted as behind 3
            started[i].set()

    background = [asyncio.ensure_future(decoding(i)) for i in range(len(started))]
    await asyncio.gather(*(e.wait() for e in started))
    probe = await stream(client, probe_messages(n_tokens), 4)
    still = [not t.done() for t in background]
    for t in background:
        t.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await wait_idle(client)
    return {"ttft_s": probe["first"] - probe["sent"], "others_decoding": all(still)}


async def wait_idle(client: httpx.AsyncClient) -> None:
    """Return once the server runs nothing (closed streams end a moment later): infer's
    /metrics, llama-server's /slots, else after a second."""
    for _ in range(600):
        r = await client.get("/metrics")
        if r.status_code == 200 and "infer_answers_running" in r.text:
            lines = r.text.splitlines()
            running = [x for x in lines if x.startswith("infer_answers_running{")]
            if all(float(x.rsplit(" ", 1)[1]) == 0 for x in running):
                return
        else:
            r = await client.get("/slots")
            if r.status_code != 200:
                await asyncio.sleep(1)
                return
            if not any(s.get("is_processing") for s in r.json()):
                return
        await asyncio.sleep(0.1)


async def measure(url: str, args) -> dict:
    timeout = httpx.Timeout(600, connect=10)
    # a connection per request: llama-server may close a kept-alive one as it is reused
    limits = httpx.Limits(max_connections=max(args.streams) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await stream(client, story(0), 4)  # warm up: first use loads and faults pages in
        rows = []
        for n in args.streams:
            rounds = [await decode_round(client, n, args.max_tokens) for _ in range(args.rounds)]
            rows.append(max(rounds, key=lambda r: r["aggregate_tok_s"]))
            await wait_idle(client)
        try:
            probes = {
                busy: [await ttft(client, args.probe_tokens, busy) for _ in range(args.rounds)]
                for busy in (False, True)
            }
        except httpx.HTTPError as err:  # keep the decode figures (a server that crashed)
            return {"decode": rows, "ttft": {"error": f"{type(err).__name__}: {err}"}}
    median = {busy: statistics.median(p["ttft_s"] for p in v) for busy, v in probes.items()}
    return {
        "decode": rows,
        "ttft": {
            "idle_s": round(median[False], 3),
            "behind_3_s": round(median[True], 3),
            "others_decoding": all(p["others_decoding"] for p in probes[True]),
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(binary: str, model: str | None, flags: list[str], log: Path):
    """`binary -m MODEL.gguf FLAGS...` on a free loopback port, once its /health answers."""
    from infer.runtime.registry import DEFAULT_MODEL, resolve

    path = resolve(model or DEFAULT_MODEL, download=False).path
    port = free_port()
    cmd = [binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    sys.exit(f"llama-server did not start:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def a_server(args, slots: int, ctx: int, extra: tuple[str, ...] = ()):
    """(name, URL) of the server to measure: --url's (loopback only), or one started here
    and stopped at the end: --llama-server BIN's, else `infer serve MODEL` (with `extra`
    options), each with `slots` slots of `ctx` positions and --threads."""
    if args.url:
        check_loopback(args.url)
        yield args.url, args.url.rstrip("/")
        return
    threads = ["-t", str(args.threads)] if args.threads else []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        if args.llama_server:
            flags = ["-np", str(slots), "-c", str(slots * ctx), *threads]
            proc, url = start_llama_server(args.llama_server, args.model, flags, log)
        else:
            flags = ["--parallel", str(slots), "--ctx", str(ctx), *threads, *extra]
            proc, url = start_server(args.model, log, flags)
        try:
            yield "llama-server" if args.llama_server else "infer", url
        finally:
            proc.terminate()
            if (code := proc.wait(30)) != 0:
                print(f"the server exited {code}:\n{log.read_text()[-3000:]}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="the model (default: the registry's default)")
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--llama-server", metavar="BIN", help="start this llama-server instead")
    ap.add_argument("--streams", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe-tokens", type=int, default=200)
    ap.add_argument("--ctx", type=int, default=1024, help="each slot's context")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    with a_server(args, slots=max(args.streams), ctx=args.ctx) as (server, url):
        report = {"server": server, "url": url, **asyncio.run(measure(url, args))}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    head = f"{report['server']} ({report['url']}): {args.max_tokens} tokens a stream"
    print(f"{head}, best of {args.rounds} rounds")
    print("| streams | aggregate decode tok/s | per stream tok/s | TTFT p50 | tokens |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in report["decode"]:
        print(
            f"| {r['streams']} | {r['aggregate_tok_s']} | {r['per_stream_tok_s']} | "
            f"{r['ttft_s']:.3f} s | {r['tokens']} |"
        )
    t = report["ttft"]
    if "error" in t:
        print(f"TTFT: not measured ({t['error']})")
        return
    note = "" if t["others_decoding"] else " (the 3 had ended in some rounds: raise --max-tokens)"
    print(
        f"TTFT of a {args.probe_tokens}-token prompt: idle {t['idle_s']:.3f} s, "
        f"while 3 decode {t['behind_3_s']:.3f} s (medians of {args.rounds}){note}"
    )


if __name__ == "__main__":
    main()
