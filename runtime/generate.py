"""Token generation: a sampler factory and one generator that yields token ids.

Detokenizing, stop tokens, timing and printing belong to the callers (cli/, bench).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .sampling import Distribution, Sampler, as_sampler, make_sampler
from .session import Session, decode
from .speculative import Drafter, Guess, verify

if TYPE_CHECKING:
    from .structured import Constraint

__all__ = ["Decoding", "Penalties", "Sampler", "TokenLogprob", "generate", "make_sampler"]


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log probability under the model (its logits' log-softmax, before
    penalties, sampling settings or a grammar), and the `top` most likely tokens'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    lp = torch.log_softmax(logits.float(), -1)
    best = torch.topk(lp, top) if top > 0 else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best else ()
    return TokenLogprob(token, float(lp[token]), pairs)


@dataclass(frozen=True)
class Penalties:
    """What moves logits before sampling. Penalties on the tokens of the last `last_n`
    (prompt and answer): `repeat` as llama.cpp's CTRL-style one (1 is off), `frequency`
    and `presence` as OpenAI's (0 is off): a token's logit drops by frequency * its count
    + presence if it occurs. And `bias`: (token, value) pairs added to those tokens'
    logits, OpenAI's logit_bias (-100 bans a token, 100 all but forces it)."""

    repeat: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    last_n: int = 64
    bias: tuple[tuple[int, float], ...] = ()

    @property
    def off(self) -> bool:
        return self._no_history and not self.bias

    @property
    def _no_history(self) -> bool:
        return self.repeat == 1.0 and self.frequency == 0.0 and self.presence == 0.0

    def apply(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        if self.off:
            return logits
        logits = logits.clone()
        recent = history[-self.last_n :] if self.last_n > 0 else []
        if recent and not self._no_history:
            ids, counts = torch.tensor(recent).unique(return_counts=True)
            seen = logits[ids]
            if self.repeat != 1.0:
                seen = torch.where(seen > 0, seen / self.repeat, seen * self.repeat)
            seen = seen - self.frequency * counts - self.presence
            logits[ids] = seen.to(logits.dtype)
        if self.bias:
            ids, values = zip(*self.bias, strict=True)
            logits[list(ids)] += torch.tensor(values, dtype=logits.dtype)
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
    each token. With a `drafter` (speculative.py), feed() adds guesses of the next tokens
    after the last one, and choose() keeps those the model agrees with, row by row.
    With `logprobs` (the number of alternatives: 0 or more), `token_logprobs` holds a
    TokenLogprob per chosen token.
    """

    def __init__(
        self,
        sampler: Sampler | Callable[[torch.Tensor], int],
        max_tokens: int,
        history: list[int],
        penalties: Penalties | None = None,
        constraint: Constraint | None = None,
        drafter: Drafter | None = None,
        logprobs: int | None = None,
    ):
        self.sampler, self.penalties, self.constraint = as_sampler(sampler), penalties, constraint
        self.history = list(history)  # prompt and answer so far (the penalties' window)
        self.remaining = max_tokens
        self.tokens: list[int] = []  # chosen so far
        self.logprobs = logprobs
        self.token_logprobs: list[TokenLogprob] = []  # with `logprobs`: one per token
        self.drafter = drafter
        self._guesses: list[Guess] | None = None  # fed after the last token, to be checked
        if drafter is not None:
            drafter.start(self.history)

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    def feed(self) -> list[int]:
        """The tokens the next pass must run: the last chosen one, and the guesses."""
        self._guesses = []
        if self.drafter is not None:
            # A pass gives at most one token more than it has guesses: max_tokens holds,
            # and with it the context (the caller fits max_tokens to it).
            self._guesses = self.drafter.guess(self.history, self.remaining - 1, self.sampler)
        return self.tokens[-1:] + [g.token for g in self._guesses]

    def choose(self, logits: torch.Tensor) -> list[int]:
        """New tokens from a pass's logits (len(feed()), vocab), the prefill's (1, vocab)
        for the first. Row j's distribution follows the tokens chosen before it (the
        penalties' history, the grammar's state): greedy, the tokens are those of plain
        decoding. The grammar only ever moves by a chosen token, so guesses need no
        rollback (a guess it forbids has probability 0 and is refused)."""
        guesses, self._guesses = self._guesses, None
        fed = guesses is not None  # else the prefill's logits: no pass to account for
        guesses = guesses or []
        if len(logits) != len(guesses) + 1:
            raise ValueError(f"choose: {len(logits)} rows of logits for {len(guesses)} guesses")
        new = []
        for j, row in enumerate(logits):
            p = self._distribution(row)
            if j < len(guesses):
                token, kept = verify(p, guesses[j], self.sampler)
            else:
                token, kept = self.sampler.draw(p), False
            if self.logprobs is not None:
                self.token_logprobs.append(token_logprob(row, token, self.logprobs))
            self._take(token)
            new.append(token)
            if not kept:
                break
        if fed and self.drafter is not None:
            self.drafter.checked(len(new) - 1)
        return new

    def _distribution(self, logits: torch.Tensor) -> Distribution:
        if self.penalties is not None:
            logits = self.penalties.apply(logits, self.history)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        return self.sampler.distribution(logits)

    def _take(self, token: int) -> None:
        if self.constraint is not None:
            self.constraint.advance(token)
        self.history.append(token)
        self.tokens.append(token)
        self.remaining -= 1


@torch.inference_mode()
def generate(
    session: Session,
    prompt: list[int],
    sampler: Sampler | Callable[[torch.Tensor], int],
    max_tokens: int,
    penalties: Penalties | None = None,
    prefill_chunk: int = 512,
    constraint: Constraint | None = None,
    drafter: Drafter | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled token ids following `prompt` in `session`.

    Stops early only when the context is full; the caller stops at end-of-turn
    tokens by closing the generator. The KV cache always matches `session.tokens`,
    so a stopped or interrupted answer can be continued. A `drafter` makes the
    decoding speculative (speculative.py): the same answer when greedy, the same
    distribution when sampling.
    """
    logits = session.prefill(prompt, prefill_chunk)
    max_tokens = min(max_tokens, session.max_seq_len - len(prompt) + 1)
    if max_tokens <= 0:
        return
    # the sampler's ops (and a draft model's) must not leave torch's workers spinning
    with session.threads.forward():
        d = Decoding(sampler, max_tokens, prompt, penalties, constraint, drafter)
        if drafter is not None:  # a draft model's prompt, before the first token too
            drafter.prefill(len(prompt))
        new = d.choose(logits[None])
    while True:
        yield from new
        if d.done:
            break
        start = len(session.tokens)
        with session.threads.forward():
            fed = d.feed()
        logits = decode([session], [fed])[0]
        with session.threads.forward():
            new = d.choose(logits)
        session.truncate(start + len(new))
