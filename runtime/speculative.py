"""Speculative decoding: guess the next few tokens cheaply, then let the model check all
of them in one pass (`session.decode` over the last token and the guesses: one row of
logits after each) and keep the longest prefix it agrees with, plus one token of its own.

    drafter.start(prompt)                          # an answer begins
    drafter.prefill(chunk)                         # with each chunk of the prompt's prefill
    guesses = drafter.guess(history, most, sampler)   # before a pass
    token, kept = verify(p, guess, sampler)        # per row, until a guess is refused
    drafter.checked(accepted)                      # after it

generate.Decoding runs this; a caller stepping Decodings gets it by giving one a drafter.
Two drafters: `LookupDrafter` copies what followed an earlier occurrence of the last few
tokens (prompt lookup, no second model), `ModelDrafter` asks a small model of the same
vocabulary. `DraftLength` chooses how many tokens to guess, and whether guessing pays.

The accept rule is speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023): a guess x drawn from q is kept
with probability min(1, p(x) / q(x)), else a token is drawn from norm(max(0, p - q)); the
tokens chosen are then distributed as p, the target's own sampler's. Greedy, p is one-hot
and the answer is the one plain decoding gives.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .. import InferError
from .model.llama import Transformer
from .model.tokenizer import Tokenizer
from .sampling import Distribution, Sampler
from .session import Session, decode


@dataclass(frozen=True)
class Guess:
    token: int
    q: Distribution | None  # what the drafter drew it from; None: a deterministic guess


def verify(p: Distribution, guess: Guess, sampler: Sampler) -> tuple[int, bool]:
    """The token at a guessed position and whether it is the guess: the guess kept with
    probability min(1, p(x) / q(x)), else a token from norm(max(0, p - q)). A
    deterministic guess (q one-hot) is kept with probability p(x), else the token comes
    from p without x. No random number is drawn when p(x) >= q(x) or p(x) = 0."""
    x = guess.token
    q = guess.q if guess.q is not None else Distribution.one_hot(x)
    px, qx = p.prob(x), q.prob(x)  # qx > 0: x was drawn from q
    if px >= qx or (px > 0 and sampler.uniform() * qx < px):
        return x, True
    return sampler.draw(p.minus(q)), False


# ------------------------------------------------------------------------------------------
# How many tokens to guess
# ------------------------------------------------------------------------------------------


@dataclass
class SpeculationStats:
    passes: int = 0  # passes that checked at least one guess
    plain_passes: int = 0  # passes with no guess (none found, or guessing paused)
    guessed: int = 0
    accepted: int = 0

    def add(self, guessed: int, accepted: int) -> None:
        """A pass that checked `guessed` guesses (0: a plain pass) and kept `accepted`."""
        if guessed:
            self.passes += 1
            self.guessed += guessed
            self.accepted += accepted
        else:
            self.plain_passes += 1

    def merge(self, other: SpeculationStats) -> None:
        self.passes += other.passes
        self.plain_passes += other.plain_passes
        self.guessed += other.guessed
        self.accepted += other.accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.guessed if self.guessed else 0.0

    @property
    def tokens_per_check(self) -> float:
        """Tokens a pass that checked guesses gave: those kept, and one of the model's own."""
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0

    def describe(self) -> str:
        return (
            f"speculation: {self.accepted}/{self.guessed} guesses accepted "
            f"({100 * self.acceptance:.0f} %), {self.tokens_per_check:.2f} tokens per checking "
            f"pass, {self.passes} checking and {self.plain_passes} plain passes"
        )


class DraftLength:
    """How many tokens to guess at the next pass. The length k starts at 1, doubles after
    a pass that kept every guess and shrinks by one after a miss (1 to `k_max`).

    Whether guessing pays comes from measured costs: a plain pass t, a checking pass of k
    guesses c(k), each guess's drafting d, and the share of guesses kept a. Guessing k
    gives 1 + a + ... + a^k tokens a pass for c(k) + k d seconds. c(k) is measured for
    each k that ran (the kernels take rows in groups, so it is not linear in k); for
    others it is t + k r, r the mean cost of a checked row beyond the first. When no k
    up to the current one beats a plain pass's 1 token in t, guessing pauses for a number
    of passes that doubles each time (16 up to 256), then one guess probes again; a kept
    probe resets the pause and earns 3 checking passes before the next, as the first
    checks of all do (one refused guess is not yet a measure of acceptance). Where guesses
    always fail that costs about one guess per doubling pause: a pass whose guesses cost
    as much as itself keeps 0.95 of plain decoding's speed over 200 tokens, 0.97 over
    500. A probe's drafting (a draft model's includes the prefill of every token it
    skipped) is kept under PROBE_SHARE of the pause before the next probe, which is
    lengthened to that end. Where a guess costs at least a plain pass (r + d >= t), no
    acceptance could pay, and guessing stops for the rest of the drafter's life. Not
    `adaptive`: always k_max, as tests want.
    """

    DECAY = 0.8  # weight of the past in the running estimates
    PAUSE, MAX_PAUSE = 16, 256
    MIN_CHECKS = 3  # checking passes measured before guessing may stop for good
    REFRESH = 32  # a plain pass every so many checking passes keeps t current
    PROBE_SHARE = 0.02  # a probe's drafting at most this share of the pause before the next

    def __init__(self, k_max: int = 8, adaptive: bool = True):
        self.k_max, self.adaptive = k_max, adaptive
        self.k = 1
        self.plain_s: float | None = None  # t
        self.row_s: float | None = None  # r
        self.check_s: dict[int, float] = {}  # c(k), by k
        self.draft_s: float | None = None  # d
        self.kept = self.tries = 0.0  # decayed counts of guesses kept and of guesses judged
        self.pause_left = 0  # plain passes to go before guessing again
        self.pause_len = self.PAUSE
        self.since_plain = 0  # checking passes since the last plain one
        self.probing = False  # a pause ended: the next pass probes with one guess
        self.grace = self.MIN_CHECKS  # checking passes to go before guessing may pause
        self.checks = 0  # checking passes measured
        self.probe_s = 0.0  # the last probe's drafting

    def next(self) -> int:
        """Tokens to guess at the next pass (0: a plain pass)."""
        if not self.adaptive:
            return self.k_max
        if self.plain_s is None or self.pause_left > 0 or self.since_plain >= self.REFRESH:
            return 0
        if self.probing:
            return 1
        if self.row_s is None:
            return self.k  # nothing measured yet: guess, to measure
        best = max(range(1, self.k + 1), key=self.speedup)
        if self.grace > 0 and self.row_s + self.draft_s < self.plain_s:
            self.grace -= 1
            return best
        if self.speedup(best) > 1.0:
            self.pause_len = self.PAUSE
            return best
        self.pause_left = max(
            self.pause_len, math.ceil(self.probe_s / (self.PROBE_SHARE * self.plain_s))
        )
        self.pause_len = min(2 * self.pause_len, self.MAX_PAUSE)
        if self.row_s + self.draft_s >= self.plain_s and self.checks >= self.MIN_CHECKS:
            self.pause_left = math.inf  # not even guesses always kept would pay: stop
        return 0

    def speedup(self, k: int) -> float:
        """Tokens per second guessing k, over a plain pass's, by the estimates."""
        a = self.kept / self.tries
        tokens = sum(a**i for i in range(k + 1))
        check = self.check_s.get(k, self.plain_s + k * self.row_s)
        return tokens * self.plain_s / (check + k * self.draft_s)

    def record(self, guessed: int, accepted: int, draft_s: float, pass_s: float) -> None:
        """A pass that checked `guessed` guesses (drafted in `draft_s` seconds) and kept
        `accepted` of them; `pass_s`: the pass and the choice of tokens after it."""
        if guessed == 0:
            if self.pause_left > 0:
                self.pause_left -= 1
                self.probing = self.pause_left == 0
            self.since_plain = 0
            self.plain_s = self._mix(self.plain_s, pass_s)
            return
        self.since_plain += 1
        self.checks += 1
        missed = accepted < guessed
        self.kept = self.DECAY * self.kept + accepted
        self.tries = self.DECAY * self.tries + accepted + missed
        if self.plain_s is not None:
            self.row_s = self._mix(self.row_s, max(0.0, pass_s - self.plain_s) / guessed)
        self.check_s[guessed] = self._mix(self.check_s.get(guessed), pass_s)
        if self.probing:
            # A probe teaches acceptance and the rows' cost, not the drafting's: a draft
            # model caught up on the tokens it skipped. Nor does it move k. A kept probe
            # earns a few checks before the next pause, for the estimates to follow.
            self.probing = False
            self.probe_s = draft_s
            if accepted == guessed:
                self.grace = self.MIN_CHECKS
                self.pause_len = self.PAUSE
            return
        self.draft_s = self._mix(self.draft_s, draft_s / guessed)
        self.k = max(1, self.k - 1) if missed else min(2 * self.k, self.k_max)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.DECAY * old + (1 - self.DECAY) * new


# ------------------------------------------------------------------------------------------
# Drafters
# ------------------------------------------------------------------------------------------


class Drafter:
    """Guesses the tokens that follow a text. Subclasses give `propose`, and `start` when
    they keep state across an answer. One drafter serves one answer at a time (answers
    in turn, as a chat's, share one: its costs and acceptance carry over)."""

    def __init__(self, k_max: int = 8, adaptive: bool = True):
        self.length = DraftLength(k_max, adaptive)
        self.stats = SpeculationStats()
        self._pending: tuple[int, float, float] | None = None  # guesses, draft s, time fed

    def start(self, prompt: list[int]) -> None:
        """An answer to `prompt` begins."""

    def prefill(self, chunk: int) -> None:
        """Work `chunk` tokens into the prompt, alongside the target's prefill (a server
        runs the other answers between the chunks)."""

    def propose(self, history: list[int], k: int, sampler: Sampler) -> list[Guess]:
        """Up to `k` guesses of the tokens after `history` (prompt and answer so far)."""
        raise NotImplementedError

    def guess(self, history: list[int], most: int, sampler: Sampler) -> list[Guess]:
        """The guesses for the next pass, at most `most`; `checked` must follow the pass."""
        k = min(self.length.next(), most)
        t0 = time.perf_counter()
        guesses = self.propose(history, k, sampler) if k > 0 else []
        t1 = time.perf_counter()
        self._pending = (len(guesses), t1 - t0, t1)
        return guesses

    def checked(self, accepted: int) -> None:
        """The pass after `guess` kept `accepted` of its guesses."""
        if self._pending is None:
            return
        guessed, draft_s, fed = self._pending
        self._pending = None
        self.length.record(guessed, accepted, draft_s, time.perf_counter() - fed)
        self.stats.add(guessed, accepted)


class LookupDrafter(Drafter):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the text's
    last n tokens, the longest that occurred (n from `n_max` down to 1), as deterministic
    guesses. No second model; it pays where the answer copies its prompt (edit this file,
    fix this text), and there long matches are rarely wrong, so runs of guesses are long."""

    def __init__(self, n_max: int = 8, k_max: int = 16, adaptive: bool = True):
        super().__init__(k_max, adaptive)
        self.n_max = n_max
        self._clear()

    def start(self, prompt: list[int]) -> None:
        self._clear()
        self._index(prompt)

    def _clear(self) -> None:
        # per n: n-gram -> the position after its latest occurrence indexed so far
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.n_max + 1)]
        self._indexed = 0  # the n-grams ending at positions up to this one are indexed

    def _index(self, history: list[int]) -> None:
        """Index the n-grams that have a token after them (end before the last token)."""
        end = len(history) - 1
        if end < self._indexed:  # not the text indexed so far
            self._clear()
        for e in range(self._indexed + 1, end + 1):
            for n in range(1, min(self.n_max, e) + 1):
                self._after[n][tuple(history[e - n : e])] = e
        self._indexed = max(self._indexed, end)

    def propose(self, history: list[int], k: int, sampler: Sampler) -> list[Guess]:
        self._index(history)
        for n in range(min(self.n_max, len(history)), 0, -1):
            e = self._after[n].get(tuple(history[-n:]))
            if e is not None:
                return [Guess(t, None) for t in history[e : e + k]]
        return []


class ModelDrafter(Drafter):
    """Guesses from a smaller model of the same vocabulary, drawn with the target's own
    sampler settings (greedy when it is). Its Session follows the answer: its prompt is
    prefilled a chunk at a time beside the target's, and before each draft its cache is
    brought to the accepted text (the common prefix kept, so the positions of refused
    guesses are written again). The draft applies no penalties or grammar: any q is
    correct, these only cost acceptance. A server gives each slot its draft `session`,
    which keeps the slot's conversation as the slot does."""

    CATCH_UP = 8  # at most this many missing tokens go through the decode step, not prefill

    def __init__(
        self,
        model: Transformer,
        vocab_size: int,
        max_seq_len: int | None = None,
        threads: int | None = None,
        k_max: int = 8,
        adaptive: bool = True,
        session: Session | None = None,
    ):
        super().__init__(k_max, adaptive)
        self.session = session or Session(model, max_seq_len, threads)
        self.vocab_size = vocab_size  # the target's rows: a guess must be a token of it
        self._prompt: list[int] | None = None  # still to prefill

    def start(self, prompt: list[int]) -> None:
        self._prompt = list(prompt) if len(prompt) < self.session.max_seq_len else None

    def prefill(self, chunk: int) -> None:
        if self._prompt is not None and self.session.prefill_chunk(self._prompt, chunk) is not None:
            self._prompt = None

    def propose(self, history: list[int], k: int, sampler: Sampler) -> list[Guess]:
        s, self._prompt = self.session, None  # _follow catches up on what prefill left
        # The cache holds the history and all guesses but the last.
        k = min(k, s.max_seq_len - len(history) + 1)
        if k <= 0:
            return []
        guesses = []
        with s.threads.forward():  # the sampler's ops too: torch's workers must not spin
            logits = self._follow(history)
            for i in range(k):
                q = sampler.distribution(logits[: self.vocab_size])
                x = sampler.draw(q)
                guesses.append(Guess(x, None if sampler.greedy else q))
                if i + 1 < k:
                    logits = s.step(x)
        return guesses

    def _follow(self, history: list[int]) -> torch.Tensor:
        """Bring the cache to hold `history`: the logits (vocab,) after its last token.
        Usually one or two tokens are missing (the model's own token after the guesses
        it kept); after a pause in guessing, more."""
        s = self.session
        n = s.reused_prefix(history)  # the last token is always computed
        if len(history) - n > self.CATCH_UP:
            return s.prefill(history)
        s.truncate(n)
        return decode([s], [history[n:]])[0][-1]


def check_draft_tokenizer(draft: Tokenizer, target: Tokenizer, draft_name: str, name: str):
    """Raise InferError (one line) unless `draft` encodes and decodes as `target` does."""
    # The pieces (id -> bytes) define the vocabulary, as structured.py reads them.
    same = draft.pieces == target.pieces and draft._special_ids == target._special_ids
    if not same:
        raise InferError(
            f"--draft {draft_name}: its tokenizer ({draft.vocab_size} tokens) is not "
            f"{name}'s ({target.vocab_size} tokens); a draft model must share the vocabulary"
        )
