"""Block-AP (quant/block_ap.py): a block's layers start exactly at rounding, training
lowers the block's error and the model's KL to the float model, and it is wired through
quantize_model and `infer quantize --train-blocks`."""

import json

import pytest
import torch
from test_gptq import SPECS, infer, tiny_dirs  # noqa: F401  (tiny_dirs: a fixture)
from test_tune import kl_to, log_probs
from tiny import assert_runs_fused, make_hf_model

from infer.quant import block_ap
from infer.quant.formats.base import FORMATS, QuantLinear
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.files.build import build
from infer.runtime.files.sources import open_source
from infer.runtime.loader import load_model


@pytest.mark.parametrize(("fmt", "params"), SPECS)
def test_untrained_layer_is_the_rounded_layer(fmt, params):
    """Before any step the layer computes what the format's rounding gives, and packs
    back to its tensors bit for bit; moved weights change codes, within the grid."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 128, generator=g)
    w[3, :32] = 0.5  # a constant group: scale 0 in symmetric formats
    q = FORMATS[fmt].from_float(w, **params)
    t = block_ap.Trained(q, w)
    x = torch.randn(5, 128, generator=g)
    torch.testing.assert_close(t(x), x @ q.dequantize().T, rtol=1e-6, atol=1e-5)
    packed = t.packed()
    assert type(packed) is type(q) and packed.params == q.params
    for name, tensor in q.tensors().items():
        assert torch.equal(packed.tensors()[name], tensor), name
    with torch.no_grad():
        t.u.copy_(torch.randn(t.u.shape, generator=g) * 3)
    moved = t.packed()
    assert not torch.equal(moved.tensors()["qweight"], q.tensors()["qweight"])
    assert torch.equal(moved.tensors()["scales"], q.tensors()["scales"])
    # What it packs is what it computed.
    torch.testing.assert_close(t(x), x @ moved.dequantize().T, rtol=1e-5, atol=1e-4)


def test_gradients_reach_weights_and_scales():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    t = block_ap.Trained(FORMATS["lut2"].from_float(w, group_size=32), w)
    t(torch.randn(3, 64, generator=g)).square().sum().backward()
    assert t.u.grad.abs().sum() > 0 and t.a.grad.abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_block_training_beats_rounding(tiny_dirs, arch):  # noqa: F811
    """On the calibration windows, Block-AP's model is nearer the float model than
    plain rounding's; every block layer is trained, the model still decodes."""
    info = open_source(tiny_dirs[arch])
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 300, (4, 64), generator=gen)
    recipe = get_recipe("lut2", group_size=32)

    model = build(info, torch.float32, max_seq_len=64)
    ref = log_probs(model, windows)
    quantize_model(model, recipe)
    rounded = kl_to(model, ref, windows)

    model = build(info, torch.float32, max_seq_len=64)
    steps = []
    training = block_ap.BlockTraining(4, progress=lambda *a: steps.append(a))
    reports = quantize_model(model, recipe, calibration=windows, training=training)
    assert kl_to(model, ref, windows) < 0.7 * rounded
    n = info.args.n_layers
    # 4 epochs of 4 windows, one window a step, per block.
    assert [s[:4] for s in steps] == [(b, n, i, 16) for b in range(n) for i in range(1, 17)]
    trained = {r.name for r in reports if r.trained}
    assert trained == {r.name for r in reports if r.name.startswith("layers.")}
    assert all(r.rel_output_error is None for r in reports if r.trained)
    assert not any(r.tuned for r in reports)
    # An untied output layer, outside the blocks, takes GPTQ on the quantized model.
    head = next(r for r in reports if r.name == "lm_head")
    assert (head.rel_output_error is not None) == (arch == "llama")
    assert all(0 < r.rel_rms_error < 1 for r in reports)
    # The model runs as before: its rope tables, fused decode step and kernels are back.
    assert model.max_seq_len == 64
    assert all(isinstance(m, QuantLinear) for n, m in model.named_modules() if n.endswith("proj"))
    # Not to 1e-4: the fused step's attention differs from torch's in the last bits, and
    # the LUT kernel's int8 activation tables can round such a difference up by a step.
    assert_runs_fused(model, windows[0].tolist(), tol=1e-3)


@pytest.mark.slow
def test_block_training_of_an_moe(tmp_path):
    """Experts train inside their block; an untied output layer, outside the blocks,
    takes GPTQ."""
    make_hf_model("qwen3_moe", tmp_path)
    info = open_source(tmp_path)
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 300, (2, 32), generator=gen)
    model = build(info, torch.float32, max_seq_len=32)
    ref = log_probs(model, windows)
    untrained = {n: m.weight.clone() for n, m in model.named_modules() if n.endswith("proj")}
    reports = quantize_model(
        model,
        get_recipe("int4", group_size=32),
        calibration=windows,
        training=block_ap.BlockTraining(2),
    )
    by_name = {r.name: r for r in reports}
    assert set(untrained) == {n for n, r in by_name.items() if r.trained}
    assert any(".experts." in n for n in untrained)
    assert not info.args.tie_embeddings and 0 < by_name["lm_head"].rel_output_error < 1
    assert kl_to(model, ref, windows) < 0.1


def test_nothing_to_train_when_every_layer_is_imported(smollm2_gguf):
    """int4 g32 asymmetric is the default model's Q4_1: every block layer is imported as
    it is, so no block trains."""
    lm = load_model(smollm2_gguf, max_seq_len=32)
    calls = []
    training = block_ap.BlockTraining(1, progress=lambda *a: calls.append(a))
    reports = quantize_model(
        lm.model,
        get_recipe("int4"),
        gguf=lm.source.gguf,
        calibration=torch.zeros(1, 8, dtype=torch.long),
        training=training,
    )
    assert all(r.imported and not r.trained for r in reports)
    assert calls == []


@pytest.mark.slow
def test_cli_train_blocks(tiny_dirs, tmp_path):  # noqa: F811
    text = tmp_path / "calib.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)  # 1760 bytes
    out = tmp_path / "q"
    r = infer("quantize", tiny_dirs["smollm2"], "-o", out, "--to", "lut2", "-g", "32",
              "--train-blocks", "2")  # fmt: skip
    assert r.returncode == 2 and "--calibrate" in r.stderr and not out.exists()
    r = infer("quantize", tiny_dirs["smollm2"], "-o", out, "--to", "lut2", "-g", "32",
              "--calibrate", text, "--calib-tokens", "512", "--train-blocks", "2",
              "--tune", "1", "--json", "-t", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["calibration"]["method"] == "block-ap" and report["calibration"]["epochs"] == 2
    assert report["tuning"]["steps"] == 1
    blocks = [t for t in report["tensors"] if t["name"].startswith("layers.")]
    assert blocks and all(t["trained"] and t["tuned"] for t in blocks)
    r = infer("run", out, "hello", "-n", "4", "--temperature", "0", "--no-chat", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens_generated"] == 4
