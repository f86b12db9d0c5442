"""One answer as a caller sees it: text streamed as tokens come, stopped at the model's
end-of-turn tokens or the caller's stop strings, timed, and cancellable.

`stream_answer` drives `generate.generate`; printing (CLI) or sending (server) is the
caller's `on_text` callback. Both the CLI and the server answer through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .generate import Penalties, Sampler, generate
from .model.tokenizer import Tokenizer
from .session import Session

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
    ttft_s: float = 0.0  # prefill + first sample
    decode_s: float = 0.0  # first token to last token
    n_decoded: int = 0  # forward passes in decode_s
    context: int = 0  # the session's positions; a "length" answer may have filled them

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

    def push(self, piece: str) -> tuple[str, bool]:
        """(The text safe to show now, whether a stop string ended the answer.)"""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
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


def fit_chat(tok: Tokenizer, messages: list[dict], budget: int) -> tuple[list[int], int]:
    """Encode a chat, first dropping its oldest messages (never a leading system message,
    never the newest) until the prompt is at most `budget` tokens. Returns (prompt ids,
    messages dropped); `messages` is edited in place."""
    ids = tok.encode_chat(messages)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    dropped = 0
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first]
        dropped += 1
        ids = tok.encode_chat(messages)
    return ids, dropped


def answer_room(context: int, max_tokens: int) -> int:
    """Positions a chat keeps free for the answer when old turns must go: `max_tokens`
    (all of the context when < 1), at most a quarter of the context."""
    return min(max_tokens if max_tokens > 0 else context, context // 4)


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
    drafter: Drafter | None = None,
) -> Answer:
    """Generate after `prompt`, calling `on_text` with each decoded piece.

    `max_tokens` < 0 means until the context is full. Ctrl-C ends the answer with
    finish_reason "interrupted", `cancelled()` turning true with "cancelled"; what was
    generated so far is kept in both cases. A `constraint` (structured.py, one per
    answer) keeps the text to its grammar; a `drafter` (speculative.py) guesses tokens.
    """
    if max_tokens < 0:
        max_tokens = session.max_seq_len  # generate() stops when the context is full
    answer = Answer(len(prompt), session.reused_prefix(prompt), context=session.max_seq_len)
    if max_tokens == 0:
        return answer
    decoder, stops = tok.stream_decoder(), StopStrings(stop)
    stop_ids = tok.stop_ids
    tokens = generate(
        session, prompt, sampler, max_tokens, penalties, constraint=constraint, drafter=drafter
    )
    t0 = time.perf_counter()
    t_first = t_last = None

    def emit(piece: str) -> None:
        if piece:
            answer.text += piece
            on_text(piece)

    by_stop_string = False
    try:
        for n, token in enumerate(tokens):
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
            answer.n_decoded = n
            if token in stop_ids:
                answer.finish_reason = "stop"
                break
            answer.tokens.append(token)
            shown, stopped = stops.push(decoder.push(token))
            emit(shown)
            if stopped:
                answer.finish_reason, by_stop_string = "stop", True
                break
            if cancelled():
                answer.finish_reason = "cancelled"
                break
    except KeyboardInterrupt:
        answer.finish_reason = "interrupted"
    finally:
        tokens.close()
    if not by_stop_string:  # what the decoder and the stop strings still hold back
        shown, stopped = stops.push(decoder.flush())
        emit(shown if stopped else shown + stops.flush())
        if stopped:
            answer.finish_reason = "stop"
    if t_first is not None:
        answer.ttft_s = t_first - t0
        answer.decode_s = t_last - t_first
    return answer
