"""Counters for `GET /metrics`, in Prometheus's text format."""

from __future__ import annotations

import time
from collections import Counter

from ...runtime.answer import Answer

# Time-to-first-token histogram buckets, in seconds.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        self.started = time.time()
        self.requests: Counter[tuple[str, int]] = Counter()  # (path, status) -> count
        self.answers: Counter[str] = Counter()  # by finish reason
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefix_hits = 0  # answers that reused cached prompt tokens
        self.generated_tokens = 0
        self.decode_seconds = 0.0
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)  # per bucket, the last one +Inf
        self.ttft_sum = 0.0

    def request(self, path: str, status: int) -> None:
        self.requests[(path, status)] += 1

    def answered(self, answer: Answer, queued_s: float) -> None:
        self.answers[answer.finish_reason] += 1
        self.prompt_tokens += answer.prompt_tokens
        self.cached_tokens += answer.cached_tokens
        self.prefix_hits += answer.cached_tokens > 0
        self.generated_tokens += len(answer.tokens)
        self.decode_seconds += answer.decode_s
        if answer.tokens or answer.finish_reason == "stop":
            ttft = queued_s + answer.ttft_s
            self.ttft_sum += ttft
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if ttft <= b), len(TTFT_BUCKETS))
            self.ttft[i] += 1

    def render(self, pool) -> str:
        """The text exposition format (version 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples) -> None:
            out.append(f"# HELP infer_{name} {help}")
            out.append(f"# TYPE infer_{name} {kind}")
            for labels, value in samples:
                out.append(f"infer_{name}{labels} {value}")

        metric(
            "requests_total",
            "counter",
            "HTTP requests by path and status.",
            [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())],
        )
        metric(
            "answers_total",
            "counter",
            "Answers generated, by how they ended (stop, length, cancelled: a client left).",
            [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.answers.items())],
        )
        metric("prompt_tokens_total", "counter", "Prompt tokens.", [("", self.prompt_tokens)])
        metric(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens the prefix cache held (not computed again).",
            [("", self.cached_tokens)],
        )
        metric(
            "prefix_cache_hits_total",
            "counter",
            "Answers that reused cached prompt tokens.",
            [("", self.prefix_hits)],
        )
        metric(
            "generated_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)]
        )
        rate = self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0
        metric(
            "decode_tokens_per_second",
            "gauge",
            "Tokens generated per second of decoding, per answer (answers decoded "
            "together each count the time).",
            [("", round(rate, 3))],
        )
        buckets, total = [], 0
        for b, n in zip((*TTFT_BUCKETS, "+Inf"), self.ttft):
            total += n
            buckets.append((f'_bucket{{le="{b}"}}', total))
        metric(
            "time_to_first_token_seconds",
            "histogram",
            "Time from arrival to the first token (queue, prefill, first sample).",
            [*buckets, ("_sum", round(self.ttft_sum, 6)), ("_count", total)],
        )
        models = list(pool.loaded.values())

        def by_model(value) -> list[tuple[str, float]]:
            return [(f'{{model="{_label(m.name)}"}}', value(m)) for m in models]

        for name, kind, text, value in (
            ("queue_depth", "gauge", "Answers waiting for their model, by model.",
             lambda m: m.scheduler.waiting),
            ("answers_running", "gauge", "Answers being generated, by model.",
             lambda m: m.scheduler.running),
            ("decode_steps_total", "counter", "Decode passes, by loaded model.",
             lambda m: m.scheduler.stats.steps),
            ("decode_batched_total", "counter",
             "Answers those passes advanced (over decode_steps_total: the mean batch).",
             lambda m: m.scheduler.stats.batched),
            ("prompt_passes_total", "counter",
             "Prompt passes (a chunk of one or several prompts), by loaded model.",
             lambda m: m.scheduler.stats.prefills),
            ("prompt_batched_total", "counter",
             "Answers those passes advanced (prompts that arrived together share one).",
             lambda m: m.scheduler.stats.prefilled),
            ("speculative_guessed_tokens_total", "counter",
             "Tokens guessed (serve --lookup or --draft) and checked, by model.",
             lambda m: m.scheduler.stats.guessed),
            ("speculative_accepted_tokens_total", "counter", "Of those, the tokens kept.",
             lambda m: m.scheduler.stats.accepted),
            ("prompt_shared_tokens_total", "counter",
             "Prompt tokens copied from another slot's KV cache, by model.",
             lambda m: m.scheduler.stats.shared_tokens),
            ("prompt_restored_tokens_total", "counter",
             "Prompt tokens copied back from the prompt cache (--cache-ram), by model.",
             lambda m: m.scheduler.stats.restored_tokens),
            ("prompt_cache_bytes", "gauge",
             "Bytes of conversations kept in the prompt cache, by model.",
             lambda m: m.scheduler.prompt_cache.nbytes if m.scheduler.prompt_cache else 0),
        ):  # fmt: skip
            metric(name, kind, text, by_model(value))
        metric("models_loaded", "gauge", "Models in memory.", [("", len(models))])
        metric(
            "model_memory_bytes",
            "gauge",
            "Estimated bytes a loaded model holds (weights, KV caches, prompt cache).",
            by_model(lambda m: m.size),
        )
        import psutil

        metric(
            "process_resident_memory_bytes",
            "gauge",
            "The server process's resident memory (RSS).",
            [("", psutil.Process().memory_info().rss)],
        )
        metric(
            "uptime_seconds",
            "gauge",
            "Seconds since start.",
            [("", round(time.time() - self.started, 1))],
        )
        return "\n".join(out) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
