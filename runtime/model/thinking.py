"""A thinking model's thoughts, told apart from its answer.

Qwen3, QwQ and DeepSeek-R1 write their reasoning first, between <think> and </think>,
then the answer. A template that opens the thought itself (DeepSeek-R1, QwQ: the prompt
ends in "<think>") leaves only the closing tag in the answer. Servers give the thoughts
apart (ollama's `thinking`, llama-server's `reasoning_content`) and a terminal shows them
dimmed; here is the split, whole or as the answer streams.
"""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
THINK_TAGS = (OPEN, CLOSE)  # single tokens in Qwen3's vocabulary

# A template that thinks writes or reads the tags (DeepSeek-R1's only cuts earlier answers
# at </think>), or takes Qwen3's switch.
_THINKING_TEMPLATE = re.compile(r"</?think>|\benable_thinking\b|\breasoning_content\b")


def template_thinks(template: str) -> bool:
    """Whether a chat template is a thinking model's."""
    return _THINKING_TEMPLATE.search(template) is not None


def opens_thought(prompt_tail: str) -> bool:
    """Whether a prompt (its last characters suffice) leaves a thought open: the answer
    begins inside it."""
    return prompt_tail.rstrip().endswith(OPEN)


class ThoughtSplitter:
    """An answer's text as it streams, into (thoughts, answer) pieces to show now.

    An answer that begins with <think> (after any whitespace), or one whose prompt
    opened the thought (`inside`), is thought up to </think>. The whitespace around the
    thought's text and at the start of the answer after it is dropped. The end of a
    piece that may begin a tag is held until the next piece tells. An answer that
    begins otherwise is all answer, as it came."""

    def __init__(self, inside: bool = False):
        self._state = "start"
        # what an answer that does not begin with <think> is: its thought when the prompt
        # opened one (a model may still write the tag again: it is dropped)
        self._otherwise = "thought" if inside else "answer"
        self._held = ""  # text not shown yet
        self._shown_thought = False  # the thought's text has begun (its leading space is gone)

    def feed(self, piece: str) -> tuple[str, str]:
        self._held += piece
        thought = answer = ""
        while True:
            state, held = self._state, self._held
            if state == "start":
                lead = held.lstrip()
                if lead.startswith(OPEN):
                    self._state, self._held = "thought", lead[len(OPEN) :]
                    continue
                if OPEN.startswith(lead):
                    break  # nothing yet, or maybe the tag: held
                self._state = self._otherwise
            elif state == "thought":
                end = held.find(CLOSE)
                if end >= 0:
                    thought += self._thought(held[:end].rstrip())
                    self._state, self._held = "after", held[end + len(CLOSE) :]
                    continue
                keep = _partial(held, CLOSE)
                body = held[: len(held) - keep]
                show = body.rstrip()  # trailing space waits: it may end the thought
                thought += self._thought(show)
                self._held = body[len(show) :] + held[len(held) - keep :]
                break
            elif state == "after":
                lead = held.lstrip()
                if not lead:
                    self._held = ""
                    break
                self._state, self._held = "answer", lead
            else:
                answer += held
                self._held = ""
                break
        return thought, answer

    def finish(self) -> tuple[str, str]:
        """What is still held: an unclosed thought's end, or an answer's."""
        held, self._held = self._held, ""
        if self._state == "start":
            self._state = self._otherwise
        if self._state == "thought":
            return self._thought(held.rstrip()), ""
        if self._state == "after":
            return "", ""
        return "", held

    def _thought(self, text: str) -> str:
        if not self._shown_thought:
            text = text.lstrip()
            self._shown_thought = bool(text)
        return text


def split_thoughts(text: str, inside: bool = False) -> tuple[str, str]:
    """A whole answer's (thoughts, answer), as ThoughtSplitter gives them piece by piece."""
    splitter = ThoughtSplitter(inside)
    thought, answer = splitter.feed(text)
    more_thought, more_answer = splitter.finish()
    return thought + more_thought, answer + more_answer


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
