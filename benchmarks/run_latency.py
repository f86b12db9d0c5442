"""End-to-end latency of one short answer from the shell: `infer run` in-process, `infer
run` as the client of a running `infer serve`, and llama.cpp's `llama-simple` (if given),
in alternating rounds.

    python benchmarks/run_latency.py [--model smollm2-135m] [--rounds 5] \
        [--llama-simple PATH --gguf FILE]

It starts its own server on a free loopback port (stopped at the end), waits until the
model is loaded, and times each command from fork to exit (wall clock, the median and
the range over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

# Raw text, no chat template: both tools then write exactly --tokens tokens (llama-simple
# has no template, and a chat answer may end sooner).
PROMPT = "Once upon a time, in a small village by the sea,"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if json.load(r).get("models_loaded"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server on port {port} did not load its model in {seconds} s")


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llama-simple", help="llama.cpp's llama-simple binary")
    ap.add_argument("--gguf", help="the GGUF file llama-simple runs (the model's own file)")
    args = ap.parse_args()

    infer = [sys.executable, "-m", "infer.cli.main"]
    port = free_port()
    env = {**os.environ, "INFER_HOST": f"127.0.0.1:{port}"}
    run = [*infer, "run", args.model, PROMPT, "--no-chat", "-n", str(args.tokens), "--temp", "0"]
    commands = {
        "infer run (in-process)": [*run, "--local"],
        "infer run (client of infer serve)": run,
    }
    if args.llama_simple and args.gguf:
        commands["llama.cpp llama-simple"] = [
            args.llama_simple, "-m", args.gguf, "-n", str(args.tokens), PROMPT
        ]  # fmt: skip

    server = subprocess.Popen(
        [*infer, "serve", args.model, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(port, 120)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.rounds):
            for name, cmd in commands.items():
                times[name].append(timed(cmd, env))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)

    print(f"{args.model}, {args.tokens} tokens, {args.rounds} alternating rounds; seconds")
    print("| command | median | range |\n| --- | ---: | ---: |")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f}-{max(ts):.2f} |")


if __name__ == "__main__":
    main()
