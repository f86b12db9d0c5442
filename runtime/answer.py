"""One answer as a caller sees it: text streamed as tokens come, stopped at the model's
end-of-turn tokens or the caller's stop strings, timed, and cancellable.

`Answering` is one answer stepped a pass at a time: its prompt in chunks, then its
tokens, from logits its caller computes. `stream_answer` is its loop for one session
(the CLI); the server's scheduler steps many through one decode pass. Printing (CLI)
or sending (server) is the caller's `on_text` callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import InferError
from .generate import Decoding, Penalties, Sampler, TokenLogprob
from .model.tokenizer import Tokenizer
from .session import Session, decode, prefill_together

if TYPE_CHECKING:
    from .speculative import Drafter
    from .structured import Constraint


@dataclass
class Answer:
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV the cache already held
    text: str = ""
    tokens: list[int] = field(default_factory=list)  # generated, stop token excluded
    # "stop" (end of turn or a stop string) | "length" | "interrupted" (Ctrl-C) |
    # "cancelled" (the caller's `cancelled()` said so: a client went away)
    finish_reason: str = "length"
    ttft_s: float = 0.0  # prefill (between other answers' passes, on a server) + first sample
    decode_s: float = 0.0  # first token to last token
    n_decoded: int = 0  # tokens chosen in decode_s (after the first)
    context: int = 0  # the session's positions; a "length" answer may have filled them
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, if asked for
    thinking: str = ""  # a thinking model's thoughts, where the caller took them out of text
    stop_string: str = ""  # the stop string that ended it, if one did

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def context_full(self) -> bool:
        # The last token is sampled, never fed back: a full context holds context + 1.
        return self.finish_reason == "length" and (
            self.prompt_tokens + len(self.tokens) > self.context
        )

    def context_note(self) -> str | None:
        """One line for stderr when the answer stopped because the context is full."""
        if not self.context_full:
            return None
        return f"note: the context of {self.context} tokens is full (raise --ctx)"

    @property
    def prefill_tok_s(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.n_decoded / self.decode_s if self.decode_s > 0 else 0.0

    def stats_line(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"prompt {self.prompt_tokens} tok{cached}, {self.prefill_tok_s:.1f} tok/s | "
            f"generated {len(self.tokens)} tok, {self.decode_tok_s:.1f} tok/s | "
            f"TTFT {self.ttft_s:.2f} s | {self.finish_reason}"
        )


class StopStrings:
    """Holds back streamed text that may be the start of a stop string, so a stop string
    is never shown, not even in part."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched = ""  # the stop string that ended the answer, once one has

    def push(self, piece: str) -> tuple[str, bool]:
        """(The text safe to show now, whether a stop string ended the answer.)"""
        self.pending += piece
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, True
        keep = max((_overlap(self.pending, s) for s in self.stops), default=0)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0


def fit_chat(
    tok: Tokenizer,
    messages: list[dict],
    budget: int,
    tools: list[dict] | None = None,
    variables: dict | None = None,
) -> tuple[list[int], int]:
    """Encode a chat (offering `tools`, with the template's further `variables`), first
    dropping its oldest messages (never a leading system message, never the newest)
    until the prompt is at most `budget` tokens. Returns (prompt ids, messages dropped);
    `messages` is edited in place."""
    ids = tok.encode_chat(messages, tools=tools, variables=variables)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first]
        dropped += 1
        ids = tok.encode_chat(messages, tools=tools, variables=variables)
    return ids, dropped


def answer_room(context: int, max_tokens: int) -> int:
    """Positions a chat keeps free for the answer when old turns must go: `max_tokens`
    (all of the context when < 1), at most a quarter of the context."""
    return min(max_tokens if max_tokens > 0 else context, context // 4)


def prefill_answers(answers: Sequence[Answering], chunk: int) -> list[torch.Tensor | None]:
    """The next `chunk` tokens of each answer's prompt in one pass (session's
    prefill_together), and of its drafter's (each on its own); per answer what its
    `prefilled` takes."""
    for a in answers:
        if a.decoding.drafter is not None:
            a.decoding.drafter.prefill(chunk)
    return prefill_together([a.session for a in answers], [a.prompt for a in answers], chunk)


class Answering:
    """One answer after `prompt` in `session`, a pass at a time:

        a = Answering(session, tok, prompt, sampler, max_tokens, on_text)
        while a.prefilling:
            a.prefill(chunk)              # the prompt, a chunk a call; then the first token
        while not a.done:
            a.take(decode([session], [a.feed()])[0])   # or one pass over many answers
        a.answer                          # text, tokens, finish reason, timings

    `max_tokens` < 0 means until the context is full. `cancelled()` turning true ends
    the answer "cancelled" after the pass it is in; `finish(reason)` ends it from
    outside (Ctrl-C: "interrupted"). What was generated so far is kept. A `constraint`
    (structured.py, one per answer) keeps the text to its grammar; a `drafter`
    (speculative.py) makes feed() add guessed tokens, and take() keep those that hold.
    With `logprobs` (generate.Decoding's), each token's goes to `answer.logprobs`, and
    `on_logprobs` gets those of a piece of text just before `on_text` gets the piece."""

    def __init__(
        self,
        session: Session,
        tok: Tokenizer,
        prompt: list[int],
        sampler: Sampler,
        max_tokens: int,
        on_text: Callable[[str], None],
        penalties: Penalties | None = None,
        stop: Sequence[str] = (),
        cancelled: Callable[[], bool] = lambda: False,
        constraint: Constraint | None = None,
        drafter: Drafter | None = None,
        logprobs: int | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] = lambda _: None,
    ):
        if len(prompt) > session.max_seq_len:
            raise InferError(
                f"prompt is {len(prompt)} tokens, longer than the context of "
                f"{session.max_seq_len} (raise --ctx)"
            )
        self.session, self.prompt = session, prompt
        self.on_text, self.cancelled = on_text, cancelled
        room = session.max_seq_len - len(prompt) + 1  # the last token is never fed back
        max_tokens = room if max_tokens < 0 else min(max_tokens, room)
        ctx = session.max_seq_len
        self.answer = Answer(len(prompt), session.reused_prefix(prompt), context=ctx)
        self.decoding = Decoding(
            sampler, max_tokens, prompt, penalties, constraint, drafter, logprobs
        )
        self.on_logprobs = on_logprobs
        self._logprobs_sent = 0  # answer.logprobs given to on_logprobs
        self.decoder, self.stops = tok.stream_decoder(), StopStrings(stop)
        self.stop_ids = tok.stop_ids
        self.prefilling = max_tokens > 0
        self.done = not self.prefilling
        self._start = 0  # the session's length before the pass in flight
        self._t0 = time.perf_counter()
        self._t_first = self._t_last = 0.0
        self._chosen = 0

    def prefill(self, chunk: int = 512) -> None:
        """Compute the next `chunk` tokens of the prompt; after the last, the first token."""
        self.prefilled(prefill_answers([self], chunk)[0])

    @torch.inference_mode()
    def prefilled(self, logits: torch.Tensor | None) -> None:
        """Take what `prefill_answers` gave this answer: after the prompt's last token,
        choose the first token."""
        if logits is not None:
            self.prefilling = False
            self._chose(self._choose(logits[None]))

    def feed(self) -> list[int]:
        """The tokens the next pass runs for this answer."""
        self._start = len(self.session.tokens)
        return self.decoding.feed()

    @torch.inference_mode()
    def take(self, logits: torch.Tensor) -> None:
        """The pass's logits (len(feed()), vocab): choose, keep in the cache only the fed
        tokens that stay valid, stream the text."""
        new = self._choose(logits)
        self.session.truncate(self._start + len(new))
        self._chose(new)

    def _choose(self, logits: torch.Tensor) -> list[int]:
        # the sampler's ops must not leave torch's workers spinning
        with self.session.threads.forward():
            return self.decoding.choose(logits)

    def _chose(self, new: list[int]) -> None:
        self._t_last = time.perf_counter()
        self._t_first = self._t_first or self._t_last
        for token in new:
            self._chosen += 1
            if token in self.stop_ids:
                return self.finish("stop")
            self.answer.tokens.append(token)
            if self.decoding.logprobs is not None:
                self.answer.logprobs.append(self.decoding.token_logprobs[self._chosen - 1])
            shown, stopped = self.stops.push(self.decoder.push(token))
            self._emit(shown)
            if stopped:
                self.answer.stop_string = self.stops.matched
                return self._end("stop", flush=False)  # the rest is the stop string's
        if self.cancelled():
            self.finish("cancelled")
        elif self.decoding.done:
            self.finish("length")

    def finish(self, reason: str) -> None:
        """End the answer, if it has not ended, with `reason`."""
        if not self.done:
            self._end(reason, flush=True)

    def _end(self, reason: str, flush: bool) -> None:
        self.done, self.prefilling = True, False
        a = self.answer
        a.finish_reason = reason
        if flush:  # what the detokenizer and the stop strings still hold back
            shown, stopped = self.stops.push(self.decoder.flush())
            self._emit(shown if stopped else shown + self.stops.flush())
            if stopped:
                a.finish_reason, a.stop_string = "stop", self.stops.matched
        if self._t_first:
            a.ttft_s = self._t_first - self._t0
            a.decode_s = self._t_last - self._t_first
            a.n_decoded = self._chosen - 1

    def _emit(self, piece: str) -> None:
        if piece:
            self.answer.text += piece
            if self._logprobs_sent < len(self.answer.logprobs):
                self.on_logprobs(self.answer.logprobs[self._logprobs_sent :])
                self._logprobs_sent = len(self.answer.logprobs)
            self.on_text(piece)


def stream_answer(
    session: Session,
    tok: Tokenizer,
    prompt: list[int],
    sampler: Sampler,
    max_tokens: int,
    on_text: Callable[[str], None],
    penalties: Penalties | None = None,
    stop: Sequence[str] = (),
    cancelled: Callable[[], bool] = lambda: False,
    constraint: Constraint | None = None,
    prefill_chunk: int = 512,
    drafter: Drafter | None = None,
    logprobs: int | None = None,
) -> Answer:
    """Generate after `prompt` in `session` alone, calling `on_text` with each decoded
    piece (Answering's loop). Ctrl-C ends the answer "interrupted"."""
    a = Answering(
        session, tok, prompt, sampler, max_tokens, on_text, penalties, stop, cancelled,
        constraint, drafter, logprobs,
    )  # fmt: skip
    try:
        while a.prefilling:
            a.prefill(prefill_chunk)
        while not a.done:
            a.take(decode([session], [a.feed()])[0])
    except KeyboardInterrupt:
        a.finish("interrupted")
    return a.answer
