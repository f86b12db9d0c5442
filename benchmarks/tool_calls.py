"""How often a model calls the right tool, or none, through `infer serve`'s OpenAI API:
six requests with two tools offered, four that want a call and two that want none.

    python benchmarks/tool_calls.py [--models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b]

It starts its own server on a free loopback port (stopped at the end), asks each model
every request greedily, and prints what each answered and the count it got right.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import openai
from run_latency import free_port, wait_healthy

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_files",
            "description": "Find files in the project whose name matches a glob pattern",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}},
                "required": ["pattern"],
            },
        },
    },
]
# (request, the tool it wants called, or None)
REQUESTS = [
    ("What's the weather like in Tokyo?", "get_weather"),
    ("Is it raining in London right now?", "get_weather"),
    ("Find all the Python test files in this project.", "search_files"),
    ("Which YAML files do we have?", "search_files"),
    ("Write a Python function that reverses a string.", None),
    ("What is 17 times 23?", None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--max-tokens", type=int, default=120)
    args = ap.parse_args()

    port = free_port()
    models = args.models.split(",")
    server = subprocess.Popen(
        [sys.executable, "-m", "infer.cli.main", "serve", models[0], "--port", str(port)],
        env=os.environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0
    )
    try:
        wait_healthy(port, 300)
        print("| model | request | wants | got | s |\n| --- | --- | --- | --- | ---: |")
        right = dict.fromkeys(models, 0)
        for model in models:
            for text, want in REQUESTS:
                t0 = time.perf_counter()
                r = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": text}], tools=TOOLS,
                    temperature=0, max_tokens=args.max_tokens,
                )  # fmt: skip
                message = r.choices[0].message
                calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
                right[model] += [name for name, _ in calls] == ([want] if want else [])
                got = calls or repr((message.content or "")[:40])
                s = time.perf_counter() - t0
                print(f"| {model} | {text} | {want or 'no call'} | {got} | {s:.1f} |", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    for model, n in right.items():
        print(f"{model}: {n} of {len(REQUESTS)} right")


if __name__ == "__main__":
    main()
