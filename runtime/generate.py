"""Token generation: a sampler factory and one generator that yields token ids.

Detokenizing, stop tokens, timing and printing belong to the callers (cli/, bench).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .sampling import Sampler, make_sampler
from .session import Session, decode

if TYPE_CHECKING:
    from .structured import Constraint

__all__ = ["Decoding", "Penalties", "Sampler", "generate", "make_sampler"]


@dataclass(frozen=True)
class Penalties:
    """Penalties on the tokens of the last `last_n` (prompt and answer): `repeat` as
    llama.cpp's CTRL-style one (1 is off), `frequency` and `presence` as OpenAI's (0 is
    off): a token's logit drops by frequency * its count + presence if it occurs."""

    repeat: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    last_n: int = 64

    @property
    def off(self) -> bool:
        return self.repeat == 1.0 and self.frequency == 0.0 and self.presence == 0.0

    def apply(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        recent = history[-self.last_n :] if self.last_n > 0 else []
        if self.off or not recent:
            return logits
        ids, counts = torch.tensor(recent).unique(return_counts=True)
        seen = logits[ids]
        if self.repeat != 1.0:
            seen = torch.where(seen > 0, seen / self.repeat, seen * self.repeat)
        seen = seen - self.frequency * counts - self.presence
        logits = logits.clone()
        logits[ids] = seen.to(logits.dtype)
        return logits


class Decoding:
    """One answer's choice of tokens, a pass at a time: the caller runs the model (for
    this answer alone, or for several in one pass: session.decode) and hands the logits
    back. generate() below is the loop for one answer; the server's scheduler steps
    many answers through one pass.

        d = Decoding(sampler, max_tokens, prompt)
        new = d.choose(prefill_logits[None])      # the first token
        while not d.done:
            fed = d.feed()                        # tokens the next pass runs
            new = d.choose(logits_after(fed))     # (len(fed), vocab) -> new tokens

    `choose` returns the tokens chosen from a pass; as many of the fed tokens' keys and
    values stay valid in the cache as it returns tokens (the caller truncates the rest).
    A `constraint` (structured.py) masks the logits after the penalties and follows
    each token."""

    def __init__(
        self,
        sampler: Sampler,
        max_tokens: int,
        history: list[int],
        penalties: Penalties | None = None,
        constraint: Constraint | None = None,
    ):
        self.sampler, self.penalties, self.constraint = sampler, penalties, constraint
        self.history = list(history)  # prompt and answer so far (the penalties' window)
        self.remaining = max_tokens
        self.tokens: list[int] = []  # chosen so far

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    def feed(self) -> list[int]:
        """The tokens the next pass must run: the last chosen one."""
        return self.tokens[-1:]

    def choose(self, logits: torch.Tensor) -> list[int]:
        """New tokens from a pass's logits (len(feed()), vocab), the prefill's (1, vocab)
        for the first."""
        logits = logits[-1]
        if self.penalties is not None:
            logits = self.penalties.apply(logits, self.history)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = self.sampler(logits)
        if self.constraint is not None:
            self.constraint.advance(token)
        self.history.append(token)
        self.tokens.append(token)
        self.remaining -= 1
        return [token]


@torch.inference_mode()
def generate(
    session: Session,
    prompt: list[int],
    sampler: Sampler,
    max_tokens: int,
    penalties: Penalties | None = None,
    prefill_chunk: int = 512,
    constraint: Constraint | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled token ids following `prompt` in `session`.

    Stops early only when the context is full; the caller stops at end-of-turn
    tokens by closing the generator. The KV cache always matches `session.tokens`,
    so a stopped or interrupted answer can be continued.
    """
    logits = session.prefill(prompt, prefill_chunk)
    max_tokens = min(max_tokens, session.max_seq_len - len(prompt) + 1)
    if max_tokens <= 0:
        return
    d = Decoding(sampler, max_tokens, prompt, penalties, constraint)
    # the sampler's ops must not leave torch's workers spinning
    with session.threads.forward():
        new = d.choose(logits[None])
    while True:
        yield from new
        if d.done:
            break
        start, fed = len(session.tokens), d.feed()
        logits = decode([session], [fed])[0]
        with session.threads.forward():
            new = d.choose(logits)
        session.truncate(start + len(new))
