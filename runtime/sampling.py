"""Samplers: logits -> token id, in two halves. `distribution(logits)` is what the
sampler draws from (temperature, top-k, top-p and min-p applied); `draw(dist)` draws.
Plain decoding calls both at once (`sampler(logits)`); speculative decoding
(speculative.py) holds a guess against the target's distribution before drawing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Distribution:
    """Probabilities of the tokens a sampler may choose: `probs[i]` of token `ids[i]`,
    summing to 1; every token not in `ids` has probability 0.

    ids: (n,) int64, distinct; probs: (n,) float64 (some may be 0: tokens a filter dropped).
    """

    ids: torch.Tensor
    probs: torch.Tensor

    @staticmethod
    def one_hot(token: int) -> Distribution:
        return Distribution(torch.tensor([token]), torch.ones(1, dtype=torch.float64))

    def prob(self, token: int) -> float:
        hit = torch.nonzero(self.ids == token)
        return float(self.probs[hit[0, 0]]) if len(hit) else 0.0

    def minus(self, other: Distribution) -> Distribution:
        """norm(max(0, self - other)): what speculative sampling draws from after it
        rejects a guess drawn from `other`. `self` itself where that is 0 everywhere (the
        two are equal, so a rejection had probability 0 but for rounding)."""
        size = int(max(self.ids.max(), other.ids.max())) + 1
        theirs = torch.zeros(size, dtype=torch.float64)
        theirs[other.ids] = other.probs
        rest = (self.probs - theirs[self.ids]).clamp_(min=0.0)
        total = float(rest.sum())
        return Distribution(self.ids, rest / total) if total > 0 else self


class Sampler:
    """logits (vocab,) -> token id, from make_sampler. Temperature 0 is greedy: its
    distribution is one-hot and it draws no random numbers."""

    def __init__(
        self, temperature: float, top_k: int, top_p: float, min_p: float, seed: int | None
    ):
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator()
            if seed is not None:
                self.generator.manual_seed(seed)
            else:
                self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def __call__(self, logits: torch.Tensor) -> int:
        return self.draw(self.distribution(logits))

    def distribution(self, logits: torch.Tensor) -> Distribution:
        """The distribution over `logits` (vocab,) this sampler draws from."""
        if self.greedy:
            return Distribution.one_hot(int(torch.argmax(logits)))
        logits = logits.float()
        if 0 < self.top_k < logits.shape[-1]:
            logits, ids = torch.topk(logits, self.top_k)  # sorted, descending
        else:
            logits, ids = torch.sort(logits, descending=True)
        # In float64 from the top logit: a tiny temperature (1e-300) gives -inf, never nan.
        probs = torch.softmax((logits.double() - logits[0]) / self.temperature, dim=-1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if self.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            keep &= (torch.cumsum(probs, dim=-1) - probs) < self.top_p
        if self.min_p > 0.0:
            keep &= probs >= self.min_p * probs[0]
        keep[0] = True  # top_p 0 keeps the likeliest token, as llama.cpp
        probs = torch.where(keep, probs, 0.0)
        return Distribution(ids, probs / probs.sum())

    def draw(self, dist: Distribution) -> int:
        """A token drawn from `dist`; greedy: its likeliest."""
        if len(dist.ids) == 1 or self.generator is None:
            return int(dist.ids[torch.argmax(dist.probs)])
        return int(dist.ids[torch.multinomial(dist.probs, 1, generator=self.generator)])

    def uniform(self) -> float:
        """A number drawn uniformly from [0, 1), from the same random stream."""
        return float(torch.rand((), dtype=torch.float64, generator=self.generator))


def make_sampler(
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 0.95,
    min_p: float = 0.05,
    seed: int | None = None,
) -> Sampler:
    """A Sampler: logits (vocab,) -> token id. Temperature 0 is greedy and deterministic."""
    return Sampler(temperature, top_k, top_p, min_p, seed)


class ChoiceSampler(Sampler):
    """Any `logits -> token id` callable as a Sampler: its distribution is one-hot at the
    token the callable chooses. A random choice is then a sample of the callable's own
    distribution, and a guess checked against it is kept only when it is that sample,
    so speculative decoding keeps the callable's distribution, at a lower acceptance."""

    def __init__(self, choose: Callable[[torch.Tensor], int]):
        self.choose = choose
        self.generator = None

    @property
    def greedy(self) -> bool:
        return True  # deterministic given its choice: no q to hold a guess against

    def distribution(self, logits: torch.Tensor) -> Distribution:
        return Distribution.one_hot(int(self.choose(logits)))


def as_sampler(sampler: Sampler | Callable[[torch.Tensor], int]) -> Sampler:
    """`sampler` itself, or a plain callable wrapped (ChoiceSampler)."""
    return sampler if isinstance(sampler, Sampler) else ChoiceSampler(sampler)
