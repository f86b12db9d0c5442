"""The scheduler's continuous batching: answers decoded together equal answers decoded
alone, whoever joins or leaves the batch and when; the queue beyond `parallel`; the
prefix cache; a cancelled answer leaving at once. On a tiny random model and on the
real default model.

Jobs join mid-way from other jobs' callbacks (on the scheduler's thread), so the order
of events is the same on every run: nothing here depends on timing.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch
from tiny import make_hf_model

from infer import InferError
from infer.runtime.answer import Answer, stream_answer
from infer.runtime.generate import Decoding, make_sampler
from infer.runtime.loader import estimated_bytes, kv_cache_bytes, load_model
from infer.runtime.scheduler import Job, Sampling, Scheduler
from infer.runtime.session import Session

GREEDY = Sampling(temperature=0)
CTX = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "smollm2"
    make_hf_model("smollm2", path)
    return load_model(path, max_seq_len=CTX)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


class Run:
    """One job and what its callback saw; `when(k, action)` does `action()` on the
    scheduler's thread at the job's k-th text piece (or at its end, if it says less)."""

    def __init__(self, scheduler: Scheduler, ids: list[int], max_tokens: int, log=None):
        self.scheduler, self.ids, self.max_tokens = scheduler, ids, max_tokens
        self.pieces: list[str] = []
        self.answer: Answer | None = None
        self.error: Exception | None = None
        self.finished = threading.Event()
        self.log = log if log is not None else []  # (event, run) in order, shared by runs
        self.running_seen: list[int] = []  # scheduler.running at each event
        self._actions: list[tuple[int, object]] = []
        self.job = Job(ids, max_tokens, self.on_event, GREEDY)

    def when(self, k: int, action) -> Run:
        self._actions.append((k, action))
        return self

    def submit(self) -> Run:
        self.scheduler.submit(self.job)
        return self

    def on_event(self, kind, value) -> None:
        self.running_seen.append(self.scheduler.running)
        if kind == "text":
            self.pieces.append(value)
            self.log.append(("text", self))
        elif kind == "done":
            self.answer = value
            self.log.append(("done", self))
        else:
            self.error = value
        for k, action in list(self._actions):
            if len(self.pieces) >= k or kind != "text":
                self._actions.remove((k, action))
                action()
        if kind != "text":
            self.finished.set()

    def wait(self) -> Answer:
        assert self.finished.wait(120), "the job did not end"
        assert self.error is None, self.error
        assert "".join(self.pieces) == self.answer.text
        return self.answer


def alone(lm, ids: list[int], max_tokens: int, chunk: int, session=None) -> Answer:
    session = session or Session(lm.model, CTX)
    sampler = make_sampler(0)
    return stream_answer(session, lm.tokenizer, ids, sampler, max_tokens, lambda _: None, prefill_chunk=chunk)  # fmt: skip


def test_batched_answers_equal_answers_alone(tiny):
    """Prompts of different lengths (several prefill chunks) join the batch while others
    decode, one waits for a slot, and each answer equals the same answer alone."""
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=3, context=CTX, prefill_chunk=8)
    try:
        log: list = []
        specs = [(5, 24), (19, 30), (33, 9), (50, 16), (12, 20)]  # (prompt length, tokens)
        runs = [Run(scheduler, prompt(n, seed), m, log) for seed, (n, m) in enumerate(specs)]
        a, b, c, d, e = runs
        a.when(2, b.submit)
        b.when(3, lambda: (c.submit(), d.submit()))
        c.when(1, e.submit)  # three running: waits for the first slot to free
        a.submit()
        for r in runs:
            got = r.wait()
            want = alone(tiny, r.ids, r.max_tokens, chunk=8)
            assert got.tokens == want.tokens and got.text == want.text
            assert got.finish_reason == want.finish_reason
        assert max(n for r in runs for n in r.running_seen) == 3
        st = scheduler.stats
        assert st.jobs == 5 and st.batched > st.steps  # passes ran several answers
        # e started once one of the first three had ended, and ran beside the others.
        first_done = next(i for i, (kind, _) in enumerate(log) if kind == "done")
        assert log.index(("text", e)) > first_done
        assert e.job.started >= min(r.job.started for r in runs[:3])
    finally:
        scheduler.close()


def test_batched_answers_with_a_draft_model_equal_answers_alone(tiny, tmp_path):
    """--draft: each slot's draft model keeps a cache of its own, prefilled a chunk at a
    time beside the slot's; its guesses are checked in the passes the answers share,
    and every answer is its plain answer alone."""
    path = tmp_path / "draft"
    make_hf_model("smollm2", path, seed=1, num_hidden_layers=1)  # same vocabulary, poor guesses
    draft = load_model(path, max_seq_len=CTX)
    scheduler = Scheduler(
        tiny.model, tiny.tokenizer, parallel=2, context=CTX, prefill_chunk=8, draft=draft.model
    )
    chunks, draft_slot = [], scheduler.draft_slots[1]
    prefill_chunk = draft_slot.prefill_chunk

    def counted(ids, n):
        chunks.append(n)
        return prefill_chunk(ids, n)

    draft_slot.prefill_chunk = counted
    try:
        specs = [(5, 24), (33, 20), (12, 16)]
        runs = [Run(scheduler, prompt(n, seed), m) for seed, (n, m) in enumerate(specs)]
        runs[0].when(2, runs[1].submit)
        runs[1].when(1, runs[2].submit)
        runs[0].submit()
        for r in runs:
            got = r.wait()
            want = alone(tiny, r.ids, r.max_tokens, chunk=8)
            assert got.tokens == want.tokens and got.text == want.text
        st = scheduler.stats
        assert st.guessed > 0 and st.batched > st.steps
        assert chunks[:5] == [8] * 5  # the 33-token prompt, beside the slot's own chunks
        # the draft cache follows its slot's conversation (all but guesses refused at the end)
        for slot, draft in zip(scheduler.slots, scheduler.draft_slots):
            last = next(r.ids for r in runs[::-1] if slot.tokens[: len(r.ids)] == r.ids)
            assert draft.tokens[: len(last)] == last
    finally:
        scheduler.close()


def test_queue_beyond_parallel_waits_its_turn(tiny):
    """Five jobs at once on two slots: two run, three wait, and they start in order of
    arrival."""
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=2, context=CTX, prefill_chunk=16)
    try:
        runs = [Run(scheduler, prompt(6 + 3 * i, 10 + i), 6) for i in range(5)]
        waiting = []
        first = Run(scheduler, prompt(4, 99), 3).when(
            1, lambda: [r.submit() for r in runs] and waiting.append(scheduler.waiting)
        )
        first.submit().wait()
        for r in runs:
            assert r.wait().tokens == alone(tiny, r.ids, 6, chunk=16).tokens
        assert waiting == [5]  # all queued behind `first`, in one go
        assert max(n for r in runs for n in r.running_seen) == 2
        starts = [r.job.started for r in runs]
        assert starts == sorted(starts)
        assert scheduler.waiting == 0 and scheduler.running == 0 and not scheduler.busy
    finally:
        scheduler.close()


def test_a_call_takes_the_next_free_slot_before_queued_jobs(tiny):
    """A call (an embedding) queued while every slot answers runs in the first slot that
    frees, before a job queued with it; its error reaches its caller; once stopped, a
    call fails at once."""
    from infer.runtime.embedding import embed
    from infer.runtime.scheduler import Call

    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=1, context=CTX, prefill_chunk=16)
    try:
        log, results, ended = [], [], threading.Event()
        later = Run(scheduler, prompt(5, 2), 3, log)

        def done(result) -> None:
            results.append(result)
            log.append(("call", None))
            ended.set()

        def vector(session) -> list[float]:
            return embed(session, prompt(9, 3), "mean")

        def queue_both() -> None:
            scheduler.call(Call(vector, done))
            later.submit()

        first = Run(scheduler, prompt(4, 1), 6, log).when(1, queue_both)
        first.submit().wait()
        later.wait()
        assert ended.wait(60)
        order = [
            kind if run is None else ("first" if run is first else "later") for kind, run in log
        ]
        assert order.index("call") < order.index("later")
        assert order.index("call") > max(i for i, o in enumerate(order) if o == "first")
        assert results[0] == embed(Session(tiny.model, CTX), prompt(9, 3), "mean")

        def fails(session):
            raise InferError("no such thing")

        ended.clear()
        scheduler.call(Call(fails, done))
        assert ended.wait(60) and isinstance(results[-1], InferError)
        scheduler.cancel_all()
        ended.clear()
        scheduler.call(Call(vector, done))
        assert ended.is_set() and "unloaded" in str(results[-1])
    finally:
        scheduler.close()


def test_a_cancelled_answer_leaves_and_frees_its_slot(tiny):
    """b is cancelled mid-answer: it ends "cancelled" with what it had, c (queued) takes
    its slot while a still decodes, and a and c answer as they would alone."""
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=2, context=CTX, prefill_chunk=8)
    try:
        log: list = []
        a = Run(scheduler, prompt(9, 1), 40, log)
        b = Run(scheduler, prompt(14, 2), 40, log)
        c = Run(scheduler, prompt(11, 3), 10, log)
        a.when(1, lambda: (b.submit(), c.submit()))
        b.when(3, b.job.cancel)
        a.submit()
        cancelled = b.wait()
        assert cancelled.finish_reason == "cancelled" and 3 <= len(cancelled.tokens) < 40
        assert cancelled.tokens == alone(tiny, b.ids, 40, chunk=8).tokens[: len(cancelled.tokens)]
        for r in (a, c):
            assert r.wait().tokens == alone(tiny, r.ids, r.max_tokens, chunk=8).tokens
        assert log.index(("text", c)) < log.index(("done", a))  # c ran beside a
        # A job cancelled while it waits leaves the queue without taking a slot.
        d = Run(scheduler, prompt(5, 4), 5)
        d.job.cancel()
        assert d.submit().wait().finish_reason == "cancelled"
    finally:
        scheduler.close()


def test_prefix_cache_takes_the_free_slot_holding_the_prefix(tiny):
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=2, context=CTX, prefill_chunk=8)
    try:
        shared = prompt(40, 7)
        first = Run(scheduler, shared, 4).submit().wait()
        assert first.cached_tokens == 0
        other = Run(scheduler, prompt(20, 8), 30)
        again = Run(scheduler, shared + [5, 6, 7], 8)
        Run(scheduler, [3], 1).when(1, lambda: (other.submit(), again.submit())).submit().wait()
        got = again.wait()
        other.wait()
        assert got.cached_tokens == len(shared)  # the slot that held `shared`
        assert scheduler.stats.prefix_hits == 1
        # The same as one session that answered `shared` first.
        session = Session(tiny.model, CTX)
        alone(tiny, shared, 4, chunk=8, session=session)
        want = alone(tiny, shared + [5, 6, 7], 8, chunk=8, session=session)
        assert want.cached_tokens == got.cached_tokens and got.tokens == want.tokens
    finally:
        scheduler.close()


def test_common_prefix_is_the_plain_count():
    from infer.runtime.session import common_prefix

    def plain(a, b, limit):
        n = 0
        while n < min(limit, len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        a = torch.randint(0, 3, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g)
        cut = int(torch.randint(0, len(a) + 1, (1,), generator=g))
        b = a[:cut].tolist() + torch.randint(0, 3, (5,), generator=g).tolist()
        limit = int(torch.randint(-1, 50, (1,), generator=g))
        assert common_prefix(a.tolist(), b, limit) == plain(a.tolist(), b, limit)


def test_a_start_another_slot_holds_is_copied(tiny):
    """A prompt's start held by another slot, busy answering, is copied from there (and
    counts as cached); the answer is the one a session that held it would give."""
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=2, context=CTX, prefill_chunk=8)
    try:
        shared = prompt(40, 7)
        Run(scheduler, shared, 4).submit().wait()
        busy = Run(scheduler, shared + [9, 9], 30)  # slot 0 again: it holds `shared`
        other = Run(scheduler, shared + [5, 6, 7], 8)  # slot 1 copies it from slot 0
        busy.when(2, other.submit).submit()
        got = other.wait()
        busy.wait()
        assert got.cached_tokens == len(shared) and scheduler.stats.shared_tokens == len(shared)
        session = Session(tiny.model, CTX)
        alone(tiny, shared, 4, chunk=8, session=session)
        want = alone(tiny, shared + [5, 6, 7], 8, chunk=8, session=session)
        assert got.tokens == want.tokens
    finally:
        scheduler.close()


@pytest.mark.parametrize("with_draft", [False, True])
def test_answers_to_one_prompt_compute_it_once(tiny, tmp_path, with_draft):
    """Three answers to one prompt arriving together (OpenAI's n): the first computes it,
    the others wait, copy all but its last token (and the draft slots theirs), and give
    the same greedy answer. Two prompts with one long start and different ends: the
    second waits for the start, then computes only its end."""
    draft = None
    if with_draft:
        make_hf_model("smollm2", tmp_path / "draft", seed=1, num_hidden_layers=1)
        draft = load_model(tmp_path / "draft", max_seq_len=CTX).model
    scheduler = Scheduler(
        tiny.model, tiny.tokenizer, parallel=3, context=CTX, prefill_chunk=8, draft=draft
    )
    try:
        same = prompt(40, 3)
        runs = [Run(scheduler, same, 10) for _ in range(3)]
        Run(scheduler, [3], 1).when(1, lambda: [r.submit() for r in runs]).submit().wait()
        answers = [r.wait() for r in runs]
        assert [a.cached_tokens for a in answers] == [0, 39, 39]
        want = alone(tiny, same, 10, chunk=8)
        assert all(a.tokens == want.tokens for a in answers)
        if with_draft:  # each draft slot holds the prompt too, copied or computed
            assert all(d.tokens[:40] == same for d in scheduler.draft_slots)

        start = prompt(40, 4)
        a, b = Run(scheduler, start + [7] * 6, 6), Run(scheduler, start + [8] * 6, 6)
        Run(scheduler, [3], 1).when(1, lambda: (a.submit(), b.submit())).submit().wait()
        got_a, got_b = a.wait(), b.wait()
        assert got_a.cached_tokens == 0 and got_b.cached_tokens == 40
        session = Session(tiny.model, CTX)
        alone(tiny, a.ids, 6, chunk=8, session=session)
        assert got_b.tokens == alone(tiny, b.ids, 6, chunk=8, session=session).tokens
    finally:
        scheduler.close()


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_a_conversation_a_slot_gave_up_comes_back_from_the_prompt_cache(tmp_path, kv_cache):
    """One slot, three conversations: the first, given up for the second, is kept in the
    prompt cache and copied back when it goes on (keys, values and the int8 cache's
    scales); the answer is the one its own session would give. Under a limit that holds
    one conversation, the oldest goes."""
    make_hf_model("smollm2", tmp_path / "m")
    lm = load_model(tmp_path / "m", max_seq_len=CTX, kv_cache=kv_cache)
    per_token = sum(t[:, :, :1].nbytes for layer in Session(lm.model, CTX).prefix_state(1)
                    for t in layer.values())  # fmt: skip
    scheduler = Scheduler(lm.model, lm.tokenizer, parallel=1, context=CTX, prefill_chunk=8,
                          cache_bytes=per_token * 60)  # fmt: skip
    try:
        first = prompt(40, 20)
        a = Run(scheduler, first, 6).submit().wait()
        Run(scheduler, prompt(30, 21), 4).submit().wait()  # the slot gives `first` up
        assert scheduler.prompt_cache.nbytes == per_token * (40 + 5)  # the last token is not fed
        more = first + a.tokens + [9, 9, 9]
        got = Run(scheduler, more, 6).submit().wait()
        assert got.cached_tokens == 45 and scheduler.stats.restored_tokens == 45
        session = Session(lm.model, CTX)
        alone(lm, first, 6, chunk=8, session=session)
        assert got.tokens == alone(lm, more, 6, chunk=8, session=session).tokens
        # 60 positions' worth: the second conversation (33) was not kept beside the first
        # (45) about to come back; the first, gone on, replaces its shorter self.
        Run(scheduler, prompt(30, 22), 4).submit().wait()
        assert [len(e.tokens) for e in scheduler.prompt_cache.entries] == [len(more) + 5]
        assert Run(scheduler, prompt(30, 21), 4).submit().wait().cached_tokens == 0
        # and the third (33) pushes it out
        assert [len(e.tokens) for e in scheduler.prompt_cache.entries] == [33]
    finally:
        scheduler.close()


class Guessing(Decoding):
    """Greedy, feeding a guessed next token after the last one, as speculative decoding
    does: right on even steps, wrong on odd ones (from a known answer), so a pass keeps
    two fed tokens or one."""

    known: ClassVar[dict[tuple[int, ...], list[int]]] = {}

    def __init__(self, sampler, max_tokens, history, *args):
        super().__init__(sampler, max_tokens, history, *args)
        self.answer = self.known.get(tuple(history), [])
        self._fed: list[int] = []

    def feed(self) -> list[int]:
        n = len(self.tokens)
        self._fed = self.tokens[-1:]
        if self.remaining > 1 and n < len(self.answer):
            right = self.answer[n]
            self._fed.append(right if n % 2 == 0 else (right + 1) % 256)
        return self._fed

    def choose(self, logits: torch.Tensor) -> list[int]:
        new = []
        for j, row in enumerate(logits):
            new.append(self.sampler(row))
            if j + 1 >= len(self._fed) or new[-1] != self._fed[j + 1]:
                break
        self._fed = []
        self.tokens += new
        self.history += new
        self.remaining -= len(new)
        return new


def test_several_fed_tokens_a_pass(tiny, monkeypatch):
    """Answers whose passes feed two tokens (a guess) keep only the accepted ones in
    their slot's cache, and still equal plain greedy answers."""
    import infer.runtime.answer as answer_module

    specs = [(7, 20), (23, 13), (15, 17)]
    ids = [prompt(n, 30 + i) for i, (n, _) in enumerate(specs)]
    wants = [alone(tiny, p, m, chunk=8) for p, (_, m) in zip(ids, specs)]
    Guessing.known = {tuple(p): w.tokens for p, w in zip(ids, wants)}
    monkeypatch.setattr(answer_module, "Decoding", Guessing)
    scheduler = Scheduler(tiny.model, tiny.tokenizer, parallel=3, context=CTX, prefill_chunk=8)
    try:
        runs = [Run(scheduler, p, m) for p, (_, m) in zip(ids, specs)]
        runs[0].when(2, runs[1].submit)
        runs[1].when(1, runs[2].submit)
        runs[0].submit()
        for r, want in zip(runs, wants):
            assert r.wait().tokens == want.tokens
        assert scheduler.stats.steps < sum(m for _, m in specs) - 3  # guesses were kept
        for session in scheduler.slots:  # every slot holds exactly its prompt and answer
            r = next(r for r in runs if session.tokens[: len(r.ids)] == r.ids)
            assert session.tokens == r.ids + r.answer.tokens[:-1]
    finally:
        scheduler.close()


@pytest.mark.parametrize("kind", [None, "bf16", "int8"])
def test_kv_caches_count_in_the_estimate(tiny, kind):
    args, f32 = tiny.model.args, torch.float32
    one = kv_cache_bytes(args, f32, 64, kind)
    assert one == sum(c.nbytes for c in Session(tiny.model, 64, kv_cache=kind).cache)
    four = estimated_bytes(tiny.source, f32, 64, sessions=4, kv_cache=kind)
    assert four - estimated_bytes(tiny.source, f32, 64, sessions=1, kv_cache=kind) == 3 * one
    if kind == "int8":  # heads of 16: a float16 scale per 16 int8 values
        assert kv_cache_bytes(args, f32, 64) / one == pytest.approx(4 * 16 / 18)


def _int8_model(path, **kw):
    """A tiny model quantized to int8 (so the fused step runs), its caches int8."""
    from infer.quant.formats.recipes import get_recipe
    from infer.quant.quantize import quantize_model

    make_hf_model("smollm2", path, **kw)
    lm = load_model(path, max_seq_len=CTX, kv_cache="int8")
    quantize_model(lm.model, get_recipe("int8", n_layers=lm.model.args.n_layers))
    return lm


@pytest.mark.parametrize("with_draft", [False, True])
def test_int8_cache_batched_answers_equal_answers_alone(tmp_path, with_draft):
    """--kv-cache int8 on a quantized model (the fused step): every slot's cache, and each
    draft slot's, is int8, and answers decoded together (guesses and all) are the greedy
    answers of an int8 session alone."""
    lm = _int8_model(tmp_path / "m")
    draft = _int8_model(tmp_path / "draft", seed=1, num_hidden_layers=1) if with_draft else None
    scheduler = Scheduler(
        lm.model, lm.tokenizer, parallel=3, context=CTX, prefill_chunk=8,
        draft=draft and draft.model,
    )  # fmt: skip
    try:
        slots = scheduler.slots + scheduler.draft_slots
        assert len(slots) == (6 if with_draft else 3)
        assert all(c.kind == "int8" for s in slots for c in s.cache)
        assert scheduler.slots[0].fused is not None
        specs = [(5, 24), (19, 30), (33, 9), (12, 20)]
        runs = [Run(scheduler, prompt(n, 40 + i), m) for i, (n, m) in enumerate(specs)]
        runs[0].when(2, runs[1].submit)
        runs[1].when(3, lambda: (runs[2].submit(), runs[3].submit()))
        runs[0].submit()
        for r in runs:
            want = alone(lm, r.ids, r.max_tokens, chunk=8)  # Session(model): int8 too
            assert r.wait().tokens == want.tokens and r.answer.text == want.text
        assert scheduler.stats.batched > scheduler.stats.steps
        assert (scheduler.stats.guessed > 0) == with_draft
    finally:
        scheduler.close()


@pytest.mark.parametrize(
    "guess, kv_cache", [(None, None), ("lookup", None), ("draft", None), ("draft", "int8")]
)
def test_default_model_batched_equals_alone(smollm2_gguf, guess, kv_cache):
    """The real model (quantized kernels, the fused step): chat prompts of different
    lengths, joining and leaving, each answer equal to the answer alone; with prompt
    lookup or a draft model (here the model itself), guesses checked in the same passes
    as the other answers' tokens; on int8 caches (slots and draft slots), each answer
    equal to the answer alone on an int8 cache."""
    lm = load_model(smollm2_gguf, max_seq_len=CTX * 4, kv_cache=kv_cache)
    tok = lm.tokenizer
    system = " ".join(f"Rule {i}: answer briefly." for i in range(20))
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}],
        [{"role": "user", "content": "Count from 1 to 10."}],
        [{"role": "user", "content": "Write a haiku about rain."}],
    ]
    ids = [tok.encode_chat(m) for m in chats]
    scheduler = Scheduler(
        lm.model, tok, parallel=3, context=CTX * 4, prefill_chunk=64,
        lookup=guess == "lookup", draft=lm.model if guess == "draft" else None,
    )  # fmt: skip
    try:
        runs = [Run(scheduler, p, 12 + 4 * i) for i, p in enumerate(ids)]
        runs[0].when(2, runs[1].submit)
        runs[1].when(1, lambda: (runs[2].submit(), runs[3].submit()))
        runs[0].submit()
        for r in runs:
            session = Session(lm.model, CTX * 4)
            want = stream_answer(
                session, tok, r.ids, make_sampler(0), r.max_tokens, lambda _: None,
                prefill_chunk=64,
            )  # fmt: skip
            assert r.wait().text == want.text and r.answer.tokens == want.tokens
        if kv_cache is None:  # on int8 caches "The" and "L" (L'Étoile) start within 0.01
            assert "Paris" in runs[0].answer.text
        assert scheduler.stats.batched > scheduler.stats.steps
        # "Count from 1 to 10" copies its prompt; the model as its own draft guesses right
        assert (scheduler.stats.accepted > 0) == (guess is not None)
    finally:
        scheduler.close()


def test_default_model_prompts_arriving_together_share_a_pass(smollm2_gguf):
    """Chat prompts that arrive together while another answer decodes are prefilled in
    one pass; each answer equals the answer alone (the real model on the kernels: each
    prompt's rows take the same kernel in the shared pass as alone)."""
    lm = load_model(smollm2_gguf, max_seq_len=CTX * 4)
    tok = lm.tokenizer
    chats = ["What is the capital of France?", "Count from 1 to 10.", "Name a fruit.", "Hi!"]
    ids = [tok.encode_chat([{"role": "user", "content": c}]) for c in chats]
    scheduler = Scheduler(lm.model, tok, parallel=4, context=CTX * 4, prefill_chunk=256)
    try:
        runs = [Run(scheduler, p, 10) for p in ids]
        runs[0].when(2, lambda: [r.submit() for r in runs[1:]])
        runs[0].submit()
        for r in runs:
            want = alone(lm, r.ids, r.max_tokens, chunk=256, session=Session(lm.model, CTX * 4))
            assert r.wait().text == want.text and r.answer.tokens == want.tokens
        assert (scheduler.stats.prefills, scheduler.stats.prefilled) == (2, 4)
    finally:
        scheduler.close()
