"""Speculative decoding (runtime/speculative.py, generate.Decoding with a drafter): greedy
answers equal plain decoding's on tiny random models and the real default model; sampled
tokens follow the target's distribution (the accept rule, and whole passes with
penalties); the limits hold; guessing stops when it does not pay."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from tiny import make_hf_model

from infer import InferError
from infer.runtime.answer import Answering, stream_answer
from infer.runtime.bench_speculative import run_speculative_bench
from infer.runtime.generate import Decoding, Penalties, generate, make_sampler
from infer.runtime.loader import load_model
from infer.runtime.sampling import Distribution, as_sampler
from infer.runtime.session import Session, decode
from infer.runtime.speculative import (
    Drafter,
    DraftLength,
    Guess,
    LookupDrafter,
    ModelDrafter,
    check_draft_tokenizer,
    verify,
)

TEXT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny"
    make_hf_model("llama", path, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def other_path(tmp_path_factory):
    """Another random model of the same vocabulary (a poor draft for `tiny`)."""
    path = tmp_path_factory.mktemp("spec") / "other"
    make_hf_model("qwen2", path, seed=1, hidden_size=32, num_hidden_layers=1)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(tiny_path)


@pytest.fixture(scope="module")
def other(other_path):
    return load_model(other_path)


def _prompt(lm, text=TEXT * 3):
    return lm.tokenizer.encode(text)


def _run(lm, prompt, n, drafter=None, sampler=None, penalties=None, ctx=None):
    session = Session(lm.model, ctx)
    sampler = sampler or make_sampler(0)
    return list(generate(session, prompt, sampler, n, penalties, drafter=drafter))


def _fixed(drafter: Drafter) -> Drafter:
    drafter.length = DraftLength(drafter.length.k_max, adaptive=False)
    return drafter


# ---------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_lookup_equals_plain(tiny, k):
    prompt = _prompt(tiny)
    plain = _run(tiny, prompt, 60)
    drafter = LookupDrafter(k_max=k, adaptive=False)
    assert _run(tiny, prompt, 60, drafter) == plain
    assert drafter.stats.passes > 0


def test_greedy_draft_of_itself_keeps_every_guess(tiny):
    prompt = _prompt(tiny)
    plain = _run(tiny, prompt, 40)
    drafter = ModelDrafter(tiny.model, tiny.model.args.vocab_size, k_max=4, adaptive=False)
    assert _run(tiny, prompt, 40, drafter) == plain
    s = drafter.stats
    assert s.guessed > 0 and s.accepted == s.guessed  # it guesses what the model says


def test_greedy_other_draft_equals_plain(tiny, other):
    prompt = _prompt(tiny)
    plain = _run(tiny, prompt, 40)
    drafter = ModelDrafter(other.model, tiny.model.args.vocab_size, k_max=3, adaptive=False)
    assert _run(tiny, prompt, 40, drafter) == plain
    assert drafter.stats.accepted < drafter.stats.guessed  # a random model guesses badly


def test_draft_prompt_is_prefilled_before_the_first_token(tiny, other):
    """The draft model computes the prompt with the target's prefill (its time counts
    in the time to first token, as a user waits for it), not in the first guess."""
    prompt = _prompt(tiny)
    drafter = ModelDrafter(other.model, tiny.model.args.vocab_size, k_max=3, adaptive=False)
    tokens = generate(Session(tiny.model), prompt, make_sampler(0), 8, drafter=drafter)
    next(tokens)
    assert drafter.session.tokens == prompt
    tokens.close()


def test_greedy_with_penalties_equals_plain(tiny):
    prompt = _prompt(tiny)
    penalties = Penalties(repeat=1.3, frequency=0.2, last_n=16)
    plain = _run(tiny, prompt, 50, penalties=penalties)
    for drafter in (
        LookupDrafter(k_max=5, adaptive=False),
        ModelDrafter(tiny.model, tiny.model.args.vocab_size, k_max=5, adaptive=False),
    ):
        assert _run(tiny, prompt, 50, drafter, penalties=penalties) == plain


def test_a_plain_callable_sampler_still_works(tiny):
    """generate() takes any logits -> token id callable; speculating, its choice is p."""
    prompt = _prompt(tiny)
    argmax = lambda logits: int(logits.argmax())
    assert _run(tiny, prompt, 30, LookupDrafter(adaptive=False), argmax) == _run(tiny, prompt, 30)
    chosen = as_sampler(lambda logits: 2)
    p = chosen.distribution(torch.zeros(5))
    assert verify(p, Guess(2, None), chosen) == (2, True)
    assert verify(p, Guess(3, None), chosen) == (2, False)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 20])
def test_max_tokens_hold_exactly(tiny, n):
    prompt = _prompt(tiny)
    drafter = _fixed(ModelDrafter(tiny.model, tiny.model.args.vocab_size, k_max=8))
    out = _run(tiny, prompt, n, drafter)
    assert out == _run(tiny, prompt, n) and len(out) == n


@pytest.mark.parametrize("room", [1, 2, 5, 9])
def test_the_context_is_never_overrun(tiny, room):
    prompt = _prompt(tiny)
    ctx = len(prompt) + room
    for drafter in (
        LookupDrafter(k_max=8, adaptive=False),
        ModelDrafter(tiny.model, tiny.model.args.vocab_size, ctx, k_max=8, adaptive=False),
    ):
        out = _run(tiny, prompt, 100, drafter, ctx=ctx)
        assert out == _run(tiny, prompt, 100, ctx=ctx) and len(out) == room + 1


def test_answers_with_drafters_share_passes(tiny, other):
    """Answerings stepped through one decode() pass, as the scheduler steps them, each
    with its own drafter: every answer is its plain greedy answer."""
    tok = tiny.tokenizer
    prompts = [_prompt(tiny), _prompt(tiny, "x = [1, 2, 3]\ny = [1, 2, 3]\n" * 4)]
    wants = [_run(tiny, p, 25) for p in prompts]
    vocab = tiny.model.args.vocab_size
    drafters = [LookupDrafter(k_max=4, adaptive=False), ModelDrafter(other.model, vocab)]
    drafters[1].length = DraftLength(3, adaptive=False)
    answers = [
        Answering(Session(tiny.model), tok, p, make_sampler(0), 25, lambda _: None, drafter=d)
        for p, d in zip(prompts, drafters)
    ]
    for a in answers:
        while a.prefilling:
            a.prefill()
    while running := [a for a in answers if not a.done]:
        logits = decode([a.session for a in running], [a.feed() for a in running])
        for a, rows in zip(running, logits):
            a.take(rows)
    for a, want in zip(answers, wants):  # the plain answer, up to a stop token
        stop = next((i for i, t in enumerate(want) if t in tok.stop_ids), len(want))
        assert a.answer.tokens == want[:stop]
    assert all(d.stats.guessed > 0 for d in drafters)


def test_stop_token_inside_a_kept_run_ends_the_answer(tiny):
    tok = tiny.tokenizer
    prompt = _prompt(tiny)
    plain = _run(tiny, prompt, 30)
    stop = plain[10]  # a token the answer reaches inside a run of kept guesses
    saved, tok.stop_ids = tok.stop_ids, frozenset({stop})
    try:
        drafter = _fixed(ModelDrafter(tiny.model, tiny.model.args.vocab_size, k_max=8))
        a = stream_answer(
            Session(tiny.model), tok, prompt, make_sampler(0), 30, lambda _: None, drafter=drafter
        )
    finally:
        tok.stop_ids = saved
    assert a.finish_reason == "stop" and a.tokens == plain[: plain.index(stop)]


def test_structured_output_with_guesses_equals_plain(tiny):
    from infer.runtime.structured import compile_format

    tok = tiny.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": 'Say {"a": 1} as JSON: {"a": 1}'}])
    grammar = compile_format(tok, {"type": "object", "properties": {"a": {"type": "integer"}}})

    def answer(drafter):
        return stream_answer(
            Session(tiny.model), tok, ids, make_sampler(0), 60, lambda _: None,
            constraint=grammar.matcher(), drafter=drafter,
        ).text  # fmt: skip

    assert answer(LookupDrafter(k_max=6, adaptive=False)) == answer(None)


# ---------------------------------------------------------------------------- sampling


def _chi2_bound(df: int, z: float = 4.5) -> float:
    """The chi-square quantile at a normal deviate z (Wilson-Hilferty): z 4.5 ~ p 3e-6."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    expected = n * probs
    cells = expected > 0
    assert counts[~cells].sum() == 0, "a token of probability 0 was chosen"
    stat = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    return stat, int(cells.sum()) - 1


def _dist(probs) -> Distribution:
    probs = torch.tensor(probs, dtype=torch.float64)
    return Distribution(torch.arange(len(probs)), probs / probs.sum())


@pytest.mark.parametrize(
    "p, q",
    [
        ([0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2]),  # q guesses a 0 of p
        ([0.05, 0.05, 0.9, 0.0, 0.0], [0.9, 0.05, 0.05, 0.0, 0.0]),
        ([0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]),  # p = q: always kept
        ([0.4, 0.3, 0.2, 0.1, 0.0], None),  # deterministic guesses (prompt lookup)
    ],
)
def test_accept_rule_gives_p(p, q):
    p = _dist(p)
    sampler = make_sampler(1.0, seed=0)
    guesses = torch.Generator().manual_seed(1)
    q = q and _dist(q)
    counts = torch.zeros(5)
    for i in range(3000):
        if q is None:
            guess = Guess(i % 3, None)  # any fixed guess: here 0, 1 and 2 in turn
        else:
            guess = Guess(int(torch.multinomial(q.probs, 1, generator=guesses)), q)
        token, kept = verify(p, guess, sampler)
        assert kept or token != guess.token  # a refused guess is never drawn again
        counts[token] += 1
    stat, df = _chi2(counts, p.probs)
    assert stat < _chi2_bound(df), (counts / counts.sum(), p.probs)


class _FixedDrafter(Drafter):
    """Guesses drawn from a fixed q (as a draft model's are), k of them a pass."""

    def __init__(self, q: Distribution | None, k: int, seed: int):
        super().__init__(k, adaptive=False)
        self.q = q
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, history, k, sampler):
        if self.q is None:  # deterministic guesses: always token 1
            return [Guess(1, None)] * k
        ids = torch.multinomial(self.q.probs, k, replacement=True, generator=self.generator)
        return [Guess(int(self.q.ids[i]), self.q) for i in ids]


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampled_passes_follow_the_target_with_penalties(deterministic):
    """Three tokens from one pass of two guesses and one more: their joint distribution
    is plain decoding's, each row's penalties counting the tokens kept before it."""
    vocab = 3
    logits = torch.tensor([1.0, 0.4, -0.3])  # every position's, before penalties
    penalties = Penalties(repeat=1.8, presence=0.7)
    sampler = make_sampler(1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    q = None if deterministic else _dist([0.2, 0.5, 0.3])
    drafter = _FixedDrafter(q, 2, seed=4)

    def dense(history):
        d = sampler.distribution(penalties.apply(logits, history))
        out = torch.zeros(vocab, dtype=torch.float64)
        out[d.ids] = d.probs
        return out

    exact = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    pa = dense([2])
    for a in range(vocab):
        pb = dense([2, a])
        for b in range(vocab):
            exact[a, b] = pa[a] * pb[b] * dense([2, a, b])
    counts = torch.zeros(vocab, vocab, vocab)
    for _ in range(2500):
        d = Decoding(sampler, 3, [2], penalties, drafter=drafter)
        tokens = d.choose(logits[None])
        while not d.done:
            fed = d.feed()
            tokens += d.choose(logits.expand(len(fed), vocab))
        counts[tuple(tokens)] += 1
    stat, df = _chi2(counts.flatten(), exact.flatten())
    assert stat < _chi2_bound(df)
    assert drafter.stats.accepted > 0 and drafter.stats.accepted < drafter.stats.guessed


def test_sampled_speculation_on_a_model_gives_valid_tokens(tiny, other):
    """Sampling with top-k and a draft model: tokens come only from the target's kept set
    (a smoke test; the distribution is checked above)."""
    prompt = _prompt(tiny)
    drafter = _fixed(ModelDrafter(other.model, tiny.model.args.vocab_size, k_max=4))
    out = _run(tiny, prompt, 30, drafter, make_sampler(0.9, top_k=3, seed=5))
    assert len(out) == 30 and drafter.stats.guessed > 0


# ---------------------------------------------------------------------------- drafters


def test_lookup_proposes_what_followed_the_latest_occurrence():
    d = LookupDrafter(n_max=3, k_max=8)
    greedy = make_sampler(0)
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 6, 2, 3, 4]
    d.start(history[:5])
    # "2 3 4" last occurred before the end followed by 7 8 6 2 3 4
    assert [g.token for g in d.propose(history, 4, greedy)] == [7, 8, 6, 2]
    assert [g.token for g in d.propose([*history, 6], 2, greedy)] == [2, 3]  # "4 6" no; "6"
    assert d.propose([1, 2, 3], 4, greedy) == []  # a new text: nothing before
    assert d.propose([5, 6, 7, 8], 4, greedy) == []  # nothing repeats


def test_lookup_follows_the_longest_match():
    """The text "1 2 3 4" occurred once, followed by 5 6; "2 3 4" later, followed by 9: the
    longer match is the copy being made (n_max 3 would have guessed 9)."""
    greedy = make_sampler(0)
    history = [1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 9, 8, 1, 2, 3, 4]
    assert [g.token for g in LookupDrafter().propose(history, 2, greedy)] == [5, 6]
    assert [g.token for g in LookupDrafter(n_max=3).propose(history, 2, greedy)] == [9, 8]


def test_draft_length_grows_and_shrinks():
    n = DraftLength(k_max=4)
    assert n.next() == 0  # a plain pass first, to measure what one costs
    n.record(0, 0, 0.0, 1.0)
    assert n.next() == 1
    n.record(1, 1, 0.01, 1.05)
    assert n.next() == 2
    for k in (2, 3, 4):
        n.record(k, k, 0.01 * k, 1.0 + 0.05 * k)
    assert n.next() == 4  # at most k_max
    n.record(4, 1, 0.04, 1.2)
    assert n.k == 3


@pytest.mark.parametrize("row, draft", [(1.0, 1.0), (0.9, 0.33), (1.0, 0.0), (0.1, 0.33)])
def test_guessing_pauses_when_it_does_not_pay(row, draft):
    """Every guess refused; a checked row costs `row` plain passes, a guess `draft`: over
    200 tokens the probes cost at most 5 % (row 1: today's decode, a row at a time)."""
    n = DraftLength(k_max=8)
    seconds = 0.0
    passes = []
    for _ in range(200):
        k = n.next()
        passes.append(k)
        n.record(k, 0, draft * k, 1.0 + row * k)
        seconds += 1.0 + (row + draft) * k
    assert 200 / seconds >= 0.95, passes
    assert passes[-1] == 0 and sum(1 for k in passes if k) <= 7  # the first checks' 3 too


def test_guessing_stops_for_good_where_no_acceptance_could_pay():
    """A guess costing more than a plain pass (row + draft >= 1) loses even when every
    guess is kept: after a few checks no probe comes (a draft model's would also prefill
    every token it skipped). Cheaper guesses that fail keep probing."""

    def checking_passes(row, draft, kept):
        n = DraftLength(k_max=8)
        passes = []
        for _ in range(600):
            k = n.next()
            passes.append(k)
            n.record(k, k if kept else 0, draft * k, 1.0 + row * k)
        return [i for i, k in enumerate(passes) if k]

    assert len(checking_passes(0.9, 0.33, kept=True)) <= DraftLength.MIN_CHECKS + 2
    assert checking_passes(0.1, 0.33, kept=False)[-1] > 300  # still probing late


def test_a_draft_models_probes_stay_cheap():
    """Guesses mostly kept (87 %) but not paying (a checked row 0.52 of a plain pass, a
    guess 0.42), each probe also prefilling the tokens the draft model skipped (0.07 of a
    plain pass each): the pauses grow with the probes' cost, and over 200 tokens the
    answer keeps 0.95 of plain decoding's speed (0.93 when pauses only doubled)."""
    import random

    rng = random.Random(0)
    n = DraftLength(k_max=8)
    seconds = tokens = skipped = 0
    while tokens < 200:
        k = n.next()
        if k == 0:
            n.record(0, 0, 0.0, 1.0)
            seconds, tokens, skipped = seconds + 1.0, tokens + 1, skipped + 1
            continue
        draft = 0.42 * k + 0.07 * max(0, skipped - ModelDrafter.CATCH_UP)
        kept = next((i for i in range(k) if rng.random() > 0.87), k)
        n.record(k, kept, draft, 1.0 + 0.52 * k)
        seconds, tokens, skipped = seconds + 1.0 + 0.52 * k + draft, tokens + kept + 1, 0
    assert tokens / seconds >= 0.95


def test_a_first_refused_guess_does_not_pause_guessing():
    """The answer's first guess refused (its opening words are its own), the rest kept
    (it copies): guessing goes on at once, and the length soon reaches k_max."""
    n = DraftLength(k_max=16)
    passes = []
    for i in range(40):
        k = n.next()
        passes.append(k)
        n.record(k, 0 if i == 1 else k, 0.0, 1.0 + 0.4 * k)
    assert passes[:2] == [0, 1] and 0 not in passes[2:20], passes
    assert 16 in passes[:12], passes  # as the kept share recovers from the miss


def test_guessing_goes_on_while_it_pays():
    n = DraftLength(k_max=4)
    n.record(0, 0, 0.0, 1.0)
    passes = []
    for _ in range(100):
        k = n.next()
        passes.append(k)
        n.record(k, k, 0.01 * k, 1.0 + 0.05 * k)
    assert sum(1 for k in passes if k == 0) <= 100 // DraftLength.REFRESH + 1
    assert max(passes) == 4


def test_draft_length_follows_the_measured_cost_of_each_length():
    """Checking costs that jump past 4 rows (the kernels' group), 90 % of guesses kept at
    random: the length settles at 3 guesses (4 rows), where tokens a second peak (one
    cost a row, averaged over the lengths that ran, settles at 4: 5 rows)."""
    import random

    rng = random.Random(0)
    cost = {0: 1.0, 1: 1.37, 2: 1.6, 3: 1.85, 4: 2.6, 5: 2.9, 6: 3.2, 7: 3.5, 8: 4.0}
    n = DraftLength(k_max=8)
    passes = []
    for _ in range(400):
        k = n.next()
        kept = next((i for i in range(k) if rng.random() > 0.9), k)
        n.record(k, kept, 0.0, cost[k])
        passes.append(k)
    late = [k for k in passes[200:] if k]
    assert max(set(late), key=late.count) == 3, passes


def test_a_kept_probe_brings_guessing_back():
    """Guesses refused for the first 40 passes (the answer's own words), then always
    kept (it copies): once a probe is kept guessing goes on, not into a longer pause."""
    n = DraftLength(k_max=4)
    passes = []
    for i in range(160):
        k = n.next()
        passes.append(k)
        n.record(k, 0 if i < 40 else k, 0.0, 1.0 + 0.5 * k)
    first_kept = next(i for i, k in enumerate(passes) if i >= 40 and k)
    assert first_kept < 40 + 2 * DraftLength.PAUSE, passes
    plain = passes[first_kept:].count(0)  # a plain pass every REFRESH keeps t current
    assert plain <= len(passes[first_kept:]) // DraftLength.REFRESH + 1, passes


def test_draft_tokenizer_must_match(tiny, smollm2):
    check_draft_tokenizer(tiny.tokenizer, tiny.tokenizer, "a", "b")
    with pytest.raises(InferError, match="--draft smollm2-135m: its tokenizer"):
        check_draft_tokenizer(smollm2.tokenizer, tiny.tokenizer, "smollm2-135m", "tiny")


# ---------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(smollm2_gguf, torch.float32, max_seq_len=1024)


def test_real_model_greedy_lookup_and_self_draft_equal_plain(smollm2):
    tok = smollm2.tokenizer
    ask = "Repeat this code exactly:\n\n" + TEXT
    prompt = tok.encode_chat([{"role": "user", "content": ask}])
    plain = _run(smollm2, prompt, 32)
    lookup = LookupDrafter(k_max=6, adaptive=False)
    assert _run(smollm2, prompt, 32, lookup) == plain
    assert lookup.stats.accepted > 0
    draft = ModelDrafter(smollm2.model, smollm2.model.args.vocab_size, k_max=4, adaptive=False)
    assert _run(smollm2, prompt, 32, draft) == plain
    assert draft.stats.accepted == draft.stats.guessed > 0


# ---------------------------------------------------------------------------- CLI, bench


def infer(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "INFER_DEBUG"}
    cmd = [sys.executable, "-m", "infer.cli.main", *map(str, args)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow  # three runs of the real model in subprocesses
def test_run_lookup_and_draft_answer_as_plain(smollm2_gguf):
    ask = ["run", smollm2_gguf, "Repeat this code exactly:\n\n" + TEXT, "--temp", "0", "-n", "24"]
    plain = infer(*ask, "--json")
    assert plain.returncode == 0, plain.stderr
    for flags in (["--lookup"], ["--draft", smollm2_gguf]):
        r = infer(*ask, "--json", *flags)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == json.loads(plain.stdout)["text"]
        assert out["speculation"]["passes"] + out["speculation"]["plain_passes"] > 0


def test_run_flags_fail_in_one_line(tiny_path, smollm2_gguf):
    r = infer("run", tiny_path, "hi", "--lookup", "--draft", tiny_path)
    assert r.returncode == 2 and r.stderr == "error: give --lookup or --draft, not both\n"
    r = infer("run", tiny_path, "hi", "--draft", smollm2_gguf)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error: --draft ") and "tokenizer" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_run_with_a_draft_of_the_same_vocabulary(tiny_path, other_path):
    r = infer("run", tiny_path, "abc abc abc", "--temp", "0", "-n", "12", "--no-chat", "-v")
    s = infer("run", tiny_path, "abc abc abc", "--temp", "0", "-n", "12", "--no-chat", "-v",
              "--draft", other_path)  # fmt: skip
    assert r.returncode == s.returncode == 0, s.stderr
    assert s.stdout == r.stdout
    assert "speculation: " in s.stderr


def test_speculative_bench(tiny_path, other_path):
    r = run_speculative_bench(tiny_path, lookup=True, prompt=TEXT * 2, n_gen=24, rounds=2)
    assert r.same_answer and r.rounds == 2 and r.plain_tok_s > 0 and r.speculative_tok_s > 0
    assert r.stats.passes + r.stats.plain_passes > 0
    rows = dict(r.rows())
    assert "speedup" in rows and "acceptance" in rows
    d = run_speculative_bench(tiny_path, draft=other_path, prompt=TEXT, n_gen=16, rounds=1)
    assert d.same_answer and d.drafter == "other"


def test_bench_cli_lookup_json(tiny_path, tmp_path):
    code = tmp_path / "code.py"
    code.write_text(TEXT)
    r = infer("bench", tiny_path, "--lookup", "-n", "8", "-r", "1", "--json",
              "--prompt", "Repeat:", "--prompt-file", code)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["same_answer"] and out["drafter"] == "prompt lookup"
    assert {"acceptance", "tokens_per_check"} <= set(out["stats"])
    r = infer("bench", tiny_path, "--prompt", "x")
    assert r.returncode == 2 and "--lookup or --draft" in r.stderr
