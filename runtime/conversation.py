"""A chat turn that goes on past the end of the context, as ollama's chats do.

The prompt is the conversation, its oldest messages dropped until it fits with room for
the answer (answer.fit_chat). If the answer still reaches the end of the session's
context, the oldest turns go too (never the system message, never the message being
answered), and the answer continues after what it has said so far: the new prompt is
the shorter conversation followed by the answer's tokens, whose common prefix with the
cache (the system message) is not computed again.

    answer, dropped = answer_turn(session, tok, messages, sampler, max_tokens, on_text)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .answer import Answer, answer_room, fit_chat, stream_answer
from .generate import Penalties, Sampler
from .model.tokenizer import Tokenizer
from .session import Session

if TYPE_CHECKING:
    from .speculative import Drafter
    from .structured import Constraint


@dataclass
class ChatAnswer(Answer):
    """An answer that may have gone on past a full context: `shifts` times the oldest
    turns made room, `dropped` messages in all."""

    shifts: int = 0
    dropped: int = 0
    # Positions the dropped turns freed: the answer's prompt and tokens fill the context
    # plus these.
    freed: int = 0

    @property
    def context_full(self) -> bool:
        return self.finish_reason == "length" and (
            self.prompt_tokens + len(self.tokens) > self.context + self.freed
        )

    def context_note(self) -> str | None:
        """One line for stderr: that the context filled, and what was done about it."""
        full = super().context_note()
        if not self.shifts:
            return full
        said = f"note: the context of {self.context} tokens filled; the {self.dropped} oldest "
        said += "message was" if self.dropped == 1 else "messages were"
        return said + " dropped and the answer went on" + (f" ({full[6:]})" if full else "")


def answer_turn(
    session: Session,
    tok: Tokenizer,
    messages: list[dict],
    sampler: Sampler,
    max_tokens: int,
    on_text: Callable[[str], None],
    penalties: Penalties | None = None,
    constraint: Constraint | None = None,
    drafter: Drafter | None = None,
    variables: dict | None = None,
) -> tuple[ChatAnswer, int]:
    """Answer the chat `messages` (edited in place as messages are dropped) in `session`,
    streaming the text to `on_text`. Returns the answer and how many messages were
    dropped before it began (those dropped on the way are the answer's `dropped`).
    `max_tokens` < 0 stops when the context is full, as stream_answer does. `drafter`
    guesses tokens (speculative decoding) all along; `variables` go to the chat template
    (Qwen3's enable_thinking)."""
    ctx = session.max_seq_len
    ids, dropped = fit_chat(tok, messages, ctx - answer_room(ctx, max_tokens), None, variables)
    first = stream_answer(
        session, tok, ids, sampler, max_tokens, on_text, penalties, constraint=constraint,
        drafter=drafter,
    )  # fmt: skip
    answer = ChatAnswer(**{f.name: getattr(first, f.name) for f in dataclasses.fields(first)})
    keep = 1 if messages and messages[0]["role"] == "system" else 0
    while answer.context_full and max_tokens > 0 and len(messages) - keep > 1:
        left = max_tokens - len(answer.tokens)
        before = len(tok.encode_chat(messages, variables=variables))
        budget = ctx - answer_room(ctx, left) - len(answer.tokens)
        kept = list(messages)
        ids, n = fit_chat(tok, kept, budget, None, variables)
        if n == 0 or len(ids) + len(answer.tokens) >= ctx:
            break  # the question and the answer so far fill the context alone
        messages[:] = kept
        more = stream_answer(
            session, tok, ids + answer.tokens, sampler, left, on_text, penalties,
            constraint=constraint, drafter=drafter,
        )  # fmt: skip
        answer.shifts, answer.dropped = answer.shifts + 1, answer.dropped + n
        answer.freed += before - len(ids)
        answer.text += more.text
        answer.tokens += more.tokens
        answer.finish_reason = more.finish_reason
        # first token to last: the pass that took up the answer again counts as a step
        answer.decode_s += more.ttft_s + more.decode_s
        answer.n_decoded += more.n_decoded + 1
    return answer, dropped
