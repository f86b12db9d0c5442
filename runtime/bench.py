"""Benchmark one model: load time, prefill and decode speed, TTFT, memory, bandwidth.

Napkin math for decode: each new token reads every weight once (the embedding table
excepted: one row of it), so decode is memory-bound and

    achieved GB/s = weight bytes per token x decode tok/s

is the number to hold against the machine's memory bandwidth (llm.c's bench style).
The KV cache and activations are left out: at short contexts they are small.
"""

from __future__ import annotations

import itertools
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InferError
from .generate import generate, make_sampler
from .llama import Transformer
from .loader import load_model

# Real text, so the prompt is made of real token ids (cycled to the length asked for).
BENCH_TEXT = (
    "The history of computing is a story of machines that grew smaller, faster and "
    "cheaper while the problems put to them grew larger. Early computers filled rooms "
    "and drew enough power to light a street; their memories held a few thousand words. "
    "Today a phone holds billions of transistors and runs language models that answer "
    "questions, translate text and write programs. Memory bandwidth, not arithmetic, "
    "now limits how fast such a model can produce each new word, because every weight "
    "must travel from memory to the processor once per generated token."
)


@dataclass
class BenchResult:
    model: str
    path: str
    format: str
    quantization: str
    dtype: str
    threads: int
    n_prompt: int
    n_gen: int
    repeats: int
    n_params: int
    load_s: float
    ttft_s: float  # prefill of n_prompt tokens + the first sample (median)
    prefill_tok_s: float  # median
    decode_tok_s: float  # median
    peak_rss_bytes: int
    weight_bytes_per_token: int
    decode_gb_s: float  # weight_bytes_per_token x decode_tok_s / 1e9

    def rows(self) -> list[list[str]]:
        """(metric, value) pairs as text, for a table."""
        return [
            ["model", f"{self.model} ({self.format}, {self.quantization}, run as {self.dtype})"],
            ["threads", str(self.threads)],
            ["load", f"{self.load_s:.2f} s"],
            [f"prefill ({self.n_prompt} tok)", f"{self.prefill_tok_s:.1f} tok/s"],
            ["TTFT", f"{self.ttft_s * 1000:.0f} ms"],
            [f"decode ({self.n_gen} tok)", f"{self.decode_tok_s:.1f} tok/s"],
            ["weights read per token", f"{self.weight_bytes_per_token / 1e6:.1f} MB"],
            ["achieved bandwidth", f"{self.decode_gb_s:.2f} GB/s"],
            ["peak RSS", f"{self.peak_rss_bytes / 1e6:.0f} MB"],
            ["repeats", f"{self.repeats} (median, after a warm-up)"],
        ]


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decoded token reads.

    Every parameter and persistent buffer (quantized weights live in buffers) counts
    once, except the embedding table, of which a token reads one row. A tied lm_head
    reads the whole table, so then it counts in full, once.
    """
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    seen: set[int] = set()
    total = 0
    # state_dict holds parameters and persistent buffers only (no KV cache, no rope tables).
    for t in model.state_dict(keep_vars=True).values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if t.data_ptr() == embed.data_ptr() and not tied:
            total += embed[0].nbytes
        else:
            total += t.nbytes
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident set size."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def bench_prompt(tokenizer, n: int) -> list[int]:
    """`n` real token ids: BENCH_TEXT tokenized and cycled."""
    ids = tokenizer.encode(BENCH_TEXT, add_special=False)
    return list(itertools.islice(itertools.cycle(ids), n))


def _timed_run(model: Transformer, prompt: list[int], n_gen: int) -> tuple[float, float]:
    """One cold-cache greedy run: (seconds to the first token, seconds for n_gen more)."""
    model.cached_tokens.clear()  # recompute the whole prompt
    greedy = make_sampler(temperature=0)
    # n_gen + 1 tokens: the first comes from prefill, each later one costs one forward.
    tokens = generate(model, prompt, greedy, max_tokens=n_gen + 1)
    t0 = time.perf_counter()
    next(tokens)
    t1 = time.perf_counter()
    for _ in tokens:  # not stopping at EOS: the speed is what is measured
        pass
    return t1 - t0, time.perf_counter() - t1


def run_bench(
    path: Path,
    *,
    n_prompt: int = 128,
    n_gen: int = 64,
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
) -> BenchResult:
    """Load the model at `path` and time it; figures are medians over `repeats` runs."""
    if n_prompt < 1 or n_gen < 1 or repeats < 1:
        raise InferError("n_prompt, n_gen and repeats must be at least 1")
    lm = load_model(path, dtype, max_seq_len=n_prompt + n_gen + 1)
    model = lm.model
    if n_prompt + n_gen > model.max_seq_len:
        raise InferError(
            f"{n_prompt} prompt + {n_gen} generated tokens exceed the model's context "
            f"of {model.max_seq_len}"
        )
    prompt = bench_prompt(lm.tokenizer, n_prompt)
    _timed_run(model, prompt, min(n_gen, 4))  # warm-up: allocator, caches, lazy init
    runs = [_timed_run(model, prompt, n_gen) for _ in range(repeats)]
    ttft = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)
    bytes_per_token = weight_bytes_per_token(model)
    decode_tok_s = n_gen / decode_s
    info = lm.info
    return BenchResult(
        model=name or Path(path).name,
        path=str(info.path),
        format=info.format,
        quantization=info.quantization,
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        n_prompt=n_prompt,
        n_gen=n_gen,
        repeats=repeats,
        n_params=info.args.n_params,
        load_s=lm.load_seconds,
        ttft_s=ttft,
        prefill_tok_s=statistics.median(n_prompt / r[0] for r in runs),
        decode_tok_s=decode_tok_s,
        peak_rss_bytes=peak_rss_bytes(),
        weight_bytes_per_token=bytes_per_token,
        decode_gb_s=bytes_per_token * decode_tok_s / 1e9,
    )
