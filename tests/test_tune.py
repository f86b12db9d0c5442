"""End-to-end tuning of scales (quant/tune.py): it starts exactly at the quantized
model, moves only scales and mins, lowers the KL to the float model, and is wired
through quantize_model and `infer quantize --tune`."""

import json

import pytest
import torch
from test_gptq import SPECS, infer, tiny_dirs  # noqa: F401  (tiny_dirs: a fixture)
from tiny import assert_runs_fused

from infer.quant import tune
from infer.quant.formats.base import FORMATS, QuantLinear
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.files.build import build
from infer.runtime.files.sources import open_source
from infer.runtime.loader import load_model


@pytest.mark.parametrize(("fmt", "params"), SPECS)
def test_untrained_layer_is_the_quantized_layer(fmt, params):
    """Before any step the trainable layer computes what the format does, and packs
    back to the same tensors bit for bit; a changed scale changes only the scales."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 128, generator=g)
    w[3, :32] = 0.5  # a constant group: scale 0 in symmetric formats
    q = FORMATS[fmt].from_float(w, **params)
    t = tune._Tuned(q)
    x = torch.randn(5, 128, generator=g)
    torch.testing.assert_close(t(x), x @ q.dequantize().T, rtol=0, atol=0)
    packed = t.packed()
    assert type(packed) is type(q) and packed.params == q.params
    for name, tensor in q.tensors().items():
        assert torch.equal(packed.tensors()[name], tensor), name
    with torch.no_grad():
        t.a.fill_(0.25)
        if t.b is not None:
            t.b.fill_(-0.5)
    moved = t.packed()
    assert torch.equal(moved.tensors()["qweight"], q.tensors()["qweight"])
    s0 = q.tensors()["scales"].float()
    torch.testing.assert_close(moved.tensors()["scales"].float(), 1.25 * s0, rtol=1e-3, atol=0)
    if t.b is not None:
        want = q.tensors()["mins"].float() - 0.5 * s0.abs()
        torch.testing.assert_close(moved.tensors()["mins"].float(), want, rtol=1e-3, atol=1e-4)


def log_probs(model, windows):
    with torch.no_grad():
        return torch.cat(
            [model(w[None], 0, model.new_cache(), all_logits=True)[0] for w in windows]
        ).log_softmax(-1)


def kl_to(model, ref_logp, windows):
    logp = log_probs(model, windows)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()


def test_coarsened_kl_is_at_most_the_full_kl():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 300, generator=g) * 3, torch.randn(6, 300, generator=g) * 3
    ids = a.topk(tune.TOP_K, dim=-1).indices
    pa, pb = tune._coarsen(a, ids), tune._coarsen(b, ids)
    assert torch.allclose(pa.exp().sum(-1), torch.ones(6))
    coarse = (pa.exp() * (pa - pb)).sum(-1)
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    full = (la.exp() * (la - lb)).sum(-1)
    assert (coarse <= full + 1e-5).all() and (coarse > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_tuning_lowers_the_kl_and_moves_only_scales(tiny_dirs, arch):  # noqa: F811
    info = open_source(tiny_dirs[arch])
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 300, (8, 64), generator=gen)
    model = build(info, torch.float32, max_seq_len=64)
    ref = log_probs(model, windows)  # the full distributions, not the coarsened ones
    targets = tune.teacher_targets(model, windows)
    assert targets.ids.shape == (8, 64, tune.TOP_K) and targets.logp.shape == (8, 64, 65)
    quantize_model(model, get_recipe("lut2", group_size=32))
    before = kl_to(model, ref, windows)
    names = {n for n, m in model.named_modules() if n.startswith("layers.")
             and isinstance(m, QuantLinear)}  # fmt: skip
    frozen = {n: m.tensors() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    losses = tune.tune_scales(model, targets, names, 12, lr=0.01)
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert kl_to(model, ref, windows) < 0.8 * before
    for n, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        t = m.tensors()
        assert torch.equal(t["qweight"], frozen[n]["qweight"]), n
        assert torch.equal(t["scales"], frozen[n]["scales"]) == (n not in names), n
    # The model runs as before: its rope tables, fused decode step and kernels are back.
    assert model.max_seq_len == 64
    assert_runs_fused(model, windows[0].tolist(), tol=1e-4)


@pytest.mark.slow
def test_quantize_model_with_tuning(tiny_dirs):  # noqa: F811
    info = open_source(tiny_dirs["smollm2"])
    gen = torch.Generator().manual_seed(0)
    calibration = torch.randint(0, 300, (4, 64), generator=gen)
    model = build(info, torch.float32, max_seq_len=64)
    steps = []
    tuning = tune.Tuning(calibration, 3, progress=lambda *a: steps.append(a))
    reports = quantize_model(
        model, get_recipe("lut2", group_size=32), calibration=calibration, tuning=tuning
    )
    # The teacher's 4 windows, then 3 steps.
    assert [s[:2] for s in steps] == [(1, 4), (2, 4), (3, 4), (4, 4), (1, 3), (2, 3), (3, 3)]
    assert [s[2] is None for s in steps] == [True] * 4 + [False] * 3
    tuned = {r.name for r in reports if r.tuned}
    assert tuned == {r.name for r in reports if r.name.startswith("layers.")}
    assert "lm_head" not in tuned  # tied: the embedding table stays as quantized
    assert all(0 < r.rel_rms_error < 1 for r in reports)


def test_nothing_to_tune_when_every_layer_is_imported(smollm2_gguf):
    """int4 g32 asymmetric is the default model's Q4_1: every block layer is imported as
    it is, so the teacher never runs and nothing is tuned."""
    lm = load_model(smollm2_gguf, max_seq_len=32)
    calls = []
    tuning = tune.Tuning(
        torch.zeros(1, 8, dtype=torch.long), 2, progress=lambda *a: calls.append(a)
    )
    reports = quantize_model(
        lm.model, get_recipe("int4"), gguf=lm.source.gguf, calibration=tuning.windows, tuning=tuning
    )
    assert all(r.imported and not r.tuned for r in reports)
    assert calls == []


@pytest.mark.slow
def test_cli_tune(tiny_dirs, tmp_path):  # noqa: F811
    text = tmp_path / "calib.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)  # 1760 bytes
    out = tmp_path / "q"
    r = infer("quantize", tiny_dirs["smollm2"], "-o", out, "--to", "lut2", "-g", "32",
              "--tune", "2")  # fmt: skip
    assert r.returncode == 2 and "--calibrate" in r.stderr and not out.exists()
    r = infer("quantize", tiny_dirs["smollm2"], "-o", out, "--to", "lut2", "-g", "32",
              "--calibrate", text, "--calib-tokens", "512", "--tune", "2", "--json", "-t", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    # One token per byte: 2 steps of 4 windows of 256 (the tiny model's context) = 2048
    # tokens asked, from 1760: 6 windows, reused in turn.
    assert report["tuning"]["steps"] == 2 and report["tuning"]["tokens"] == 2048
    assert report["tuning"]["kl_first_step"] > 0
    assert sum(t["tuned"] for t in report["tensors"]) == 14
    r = infer("run", out, "hello", "-n", "4", "--temperature", "0", "--no-chat", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens_generated"] == 4
