"""Embeddings on `infer serve` beside llama-server's, on the same GGUF file: throughput
(tokens embedded a second) and how close the two servers' vectors are.

    python benchmarks/embeddings.py MODEL --llama-server BIN [--texts 32] [--batch 8]
        [--rounds 3] [--threads N] [--pooling mean]

Both servers are started on free loopback ports (llama-server with --embeddings
--pooling POOLING) and asked alike: POST /v1/embeddings, --batch texts a request, the
same --texts texts (sentences of 60-120 tokens) in each round; the servers alternate
round by round. The vectors are compared text by text (cosine; both are at unit
length): the two engines pool the same final norm's states.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_batch import start_llama_server
from serve_load import SENTENCE, start_server

WORDS = SENTENCE.split()


def texts(n: int) -> list[str]:
    """n different texts of 5-10 sentences, each sentence's words rotated."""
    out = []
    for i in range(n):
        sentences = []
        for j in range(5 + i % 6):
            k = (i * 7 + j * 3) % len(WORDS)
            sentences.append(" ".join(WORDS[k:] + WORDS[:k]).capitalize() + ".")
        out.append(f"Text {i}: " + " ".join(sentences))
    return out


def embed_all(url: str, inputs: list[str], batch: int) -> tuple[list[list[float]], int, float]:
    """(vectors, prompt tokens, seconds) for every input, `batch` a request."""
    vectors, tokens = [], 0
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as client:
        for i in range(0, len(inputs), batch):
            r = client.post(
                "/v1/embeddings", json={"input": inputs[i : i + batch], "encoding_format": "float"}
            )
            r.raise_for_status()
            body = r.json()
            vectors += [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
            tokens += body["usage"]["prompt_tokens"]
    return vectors, tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF file or a registry name")
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pooling", default="mean", help="llama-server's --pooling")
    args = ap.parse_args()

    inputs = texts(args.texts)
    rates: dict[str, list[float]] = {"infer": [], "llama.cpp": []}
    vectors: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, rate in rates.items():
                log = Path(tmp) / f"{name}.log"
                if name == "infer":
                    proc, url = start_server(args.model, log, ["--threads", str(args.threads)])
                else:
                    flags = ["--embeddings", "--pooling", args.pooling, "-t", str(args.threads)]
                    flags += ["-c", "4096", "-b", "4096", "-ub", "4096"]
                    proc, url = start_llama_server(args.llama_server, args.model, flags, log)
                try:
                    embed_all(url, inputs[:1], 1)  # warm: the first request pays for loading
                    vecs, tokens, seconds = embed_all(url, inputs, args.batch)
                finally:
                    proc.terminate()
                    proc.wait(30)
                rate.append(tokens / seconds)
                vectors[name] = vecs
                print(
                    f"{name:10s} {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tok/s",
                    file=sys.stderr,
                )
    cosines = [
        sum(a * b for a, b in zip(u, v)) for u, v in zip(vectors["infer"], vectors["llama.cpp"])
    ]
    print(f"| server | tokens embedded a second ({args.rounds} rounds) |")
    print("| --- | --- |")
    for name, r in rates.items():
        print(f"| {name} | {min(r):.1f}-{max(r):.1f} (median {statistics.median(r):.1f}) |")
    print(
        f"cosine of the two servers' vectors: min {min(cosines):.5f}, median {statistics.median(cosines):.5f}"
    )


if __name__ == "__main__":
    main()
