"""`infer bench --lookup` and `--draft MODEL`: what speculative decoding gains on one
prompt, against plain decoding measured in the same run.

Rounds alternate plain and speculative decoding of the same greedy answer, in turn
first, so that a machine busy with something else slows both alike. Greedy, the two
answers are the same tokens (the result says whether they were). Speeds are medians
over the rounds; acceptance figures add up all speculative rounds. Each speculative
round starts a new drafter, as one `infer run` does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import InferError
from .bench import BENCH_TEXT
from .files.sources import open_source
from .generate import generate, make_sampler
from .loader import LoadedModel, load_model
from .session import Session
from .speculative import (
    Drafter,
    LookupDrafter,
    ModelDrafter,
    SpeculationStats,
    check_draft_tokenizer,
)

# A copy task: the answer repeats most of the prompt, as edits of a file do.
COPY_TASK = (
    "Repeat the text below with its spelling and punctuation checked; change nothing "
    "else.\n\n" + BENCH_TEXT
)


@dataclass
class SpeculativeResult:
    model: str
    drafter: str  # "prompt lookup" or the draft model's name
    threads: int
    prompt_tokens: int
    answer_tokens: int  # of the plain answer (greedy: the speculative one is the same)
    same_answer: bool
    rounds: int
    plain_ttft_s: float
    speculative_ttft_s: float  # a draft model prefills the prompt too
    plain_tok_s: float  # decode: the tokens after the first, over their time
    speculative_tok_s: float
    speedup: float  # speculative_tok_s / plain_tok_s
    stats: SpeculationStats

    def rows(self) -> list[list[str]]:
        s = self.stats
        return [
            ["model", self.model],
            ["guesses by", self.drafter],
            ["threads", str(self.threads)],
            ["prompt", f"{self.prompt_tokens} tok"],
            [
                "answer",
                f"{self.answer_tokens} tok ({'same' if self.same_answer else 'NOT the same'})",
            ],
            ["rounds", f"{self.rounds} of each, alternating (median)"],
            [
                "TTFT plain / speculative",
                f"{self.plain_ttft_s:.2f} / {self.speculative_ttft_s:.2f} s",
            ],
            ["decode plain", f"{self.plain_tok_s:.1f} tok/s"],
            ["decode speculative", f"{self.speculative_tok_s:.1f} tok/s"],
            ["speedup", f"{self.speedup:.2f}x"],
            ["acceptance", f"{100 * s.acceptance:.0f} % ({s.accepted} of {s.guessed} guesses)"],
            ["tokens per checking pass", f"{s.tokens_per_check:.2f}"],
            ["passes checking / plain", f"{s.passes} / {s.plain_passes}"],
        ]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stats"] = {**d["stats"], "acceptance": self.stats.acceptance}
        d["stats"]["tokens_per_check"] = self.stats.tokens_per_check
        return d


@dataclass
class _Run:
    tokens: list[int]  # the answer, its stop token excluded
    ttft_s: float
    decode_s: float  # from the first token to the last (a stop token included)
    decoded: int  # tokens in decode_s: all but the first

    @property
    def tok_s(self) -> float:
        return self.decoded / self.decode_s if self.decode_s > 0 else 0.0


def _answer(session: Session, prompt, n_gen: int, stop_ids, drafter: Drafter | None) -> _Run:
    """One greedy answer from a cold cache."""
    session.reset()
    tokens = generate(session, prompt, make_sampler(0), n_gen, drafter=drafter)
    out, n, t0 = [], 0, time.perf_counter()
    t_first = t_last = t0
    try:
        for n, token in enumerate(tokens):
            t_last = time.perf_counter()
            if n == 0:
                t_first = t_last
            if token in stop_ids:
                break
            out.append(token)
    finally:
        tokens.close()
    return _Run(out, t_first - t0, t_last - t_first, n)


def run_speculative_bench(
    path: Path,
    *,
    lookup: bool = False,
    draft: Path | None = None,
    prompt: str = COPY_TASK,
    n_gen: int = 128,
    rounds: int = 3,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    draft_name: str | None = None,
    kv_cache: str | None = None,
) -> SpeculativeResult:
    """Load the model at `path` (and the `draft` model), both with KV caches of `kv_cache`'s
    format (default the compute dtype's), and time greedy answers to the chat `prompt`,
    plain and speculative in alternating rounds."""
    if lookup == (draft is not None):
        raise InferError("give --lookup or --draft")
    if n_gen < 2 or rounds < 1:
        raise InferError("n_gen must be at least 2 and rounds at least 1")
    lm = load_model(path, dtype, kv_cache=kv_cache)
    tok = lm.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    ctx = len(ids) + n_gen
    if ctx > lm.model.max_seq_len:
        raise InferError(f"{len(ids)} prompt + {n_gen} tokens exceed the model's context")
    name, draft_name = name or Path(path).name, draft_name or (draft and Path(draft).name)
    make = _drafters(lm, lookup, draft, dtype, ctx, name, draft_name, kv_cache)
    session = Session(lm.model, ctx)

    def one(drafter):
        return _answer(session, ids, n_gen, tok.stop_ids, drafter)

    one(None), one(make())  # warm-up: allocator, caches, lazy init
    stats = SpeculationStats()
    plain, fast = [], []
    for r in range(rounds):
        for speculate in (False, True) if r % 2 == 0 else (True, False):
            if speculate:
                drafter = make()
                fast.append(one(drafter))
                stats.merge(drafter.stats)
            else:
                plain.append(one(None))
    plain_tok_s = statistics.median(r.tok_s for r in plain)
    fast_tok_s = statistics.median(r.tok_s for r in fast)
    return SpeculativeResult(
        model=name,
        drafter="prompt lookup" if lookup else draft_name,
        threads=torch.get_num_threads(),
        prompt_tokens=len(ids),
        answer_tokens=len(plain[0].tokens),
        same_answer=all(r.tokens == plain[0].tokens for r in fast + plain),
        rounds=rounds,
        plain_ttft_s=statistics.median(r.ttft_s for r in plain),
        speculative_ttft_s=statistics.median(r.ttft_s for r in fast),
        plain_tok_s=plain_tok_s,
        speculative_tok_s=fast_tok_s,
        speedup=fast_tok_s / plain_tok_s if plain_tok_s else 0.0,
        stats=stats,
    )


def _drafters(
    lm: LoadedModel, lookup, draft, dtype, ctx: int, name, draft_name, kv_cache
) -> Callable[[], Drafter]:
    """A maker of new drafters; the draft model loads once."""
    if lookup:
        return LookupDrafter
    check_draft_tokenizer(open_source(Path(draft)).tokenizer(), lm.tokenizer, draft_name, name)
    model = load_model(draft, dtype, max_seq_len=ctx, kv_cache=kv_cache).model
    return lambda: ModelDrafter(model, lm.model.args.vocab_size, ctx)
