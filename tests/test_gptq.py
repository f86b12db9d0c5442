"""GPTQ: packing is exact, it beats round-to-nearest on layer outputs, and it is wired
through quantize_model and `infer quantize --calibrate`."""

import json
import subprocess
import sys

import pytest
import torch
from tiny import make_hf_model
from torch import nn

from infer.quant import gptq
from infer.quant.formats.base import FORMATS
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.files.build import build
from infer.runtime.files.sources import open_source
from infer.runtime.loader import load_model

BLOCK = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
SPECS = [
    ("int4", {"group_size": 32, "symmetric": True}),
    ("int4", {"group_size": 64, "symmetric": False}),
    ("lut1", {"group_size": 32}),
    ("lut2", {"group_size": 64}),
    ("lut3", {"group_size": 32}),
    ("lut4", {"group_size": 64}),
    ("int8", {"group_size": 0}),
    ("int8", {"group_size": 32}),
]


def correlated_inputs(T: int, K: int, seed: int = 0) -> torch.Tensor:
    """(T, K) inputs with correlated features and a few loud ones, as real activations."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, K, generator=g) @ torch.randn(K, K, generator=g) / K**0.5
    return X * (1 + 4 * (torch.rand(K, generator=g) > 0.9))


def hessian(X: torch.Tensor) -> torch.Tensor:
    return 2 * X.double().T @ X.double() / X.shape[0]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    dirs = {}
    for arch in ("llama", "smollm2"):  # untied and tied embeddings
        dirs[arch] = tmp_path_factory.mktemp(arch)
        make_hf_model(arch, dirs[arch])
    return dirs


# ---------------------------------------------------------------------------------------
# The algorithm and the packing
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize(("fmt", "params"), SPECS)
def test_packed_layer_dequantizes_to_the_gptq_weights(fmt, params, act_order):
    torch.manual_seed(0)
    K = 192  # a full block of 128 and a partial one; 6 groups of 32, 3 of 64
    w = torch.randn(16, K) * 0.05
    w[3, 7] = 1.0  # an outlier
    H = hessian(correlated_inputs(512, K))
    H[:, 5] = H[5, :] = 0  # an input that is always zero
    cls = FORMATS[fmt]
    p = cls.resolve_params(params)
    grid = gptq.grid_of(cls, p, K)
    r = gptq.gptq(w, H, grid, act_order=act_order)
    assert r.codes.min() >= grid.lo and r.codes.max() <= grid.hi
    assert r.d.dtype == grid.dtype and (r.m is None) == (not grid.affine)
    q = gptq.pack(cls, p, r.codes, r.d, r.m, bias=torch.ones(16))
    assert type(q) is cls and q.params == p
    assert torch.equal(q.dequantize(), r.weight)  # bit for bit
    assert torch.equal(q.dequantize(torch.tensor([3, 0])), r.weight[[3, 0]])
    assert torch.equal(q.bias, torch.ones(16))


@pytest.mark.parametrize(("fmt", "params"), SPECS)
def test_gptq_beats_rounding_on_correlated_inputs(fmt, params):
    torch.manual_seed(1)
    K = 128
    w = torch.randn(32, K) * 0.05
    X = correlated_inputs(512, K, seed=1)
    cls = FORMATS[fmt]
    rtn = cls.from_float(w, **params).dequantize()
    got = gptq.quantize_linear(cls, w, None, params, hessian(X)).dequantize()

    def err(wq):
        return (X @ (wq - w).T).norm() / (X @ w.T).norm()

    assert err(got) < 0.8 * err(rtn), (err(got), err(rtn))  # 0.59-0.72 here
    assert gptq.output_error(w, got, hessian(X)) == pytest.approx(err(got).item(), rel=1e-4)


@pytest.mark.slow
def test_calibrated_int6_takes_its_own_search(tmp_path):
    # int6 (the output layer of the recipes below 8 bits) has no GPTQ grid: with
    # calibration it is quantized as without it
    assert not gptq.supports(FORMATS["int6"]) and gptq.supports(FORMATS["lut2"])
    make_hf_model("llama", tmp_path, hidden_size=256)  # int6 rows: whole blocks of 256
    model = build(open_source(tmp_path), torch.float32, 32)
    weight = model.lm_head.weight.detach().clone()
    spec = {"format": "int6", "fallback": {"format": "int8", "group_size": 32}}
    windows = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    (report,) = quantize_model(
        model, lambda name: spec if name == "lm_head" else None, calibration=windows
    )
    want = FORMATS["int6"].from_float(weight)
    assert report.name == "lm_head" and not report.imported
    assert model.lm_head.format == "int6" and torch.equal(model.lm_head.qweight, want.qweight)


def test_calibration_windows():
    tokens = list(range(10_000))
    w = gptq.calibration_windows(tokens, 2048, ctx=512)
    assert w.shape == (4, 512)
    assert w[0, 0] == 0 and w[-1, -1] == 9_999  # spread over the whole text
    assert (w[:, 1:] - w[:, :-1] == 1).all()  # each window is consecutive text
    assert gptq.calibration_windows(tokens, 1000, ctx=512).shape == (1, 512)
    assert gptq.calibration_windows(tokens[:100], 8192, ctx=512, bos_id=7).tolist() == [
        [7, *range(1, 100)]
    ]


# ---------------------------------------------------------------------------------------
# On a model: Hessians block by block, quantize_model(calibration=)
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_layer_hessians_and_gptq_beat_rounding_on_a_model(tiny_dirs):
    """H is 2 X^T X / T of each layer's inputs (q/k/v share one), and GPTQ's output
    error on those inputs is below round-to-nearest's for every layer."""
    model = build(open_source(tiny_dirs["llama"]), torch.float32, max_seq_len=64)
    windows = torch.randint(0, 300, (4, 96), generator=torch.Generator().manual_seed(0))
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    inputs = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: inputs.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]))
        )
        for n in names
    ]
    hessians = {}
    for H in gptq.layer_hessians(model, windows, names):
        hessians.update(H)
    for h in hooks:
        h.remove()
    assert model.max_seq_len == 64 and model.rope_cos.shape[0] == 64  # caches restored
    assert set(hessians) == names  # untied lm_head included
    assert hessians["layers.1.self_attn.q_proj"] is hessians["layers.1.self_attn.v_proj"]
    assert hessians["layers.1.mlp.gate_proj"] is hessians["layers.1.mlp.up_proj"]
    # Each block ran twice: for its Hessians, then to compute the next block's inputs.
    assert len(inputs["layers.1.self_attn.q_proj"]) == 2 * len(windows)
    inputs = {n: torch.cat(x[: len(windows)]) for n, x in inputs.items()}
    torch.testing.assert_close(
        hessians["layers.1.self_attn.q_proj"],
        hessian(inputs["layers.1.self_attn.q_proj"]),
        rtol=1e-5,  # X^T X is summed in float32 per window
        atol=1e-6,
    )

    for fmt, params in [
        ("int4", {"group_size": 32, "symmetric": True}),
        ("lut2", {"group_size": 32}),
        ("lut3", {"group_size": 64}),
    ]:
        cls = FORMATS[fmt]
        # The second block (its inputs come through the first), but down_proj: its 112
        # inputs fit no group size.
        for name in [f"layers.1.{n}" for n in BLOCK[:-1]]:
            w = model.get_submodule(name).weight
            X = inputs[name]
            rtn = cls.from_float(w, **params).dequantize()
            got = gptq.quantize_linear(cls, w, None, params, hessians[name]).dequantize()
            e_rtn, e_gptq = ((X @ (q - w).T).norm() for q in (rtn, got))
            assert e_gptq < e_rtn, (fmt, name, e_gptq, e_rtn)


def logits(model, tokens) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, 0, model.new_cache(), all_logits=True).log_softmax(-1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "smollm2"])
def test_quantize_model_with_calibration(tiny_dirs, arch):
    info = open_source(tiny_dirs[arch])
    gen = torch.Generator().manual_seed(0)
    calibration = torch.randint(0, 300, (8, 128), generator=gen)
    held_out = torch.randint(0, 300, (1, 64), generator=gen)
    model = build(info, torch.float32, max_seq_len=64)
    ref = logits(model, held_out)
    kl = {}
    for cal in (None, calibration):
        model = build(info, torch.float32, max_seq_len=64)
        calls = []
        reports = quantize_model(
            model,
            get_recipe("lut2", group_size=32),
            calibration=cal,
            progress=lambda *a, calls=calls: calls.append(a),
        )
        assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.modules())
        assert model.max_seq_len == 64
        # Reports in the same order either way; progress counts every tensor once.
        assert [r.name for r in reports][:8] == [
            *(f"layers.0.{n}" for n in BLOCK),
            "layers.1.self_attn.q_proj",
        ]
        assert [c[1] for c in calls] == list(range(1, len(reports) + 1))
        calibrated = {r.name for r in reports if r.rel_output_error is not None}
        if cal is None:
            assert not calibrated
        else:
            # Every block linear (down_proj falls back to int8 per channel, by GPTQ too),
            # and the output layer when it is not the embedding table.
            expected = {f"layers.{i}.{n}" for i in range(2) for n in BLOCK}
            if not info.args.tie_embeddings:
                expected.add("lm_head")
            assert calibrated == expected
            down = next(r for r in reports if r.name == "layers.1.mlp.down_proj")
            assert down.format == "int8" and down.params == {"group_size": 0}
        got = logits(model, held_out)
        kl["gptq" if cal is not None else "rtn"] = (ref.exp() * (ref - got)).sum(-1).mean().item()
    assert kl["gptq"] < kl["rtn"], kl


@pytest.mark.slow
def test_calibration_still_imports_gguf_blocks(smollm2_gguf):
    """int4 g32 asymmetric is the default model's Q4_1: every tensor is imported as it
    is, none needs a Hessian, so no calibration pass even runs."""
    lm = load_model(smollm2_gguf, max_seq_len=32)
    reports = quantize_model(
        lm.model,
        get_recipe("int4"),
        gguf=lm.source.gguf,
        calibration=torch.zeros(1, 8, dtype=torch.long),
    )
    assert all(r.imported and r.rel_rms_error == 0 for r in reports)
    assert all(r.rel_output_error is None for r in reports)


# ---------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------


def infer(*args):
    return subprocess.run(
        [sys.executable, "-m", "infer.cli.main", *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_cli_calibrate(tiny_dirs, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)  # 1760 bytes
    out = tmp_path / "q"
    r = infer("quantize", tiny_dirs["smollm2"], "-o", out, "--to", "lut3", "-g", "32",
              "--calibrate", text, "--calib-tokens", "1024", "--json", "-t", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    # One token per byte (tests/tiny.py); windows of 256, the tiny model's context.
    assert report["calibration"] == {
        "file": str(text),
        "tokens": 1024,
        "windows": 4,
        "method": "gptq",
        "epochs": None,
    }
    by_name = {t["name"]: t for t in report["tensors"]}
    assert 0 < by_name["layers.0.mlp.up_proj"]["rel_output_error"] < 0.5
    assert by_name["lm_head"]["rel_output_error"] is None  # tied: the embedding table

    r = infer("run", out, "hello", "-n", "4", "--temperature", "0", "--no-chat", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens_generated"] == 4

    r = infer("quantize", tiny_dirs["smollm2"], "-o", out, "--to", "int4", "--force", "-v",
              "--calibrate", text, "--calib-tokens", "300", "-t", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "rel out err" in r.stdout and "GPTQ on 256 tokens" in r.stdout

    r = infer("quantize", tiny_dirs["smollm2"], "-o", tmp_path / "x", "--to", "int4",
              "--calibrate", tmp_path / "missing.txt")  # fmt: skip
    assert r.returncode == 2 and not (tmp_path / "x").exists()
