"""A thinking model's thoughts told apart from its answer (runtime/model/thinking.py):
whole, and as the answer streams in pieces of every size."""

from __future__ import annotations

import random

import pytest

from infer.runtime.model.thinking import (
    ThoughtSplitter,
    opens_thought,
    split_thoughts,
    template_thinks,
)

CASES = [
    # (answer, prompt opened the thought, thoughts, answer's text)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
    ("  <think>a b</think>c", False, "a b", "c"),
    ("<think>\n\n</think>\n\nHi", False, "", "Hi"),  # Qwen3's empty thought
    ("Paris.", False, "", "Paris."),
    ("\n Paris <think>x</think>", False, "", "\n Paris <think>x</think>"),  # not at the start
    ("<thin", False, "", "<thin"),  # a tag begun, never finished: the answer's text
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.", "Paris."),  # DeepSeek-R1
    ("<think>\nagain</think>Paris.", True, "again", "Paris."),  # the opened tag written again
    ("<thin", True, "<thin", ""),  # an opened thought's text that only looked like the tag
    ("still thinking when it stopped ", True, "still thinking when it stopped", ""),
    ("<think>unclosed", False, "unclosed", ""),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # one thought only
    ("<think>a < b </thinking> c</think> d", False, "a < b </thinking> c", "d"),
    ("", False, "", ""),
    ("", True, "", ""),
]


@pytest.mark.parametrize("text, inside, thought, answer", CASES)
def test_whole(text, inside, thought, answer):
    assert split_thoughts(text, inside) == (thought, answer)


def _streamed(text: str, inside: bool, cuts: list[int]) -> tuple[list[str], list[str]]:
    splitter, thoughts, answers = ThoughtSplitter(inside), [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        t, s = splitter.feed(text[a:b])
        thoughts.append(t), answers.append(s)
    t, s = splitter.finish()
    return [*thoughts, t], [*answers, s]


@pytest.mark.parametrize("text, inside, thought, answer", CASES)
def test_every_piece_size(text, inside, thought, answer):
    """Streamed in pieces of n characters, for every n: the pieces add up to the whole
    answer's split."""
    for n in range(1, len(text) + 1):
        thoughts, answers = _streamed(text, inside, list(range(n, len(text), n)))
        assert ("".join(thoughts), "".join(answers)) == (thought, answer), n


def test_random_answers():
    """Seeded random answers of tags, whitespace and words, cut at random places: the
    streamed split equals the whole one, and nothing is sent as the answer's text before
    a thought that begins the answer has closed."""
    parts = ["<think>", "</think>", "<", "</", "<thi", " ", "\n", "word", "a<b", "think>"]
    for seed in range(300):
        rng = random.Random(seed)
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        inside = rng.random() < 0.3
        n = rng.randint(0, max(len(text) - 1, 0))
        cuts = sorted(rng.sample(range(1, len(text)), n)) if len(text) > 1 else []
        thoughts, answers = _streamed(text, inside, cuts)
        assert ("".join(thoughts), "".join(answers)) == split_thoughts(text, inside), seed
        if inside or text.lstrip().startswith("<think>"):
            close = text.find("</think>", 0 if inside else text.find("<think>") + 7)
            closed = len(text) if close < 0 else close + len("</think>")
            sent = [a for end, a in zip([*cuts, len(text)], answers) if end < closed]
            assert "".join(sent) == "", (seed, text, cuts)


def test_templates():
    assert template_thinks("{{ '<think>\\n' }}")  # DeepSeek-R1's generation prompt
    assert template_thinks("{% if enable_thinking is false %}...{% endif %}")  # Qwen3's switch
    # DeepSeek-R1-Distill's GGUF template (PyPI's part 0 of its 7B) only cuts earlier
    # answers at </think>; the model writes <think> itself
    r1 = "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}"
    assert template_thinks(r1 + "{% endif %}")
    assert not template_thinks("{{ messages }} <|im_start|>assistant")
    assert opens_thought("<|im_start|>assistant\n<think>\n")
    assert not opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thought("<|im_start|>assistant\n")


def test_thoughts_then_a_tool_call():
    """A thinking model's call after its thought (Qwen3): the server's splitter gives the
    thought, no text, and the call, however the answer is cut."""
    from infer.cli.server.requests import AnswerSplitter
    from infer.runtime.model.tool_calls import CallSplitter

    answer = (
        "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for n in (1, 2, 3, 7, len(answer)):
        splitter = AnswerSplitter(ThoughtSplitter(), CallSplitter({"get_weather"}))
        thoughts, texts = [], []
        for i in range(0, len(answer), n):
            t, s = splitter.feed(answer[i : i + n])
            thoughts.append(t), texts.append(s)
        t, s, calls = splitter.finish()
        assert "".join(thoughts) + t == "The user wants the weather."
        assert "".join(texts) + s == ""
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
