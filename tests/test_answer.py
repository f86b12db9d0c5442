"""runtime/answer.py's stop strings, generate's penalties, and the scheduler's slots on a
tiny random model."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from tiny import make_hf_model

from infer.runtime.answer import StopStrings, stream_answer
from infer.runtime.generate import Penalties, make_sampler
from infer.runtime.loader import load_model
from infer.runtime.scheduler import Job, Sampling, Scheduler
from infer.runtime.session import Session
from infer.runtime.speculative import LookupDrafter


def _shown(stops, pieces):
    s, out, stopped = StopStrings(stops), [], False
    for p in pieces:
        text, stopped = s.push(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(s.flush())
    return "".join(out), stopped


@pytest.mark.parametrize(
    "pieces, stops, shown, stopped",
    [
        (["Hello", " wor", "ld"], ["world"], "Hello ", True),
        (["ab", "c<", "/s", ">tail"], ["</s>"], "abc", True),
        (["a<", "/b"], ["</s>"], "a</b", False),  # a partial match is shown at the end
        (["x", "y"], [], "xy", False),
        (["STOP", "here"], ["STOP"], "", True),
        (["one", "two"], ["wot", "netw"], "o", True),  # the earliest match wins
    ],
)
def test_stop_strings(pieces, stops, shown, stopped):
    assert _shown(stops, pieces) == (shown, stopped)


def test_stop_strings_hold_back_only_a_possible_start():
    s = StopStrings(["\n\nUser:"])
    assert s.push("Sure.\n") == ("Sure.", False)  # "\n" may begin the stop string
    assert s.push("x") == ("\nx", False)


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    history = [0, 0, 1]
    repeat = Penalties(repeat=2.0).apply(logits, history)
    assert repeat.tolist() == [1.0, -4.0, 1.0, 0.5]
    freq = Penalties(frequency=0.5, presence=0.25).apply(logits, history)
    assert freq.tolist() == [2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 1.0, 0.5]
    assert Penalties().apply(logits, history) is logits
    biased = Penalties(bias=((0, -100.0), (3, 2.5))).apply(logits, history)
    assert biased.tolist() == [-98.0, -2.0, 1.0, 3.0] and logits[0] == 2.0
    both = Penalties(presence=1.0, bias=((1, 1.0),)).apply(logits, history)
    assert both.tolist() == [1.0, -2.0, 1.0, 0.5]
    assert Penalties(frequency=1.0, last_n=1).apply(logits, history).tolist() == [
        2.0,
        -3.0,
        1.0,
        0.5,
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "smollm2"
    make_hf_model("smollm2", path)
    return load_model(path, max_seq_len=128)


def _run(scheduler: Scheduler, **job_fields) -> tuple[str, dict]:
    done = threading.Event()
    text, result = [], {}

    def on_event(kind, value):
        if kind == "text":
            text.append(value)
        else:
            result[kind] = value
            done.set()

    scheduler.submit(Job(on_event=on_event, **job_fields))
    assert done.wait(60)
    return "".join(text), result


def test_scheduler_reuses_the_slot_holding_the_prefix(tiny):
    greedy = Sampling(temperature=0)
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=2, context=64)
    try:
        a = tiny.tokenizer.encode("the same long system prompt, then one question")
        b = tiny.tokenizer.encode("something else entirely")
        text_a, ra = _run(scheduler, prompt=a, max_tokens=5, sampling=greedy)
        _, rb = _run(scheduler, prompt=b, max_tokens=5, sampling=greedy)
        assert ra["done"].cached_tokens == 0 and rb["done"].cached_tokens == 0
        _, r = _run(scheduler, prompt=a + [5, 6], max_tokens=5, sampling=greedy)
        assert r["done"].cached_tokens >= len(a)  # the slot that held `a` was chosen
        assert scheduler.stats.prefix_hits == 1

        # The same answer as one Session on its own.
        session = Session(tiny.model, 64)
        alone = stream_answer(session, tiny.tokenizer, a, make_sampler(0), 5, lambda _: None)
        assert text_a == alone.text
    finally:
        scheduler.close()


def test_logprobs_are_the_models(tiny):
    """Each token's log probability (and its top alternatives) is the log-softmax of the
    logits that one forward pass over prompt and answer gives at its position; greedy
    takes the top one. Through the scheduler, each piece's come just before it."""
    tok = tiny.tokenizer
    prompt = tok.encode("count with me: one two three")
    greedy = make_sampler(0)
    answer = stream_answer(
        Session(tiny.model, 128), tok, prompt, greedy, 8, lambda _: None, logprobs=3
    )
    assert len(answer.logprobs) == len(answer.tokens) > 0
    full = Session(tiny.model, 128).forward(prompt + answer.tokens, 0, all_logits=True)
    ref = torch.log_softmax(full.float(), -1)[len(prompt) - 1 :]
    for e, token, row in zip(answer.logprobs, answer.tokens, ref, strict=False):
        assert e.token == token and abs(e.logprob - row[token]) < 1e-4
        assert [t for t, _ in e.top] == row.topk(3).indices.tolist()
        assert e.top[0] == (token, e.logprob)
    # guessed and checked in one pass (prompt lookup on a repeating prompt): the same
    looped = tok.encode("a b c a b c a b c a b c")
    plain = stream_answer(
        Session(tiny.model, 128), tok, looped, greedy, 12, lambda _: None, logprobs=3
    )
    guessed = stream_answer(
        Session(tiny.model, 128), tok, looped, greedy, 12, lambda _: None,
        drafter=LookupDrafter(), logprobs=3,
    )  # fmt: skip
    assert guessed.tokens == plain.tokens
    for a, b in zip(guessed.logprobs, plain.logprobs, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4

    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=1, context=128)
    events, done = [], threading.Event()

    def on_event(kind, value):
        events.append((kind, value))
        if kind in ("done", "error"):
            done.set()

    try:
        scheduler.submit(Job(prompt, 8, on_event, Sampling(temperature=0), logprobs=3))
        assert done.wait(60)
    finally:
        scheduler.close()
    kinds = [k for k, _ in events]
    assert kinds[-1] == "done" and all(
        b == "text" for a, b in itertools.pairwise(kinds) if a == "logprobs"
    )
    sent = [e.token for k, v in events if k == "logprobs" for e in v]
    assert sent == events[-1][1].tokens[: len(sent)] and events[-1][1].tokens == answer.tokens


def test_scheduler_reports_errors_and_goes_on(tiny):
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=1, context=16)
    try:
        _, r = _run(scheduler, prompt=list(range(3, 40)), max_tokens=2)
        assert "longer than the context of 16" in str(r["error"])
        _, r = _run(scheduler, prompt=[3, 4, 5], max_tokens=2, context=8)
        assert r["done"].prompt_tokens == 3
    finally:
        scheduler.close()


def test_a_cancelled_job_stops(tiny):
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=1, context=128)
    try:
        job_text = []
        done = threading.Event()
        result = {}

        def on_event(kind, value):
            if kind == "text":
                job_text.append(value)
                job.cancel()
            else:
                result[kind] = value
                done.set()

        # Random weights rarely say end-of-turn; without the cancel this runs 100 tokens.
        job = Job([3, 4, 5], 100, on_event, Sampling(temperature=0))
        scheduler.submit(job)
        assert done.wait(60)
        assert result["done"].finish_reason == "cancelled"
        assert len(result["done"].tokens) < 100
    finally:
        scheduler.close()


def test_chat_wraps_between_words():
    import io

    from infer.cli.chat import WordWrap

    out = io.StringIO()
    wrap = WordWrap(out, 20)
    for piece in [
        "The quick brown",
        " fox jumps over the",
        " lazy dog",
        "\nsupercalifragilistic",
        "expialidocious 日本語の文章です",
    ]:
        wrap.write(piece)
    wrap.flush()
    lines = out.getvalue().split("\n")
    assert lines[:3] == ["The quick brown fox ", "jumps over the lazy ", "dog"]
    assert lines[3] == "supercalifragilistic"  # a word longer than a line is cut
    assert (
        "".join(lines[3:]).replace(" ", "") == "supercalifragilisticexpialidocious日本語の文章です"
    )
    assert all(sum(2 if ord(c) > 0x3000 else 1 for c in line) <= 20 for line in lines)


def test_server_pool_unloads_the_least_recently_used(tmp_path, monkeypatch):
    """A model that would not fit unloads idle ones, least recently used first, until it
    does (the pool itself, without HTTP; 'available memory' is faked). Each check comes
    after the heap's freed blocks (activations kept for reuse) are given back."""
    import asyncio
    from types import SimpleNamespace

    import psutil

    from infer.cli.server.pool import ModelPool, ServeSettings
    from infer.runtime.files import hugepages

    for name in ("a", "b", "c"):
        make_hf_model("smollm2", tmp_path / name, seed=len(name))
    fits = []  # what each memory check answers, in order; roomy once it runs out
    events = []

    def available():
        roomy = not (fits and not fits.pop(0))
        events.append("roomy" if roomy else "full")
        return SimpleNamespace(available=2**40 if roomy else 0)

    monkeypatch.setattr(psutil, "virtual_memory", available)
    monkeypatch.setattr(hugepages, "give_back_freed_heap", lambda: events.append("trim"))

    async def scenario():
        pool = ModelPool(ServeSettings(model_dirs=[tmp_path], ctx=64, parallel=1))
        try:
            a = await pool.get(str(tmp_path / "a"))
            b = await pool.get(str(tmp_path / "b"))
            a.touch()  # a is now the more recently used
            assert {m.name for m in pool.loaded.values()} == {a.name, b.name}
            fits.extend([False, True])  # c does not fit; after one unload it does
            await pool.get(str(tmp_path / "c"))
            return sorted(m.name for m in pool.loaded.values())
        finally:
            pool.close()

    loaded = asyncio.run(scenario())
    assert loaded == sorted([str(tmp_path / "a"), str(tmp_path / "c")])  # b went
    full = events.index("full")  # the check that unloaded b
    assert events[full - 1] == "trim" and events[full + 1 : full + 3] == ["trim", "roomy"]
