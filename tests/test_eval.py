"""Perplexity and KL divergence (runtime/evaluate.py) and `infer eval` (cli/eval_cmd.py).

The oracle for every figure is a plain loop: one full forward over each window,
log_softmax, gather; KL from torch's own kl_div.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infer import InferError
from infer.runtime.evaluate import evaluate, make_windows, tokenize_text

CTX = 64
# ~1,650 byte tokens: 25 windows of 64 with the tiny models' one-token-per-byte tokenizer.
TEXT = (
    "The tower is 324 metres tall, about the same height as an 81-storey building, and "
    "the tallest structure in Paris. Its base is square, measuring 125 metres on each side. "
    "During its construction, the Eiffel Tower surpassed the Washington Monument to become "
    "the tallest man-made structure in the world, a title it held for 41 years. "
) * 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny random models with one vocabulary; untied, so their argmaxes differ."""
    pytest.importorskip("transformers")
    from tiny import make_hf_model

    from infer.runtime.loader import load_model

    root = tmp_path_factory.mktemp("eval")
    make_hf_model("llama", root / "a", seed=0)
    make_hf_model("llama", root / "b", seed=1)
    return {
        "paths": (root / "a", root / "b"),
        "a": load_model(root / "a", max_seq_len=CTX),
        "b": load_model(root / "b", max_seq_len=CTX),
    }


def _direct_window_logprobs(lm, ctx: int, bos: int | None = None, chunks: int | None = None):
    """The oracle: (windows, ctx - 1 - ctx/2) scored log-probs, plus the full log-softmax."""
    tokens = lm.tokenizer.encode(TEXT, add_special=False)
    if bos is not None:
        tokens = [bos, *tokens]
    n = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    first = ctx // 2
    gathered, full = [], []
    for i in range(n):
        window = tokens[i * ctx : (i + 1) * ctx]
        if bos is not None:
            window[0] = bos
        with torch.inference_mode():
            logits = lm.model(torch.tensor([window]), 0, lm.model.new_cache(), all_logits=True)[
                0
            ]  # (ctx, vocab)
        logp = torch.log_softmax(logits.double(), dim=-1)[first:-1]  # predicts first+1..ctx-1
        full.append(logp)
        gathered.append(logp.gather(1, torch.tensor(window[first + 1 :])[:, None])[:, 0])
    return torch.stack(gathered), torch.stack(full)


def _ppl_and_se(logp: torch.Tensor) -> tuple[float, float]:
    nll = -logp.flatten()
    ppl = math.exp(nll.mean())
    return ppl, ppl * float(nll.std(correction=0)) / math.sqrt(len(nll) - 1)


# ---------------------------------------------------------------------------- windows


def test_windows_bos_and_chunks():
    tokens = list(range(100, 110))  # 10 tokens
    assert make_windows(tokens, 4) == [[100, 101, 102, 103], [104, 105, 106, 107]]  # tail dropped
    assert make_windows(tokens, 4, bos_id=1) == [[1, 101, 102, 103], [1, 105, 106, 107]]
    assert make_windows(tokens, 3, chunks=2) == [[100, 101, 102], [103, 104, 105]]
    assert make_windows(tokens, 11) == []


def test_tokenize_text_adds_bos_only_when_the_tokenizer_does(tiny):
    tok = copy.copy(tiny["a"].tokenizer)
    assert tokenize_text(tok, "ab") == tok.encode("ab", add_special=False)
    tok.add_bos, tok.bos_id = True, 5
    assert tokenize_text(tok, "ab") == [5, *tok.encode("ab", add_special=False)]


# -------------------------------------------------------------------------- perplexity


def test_perplexity_matches_a_direct_computation(tiny):
    lm = tiny["a"]
    r = evaluate(lm, TEXT, ctx=CTX)
    logp, _ = _direct_window_logprobs(lm, CTX)
    ppl, se = _ppl_and_se(logp)
    assert r.windows == len(TEXT.encode()) // CTX == logp.shape[0]
    assert r.text_tokens == len(TEXT.encode())
    assert r.tokens_scored == r.windows * (CTX - 1 - CTX // 2) == logp.numel()
    assert r.model.ppl == pytest.approx(ppl, rel=1e-6)
    assert r.model.ppl_se == pytest.approx(se, rel=1e-4)
    assert r.model.nll == pytest.approx(math.log(ppl), rel=1e-6)
    assert r.model.seconds > 0 and r.model.tokens_per_s > 0
    assert r.ref is None and r.divergence is None


def test_chunks_limit_the_windows_and_progress_counts_them(tiny):
    calls = []
    r = evaluate(tiny["a"], TEXT, ctx=CTX, chunks=3, progress=lambda *a: calls.append(a))
    assert r.windows == 3 and r.tokens_scored == 3 * 31
    assert calls == [(1, 3), (2, 3), (3, 3)]
    ppl, _ = _ppl_and_se(_direct_window_logprobs(tiny["a"], CTX, chunks=3)[0])
    assert r.model.ppl == pytest.approx(ppl, rel=1e-6)


@pytest.mark.slow
def test_bos_replaces_each_windows_first_token(tiny):
    lm = tiny["a"]
    tok = copy.copy(lm.tokenizer)
    tok.add_bos, tok.bos_id = True, 1  # <|im_start|> stands in for a BOS
    with_bos = dataclasses.replace(lm, tokenizer=tok)
    r = evaluate(with_bos, TEXT, ctx=CTX, chunks=5)
    ppl, _ = _ppl_and_se(_direct_window_logprobs(lm, CTX, bos=1, chunks=5)[0])
    assert r.text_tokens == len(TEXT.encode()) + 1
    assert r.model.ppl == pytest.approx(ppl, rel=1e-6)
    assert r.model.ppl != pytest.approx(evaluate(lm, TEXT, ctx=CTX, chunks=5).model.ppl)


def test_text_shorter_than_one_window_is_an_error(tiny):
    with pytest.raises(InferError, match="fewer than one window of --ctx 64"):
        evaluate(tiny["a"], "too short", ctx=CTX)
    with pytest.raises(InferError, match="more than the model's context of 64"):
        evaluate(tiny["a"], TEXT, ctx=128)


# ------------------------------------------------------------------------ KL divergence


def test_kl_against_itself_is_zero(tiny):
    r = evaluate(tiny["a"], TEXT, ctx=CTX, chunks=4, ref=tiny["a"])
    d = r.divergence
    assert (d.kl_mean, d.kl_max, d.ppl_diff) == (0.0, 0.0, 0.0)
    assert d.top1_agreement == 100.0 and d.ppl_ratio == 1.0
    assert r.ref.ppl == r.model.ppl


@pytest.mark.slow
def test_kl_against_another_model_matches_torch(tiny):
    a, b = tiny["a"], tiny["b"]
    r = evaluate(a, TEXT, ctx=CTX, chunks=10, ref=b)
    logp_a, full_a = _direct_window_logprobs(a, CTX, chunks=10)
    logp_b, full_b = _direct_window_logprobs(b, CTX, chunks=10)
    # KL(ref || model) with ref = b: kl_div(input=model log-probs, target=ref log-probs).
    kl = F.kl_div(full_a, full_b, log_target=True, reduction="none").sum(-1).flatten()
    d = r.divergence
    assert d.kl_mean > 0
    assert d.kl_mean == pytest.approx(float(kl.mean()), rel=1e-6)
    assert d.kl_median == pytest.approx(float(np.median(kl.numpy())), rel=1e-6)
    assert d.kl_p99 == pytest.approx(float(torch.quantile(kl, 0.99)), rel=1e-6)
    assert d.kl_max == pytest.approx(float(kl.max()), rel=1e-6)
    same = full_a.argmax(-1) == full_b.argmax(-1)
    assert d.top1_agreement == pytest.approx(100 * float(same.double().mean()))
    assert 0 < d.top1_agreement < 100
    ppl_a, ppl_b = _ppl_and_se(logp_a)[0], _ppl_and_se(logp_b)[0]
    assert r.ref.ppl == pytest.approx(ppl_b, rel=1e-6)
    assert d.ppl_ratio == pytest.approx(ppl_a / ppl_b, rel=1e-6)
    assert d.ppl_diff == pytest.approx(ppl_a - ppl_b, rel=1e-5)
    assert d.kl_se > 0 and d.ppl_ratio_se > 0 and d.top1_se > 0


def test_reference_with_another_vocabulary_is_an_error(tiny):
    tok = copy.copy(tiny["b"].tokenizer)
    tok.vocab_size = 300
    other = dataclasses.replace(tiny["b"], tokenizer=tok)
    with pytest.raises(InferError, match="do not share a vocabulary"):
        evaluate(tiny["a"], TEXT, ctx=CTX, ref=other)


# -------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def cli():
    """A throwaway app with the command, registered as main.py does."""
    import typer
    from typer.testing import CliRunner

    from infer.cli.eval_cmd import eval_model

    app = typer.Typer()
    app.callback()(lambda: None)  # a group, so the command is called by its name
    app.command("eval")(eval_model)
    return lambda *args: CliRunner().invoke(app, ["eval", *map(str, args)])


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "tower.txt"
    path.write_text(TEXT)
    return path


def test_cli_json(cli, tiny, text_file):
    a, b = tiny["paths"]
    r = cli(a, "--text", text_file, "--ctx", CTX, "--chunks", 3, "--ref", b, "--json", "-t", 1)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert (data["windows"], data["ctx"], data["tokens_scored"]) == (3, CTX, 93)
    assert data["model"]["ppl"] > 1 and data["ref"]["ppl"] > 1
    assert data["divergence"]["kl_mean"] > 0
    assert data["model"]["name"] == a.name and data["ref"]["name"] == b.name
    assert data["model"]["quantization"] == "F32" and data["threads"] == 1


def test_cli_kv_cache_against_the_model_itself(cli, tiny, text_file):
    """MODEL as its own reference is MODEL with a float KV cache: with --kv-cache int8 only
    the cache differs; without, nothing does."""
    a = tiny["paths"][0]
    args = (a, "--text", text_file, "--ctx", CTX, "--chunks", 2, "--ref", a, "--json", "-t", 1)
    r = cli(*args, "--kv-cache", "int8")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kv_cache"] == "int8"
    assert 0 < data["divergence"]["kl_mean"] < 1e-3
    same = json.loads(cli(*args).stdout)
    assert same["kv_cache"] == "f32" and same["divergence"]["kl_mean"] == 0


def test_cli_table(cli, tiny, text_file):
    r = cli(tiny["paths"][0], "--text", text_file, "--ctx", CTX, "--chunks", 2, "-t", 1)
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.stdout  # plain when not a terminal
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert rows["METRIC"] == "VALUE"
    assert rows["windows"].startswith("2 x 64 (62 tokens scored)")
    assert "±" in rows["PPL"]


def test_cli_missing_text_file(cli, tiny, tmp_path):
    r = cli(tiny["paths"][0], "--text", tmp_path / "nope.txt")
    assert isinstance(r.exception, InferError) and "no such file" in str(r.exception)
    r = cli(tiny["paths"][0])
    assert r.exit_code == 2 and "--text" in r.output  # required


def test_importing_the_command_does_not_import_torch():
    code = "import sys, infer.cli.eval_cmd; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
