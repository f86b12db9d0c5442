"""A chat past the end of its context (runtime/conversation.py): the oldest turns go, the
system message and the question stay, and the answer goes on; through the terminal
chat's loop (cli/chat.py) as well. A tiny random model never ends its turn, so every
answer runs to its token limit."""

from __future__ import annotations

import pytest
from tiny import make_hf_model

from infer.cli.chat import ChatSettings, LocalModel, chat_loop
from infer.runtime import answer as answering
from infer.runtime.conversation import answer_turn
from infer.runtime.generate import make_sampler
from infer.runtime.loader import load_model
from infer.runtime.session import Session

CTX = 256
SYSTEM = {"role": "system", "content": "Be brief."}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "smollm2"
    make_hf_model("smollm2", path)
    return path


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def test_the_answer_goes_on_past_a_full_context(tiny_dir, monkeypatch):
    lm = load_model(tiny_dir, max_seq_len=CTX)
    tok = lm.tokenizer
    messages = [SYSTEM, turn("user", "a"), turn("assistant", "b" * 10),
                turn("user", "c"), turn("assistant", "d" * 10), turn("user", "Go on.")]  # fmt: skip
    question, system_ids = messages[-1], tok.encode_chat([SYSTEM], add_generation_prompt=False)
    prompt = len(tok.encode_chat(messages))
    assert prompt <= CTX - CTX // 4  # it fits with the room an answer gets: nothing dropped
    session = Session(lm.model)
    starts = []  # where each prompt pass begins: after what the cache already holds
    prefill = answering.prefill_together

    def spy(sessions, prompts, chunk):
        starts.extend(s.reused_prefix(p) for s, p in zip(sessions, prompts))
        return prefill(sessions, prompts, chunk)

    monkeypatch.setattr(answering, "prefill_together", spy)
    text = []
    answer, dropped = answer_turn(session, tok, messages, make_sampler(0.0), 200, text.append)
    assert dropped == 0 and answer.shifts == 1 and answer.dropped == 4
    assert messages == [SYSTEM, question]  # the system message and the question stay
    # Not stopped at the end of the context: every token asked for, more than fit.
    assert answer.finish_reason == "length" and len(answer.tokens) == 200 > CTX - prompt
    assert not answer.context_full and "went on" in answer.context_note()
    assert answer.text == "".join(text)
    # The cache kept the system message: the prompt after the drop was computed from it on.
    assert starts[0] == 0 and starts[1] >= len(system_ids)
    assert session.tokens[: len(system_ids)] == system_ids
    assert session.tokens[-len(answer.tokens) + 1 :] == answer.tokens[:-1]


def test_nothing_left_to_drop_stops_as_before(tiny_dir):
    lm = load_model(tiny_dir, max_seq_len=CTX)
    messages = [SYSTEM, turn("user", "Tell me everything.")]
    answer, dropped = answer_turn(
        Session(lm.model), lm.tokenizer, messages, make_sampler(0.0), 500, lambda _: None
    )
    assert (dropped, answer.shifts) == (0, 0) and len(messages) == 2
    assert answer.context_full and "raise --ctx" in answer.context_note()


def test_terminal_chat_drops_old_turns_and_says_so(tiny_dir, monkeypatch, capsys):
    """Two short exchanges, then an answer longer than the context left: the chat keeps
    going, with an int8 KV cache, and says on stderr what it dropped."""
    lm = load_model(tiny_dir, max_seq_len=CTX, kv_cache="int8")
    lines = iter(["a", "b", "/set parameter num_predict 200", "Go on.", None])

    def read(prompt: str = "") -> str:
        line = next(lines)
        if line is None:
            raise EOFError
        return line

    monkeypatch.setattr("builtins.input", read)
    settings = ChatSettings(max_tokens=10, temperature=0.0, system="Be brief.", verbose=True)
    chat_loop(LocalModel("tiny", lm), settings)
    err = capsys.readouterr().err
    assert "oldest messages were dropped and the answer went on" in err
    assert "generated 200 tok" in err and "raise --ctx" not in err
