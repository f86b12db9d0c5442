"""Recipes and quantize_model: per-module formats, end to end on tiny models, GGUF import."""

import pytest
import torch
from tiny import make_hf_model
from torch import nn

from infer import InferError
from infer.quant.formats.base import QuantEmbedding, QuantLinear
from infer.quant.formats.recipes import RECIPES, get_recipe, use_more_bits
from infer.quant.quantize import dequantize_model, quantize_model
from infer.runtime.files.build import build
from infer.runtime.files.sources import open_source
from infer.runtime.loader import load_model

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]
BLOCK = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip


def formats(recipe, n_layers=2) -> dict[str, str | None]:
    names = ["embed_tokens", "lm_head"] + [
        f"layers.{i}.{m}" for i in range(n_layers) for m in BLOCK
    ]
    return {n: (None if (s := recipe(n)) is None else s["format"]) for n in names}


# ---------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "fmt"), [("int8", "int8"), ("int4", "int4"), ("lut2", "lut2"),
                                           ("lut3", "lut3"), ("lut4", "lut4")])  # fmt: skip
def test_uniform_recipes(name, fmt):
    f = formats(get_recipe(name))
    # outside the blocks: the output layer int6 (llama.cpp's Q6_K output) below 8 bits
    assert (f.pop("embed_tokens"), f.pop("lm_head")) == (
        "int8",
        "int8" if fmt == "int8" else "int6",
    )
    assert set(f.values()) == {fmt}


def test_q4_k_recipe_falls_back_to_int4():
    """q4_k in every block linear, int4 g32 where rows are not whole blocks of 256."""
    spec = get_recipe("q4_k")("layers.0.mlp.up_proj")
    assert spec["format"] == "q4_k" and spec["fallback"]["format"] == "int4"
    assert get_recipe("q4_k")("lm_head")["format"] == "int6"
    with pytest.raises(InferError, match="q4_k: unknown parameter group_size"):
        get_recipe("q4_k", group_size=64)


def test_recipe_params_and_overrides():
    assert get_recipe("int4")("layers.0.mlp.up_proj") == {
        "format": "int4", "group_size": 32, "symmetric": False}  # fmt: skip
    spec = get_recipe("int4", group_size=64, symmetric=True)("layers.0.mlp.up_proj")
    assert spec == {"format": "int4", "group_size": 64, "symmetric": True}
    assert get_recipe("lut2", group_size=None)("layers.0.mlp.up_proj")["group_size"] == 64
    assert get_recipe("int8", group_size=0)("layers.1.self_attn.q_proj")["group_size"] == 0
    assert get_recipe("int8", group_size=0)("lm_head")["group_size"] == 0
    # Overrides change the main format only: embeddings and output keep theirs, the output
    # int6, or int8 g32 where its rows do not fit int6's blocks of 256.
    int6 = {"format": "int6", "fallback": {"format": "int8", "group_size": 32}}
    assert get_recipe("mixed", group_size=128)("lm_head") == int6
    assert get_recipe("mixed", group_size=128)("embed_tokens") == {
        "format": "int8",
        "group_size": 32,
    }


def test_recipe_errors():
    with pytest.raises(InferError, match="known: " + ", ".join(RECIPES)):
        get_recipe("q3_k_s")
    with pytest.raises(InferError, match="unknown parameter symmetric"):
        get_recipe("lut3", symmetric=True)
    with pytest.raises(InferError, match="group_size 16"):
        get_recipe("int4", group_size=16)
    for name in ("q4_k_m", "q3_k_m", "lut2_m", "lut3_m"):
        with pytest.raises(InferError, match="n_layers"):
            get_recipe(name)


def test_mixed_recipe():
    f = formats(get_recipe("mixed"))
    assert (f["embed_tokens"], f["lm_head"]) == ("int8", "int6")
    assert all(v == "int8" for k, v in f.items() if "self_attn" in k)
    assert all(v == "int4" for k, v in f.items() if ".mlp." in k)


def test_q4_k_m_promotes_llama_cpp_layers():
    # llama.cpp's use_more_bits for 32 layers: 0-3, 28-31, and 6, 9, ..., 27 between.
    promoted = [i for i in range(32) if use_more_bits(i, 32)]
    assert promoted == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    f = formats(get_recipe("q4_k_m", n_layers=32), 32)
    assert (f["embed_tokens"], f["lm_head"]) == ("int8", "int6")
    for i in range(32):
        for m in BLOCK:
            more = m in ("self_attn.v_proj", "mlp.down_proj") and i in promoted
            assert f[f"layers.{i}.{m}"] == ("int8" if more else "int4"), (i, m)


def test_q3_k_m_promotes_llama_cpp_layers():
    """llama.cpp's Q3_K_M: attn_v Q5_K in the first two layers and Q4_K after,
    attn_output Q4_K, ffn_down Q5_K in the first sixteenth and Q4_K after, the rest Q3_K;
    each K-quant falls back to int4 g32 (q5_k to int5 g32)."""
    f = formats(get_recipe("q3_k_m", n_layers=32), 32)
    assert (f["embed_tokens"], f["lm_head"]) == ("int8", "int6")
    for i in range(32):
        want = {"self_attn.v_proj": "q5_k" if i < 2 else "q4_k", "self_attn.o_proj": "q4_k",
                "mlp.down_proj": "q5_k" if i < 2 else "q4_k"}  # fmt: skip
        for m in BLOCK:
            assert f[f"layers.{i}.{m}"] == want.get(m, "q3_k"), (i, m)
    spec = get_recipe("q3_k_m", n_layers=32)("layers.5.mlp.up_proj")
    assert spec["fallback"]["format"] == "int4"
    spec = get_recipe("q3_k_m", n_layers=32)("layers.0.mlp.down_proj")
    assert spec["fallback"]["format"] == "int5"


@pytest.mark.parametrize("recipe", ["q3_k_m", "q2_k", "q5_k", "iq4_xs"])
def test_k_quant_recipes_round_trip_a_checkpoint(tmp_path, recipe):
    """A model 256 wide quantized by q3_k_m, q2_k or q5_k (their blocks where rows are
    whole blocks of 256, int4 or int5 where not), written and read back: the same logits."""
    from infer.runtime.files.checkpoint import read_checkpoint, save_checkpoint
    from infer.runtime.files.sources import CheckpointSource

    make_hf_model(
        "llama", tmp_path / "m", hidden_size=256, intermediate_size=320, num_hidden_layers=3
    )
    info = open_source(tmp_path / "m")
    model = build(info, torch.float32, max_seq_len=64)
    quantize_model(model, get_recipe(recipe, n_layers=info.args.n_layers))
    assert type(model.layers[2].self_attn.q_proj).format == recipe.removesuffix("_m")
    source = {"path": str(tmp_path / "m"), "sha256": {}, "format": "safetensors"}
    save_checkpoint(model, info.config, info.tokenizer(), tmp_path / "q", source=source)
    loaded = build(CheckpointSource(read_checkpoint(tmp_path / "q")), torch.float32, 64)
    assert type(loaded.layers[2].self_attn.q_proj) is type(model.layers[2].self_attn.q_proj)
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize(("name", "bits"), [("lut2_m", 2), ("lut3_m", 3)])
def test_lut_m_promotes_k_v_o_down_and_the_edge_layers(name, bits):
    # llama.cpp's Q2_K / Q3_K_M keep attn_v, attn_output, ffn_down one type up; we add
    # attn_k, and the first and last layer are lut4 whole.
    f = formats(get_recipe(name, n_layers=30), 30)
    assert (f.pop("embed_tokens"), f.pop("lm_head")) == ("int8", "int6")
    for i in range(30):
        for m in BLOCK:
            more = m.split(".")[1] in ("k_proj", "v_proj", "o_proj", "down_proj")
            want = 4 if i in (0, 29) else bits + more
            assert f[f"layers.{i}.{m}"] == f"lut{want}", (i, m)
    # An expert's projection is treated as the dense one of the same name.
    assert get_recipe(name, n_layers=30)("layers.5.mlp.experts.3.down_proj") == {
        "format": f"lut{bits + 1}", "group_size": 64}  # fmt: skip
    # Every block weight follows the main group size, --group-size included.
    for g in (None, 32):
        recipe = get_recipe(name, n_layers=30, group_size=g)
        sizes = {recipe(f"layers.{i}.{m}")["group_size"] for i in range(30) for m in BLOCK}
        assert sizes == {g or 64}
        assert recipe("lm_head")["format"] == "int6"


# ---------------------------------------------------------------------------------------
# quantize_model end to end
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    dirs = {}
    for arch in ("smollm2", "llama"):  # tied and untied embeddings
        dirs[arch] = tmp_path_factory.mktemp(arch)
        make_hf_model(arch, dirs[arch])
    return dirs


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([PROMPT]), 0, model.new_cache(), all_logits=True)


@pytest.mark.parametrize("arch", ["smollm2", "llama"])
@pytest.mark.parametrize(("recipe", "tol"), [("int8", 0.02), ("int4", 0.15), ("q4_k_m", 0.15)])
def test_quantize_model_end_to_end(tiny_dirs, arch, recipe, tol):
    info = open_source(tiny_dirs[arch])
    model = build(info, torch.float32, max_seq_len=64)
    ref = logits(model)
    calls = []
    reports = quantize_model(
        model, get_recipe(recipe, n_layers=info.args.n_layers), progress=lambda *a: calls.append(a)
    )
    # Every linear layer and the embedding table are quantized, nothing stays nn.Linear.
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.modules())
    tied = info.args.tie_embeddings
    assert len(reports) == 7 * info.args.n_layers + (1 if tied else 2)
    assert [c[1:] for c in calls] == [(i + 1, len(reports)) for i in range(len(reports))]
    assert [c[0] for c in calls] == [r.name for r in reports]
    for r in reports:
        assert r.bytes_after < r.bytes_before
        assert 0 < r.rel_rms_error < (0.01 if r.format == "int8" else 0.15), r
    # down_proj's rows (112) are no multiple of 32: kept as per-channel int8.
    down = next(r for r in reports if r.name == "layers.0.mlp.down_proj")
    assert down.format == "int8" and (recipe == "int8" or down.params == {"group_size": 0})

    if tied:
        assert isinstance(model.embed_tokens, QuantEmbedding)
        assert model.embed_tokens.table is model.lm_head  # one QuantLinear, stored once
        quant = {id(m) for m in model.modules() if isinstance(m, QuantLinear)}
        assert len(quant) == 7 * info.args.n_layers + 1
        assert not any(r.name == "embed_tokens" for r in reports)
    else:
        assert model.embed_tokens.table is not model.lm_head

    got = logits(model)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < tol, rel


@pytest.mark.parametrize(
    ("K", "fmt", "params"),
    [(512, "int6", {}), (576, "int8", {"group_size": 32}), (112, "int8", {"group_size": 0})],
)
def test_the_output_layer_falls_back_where_int6_does_not_fit(K, fmt, params):
    # int6 (blocks of 256), else the spec's fallback int8 g32, else (as for any spec)
    # per-channel int8
    model = nn.Module()
    model.lm_head = nn.Linear(K, 24)
    (report,) = quantize_model(model, get_recipe("int4"))
    assert (report.name, report.format, report.params) == ("lm_head", fmt, params)
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.format == fmt


def test_int6_recipe_falls_back_to_int8_g32():
    """As llama.cpp's Q6_K falls back to Q8_0: rows of 576 (the default model's q, k, v,
    o, gate, up) in int8 g32, not per-channel int8."""
    spec = get_recipe("int6")("layers.0.self_attn.q_proj")
    assert spec == {"format": "int6", "fallback": {"format": "int8", "group_size": 32}}
    model = nn.Module()
    model.q_proj, model.down_proj = nn.Linear(576, 64), nn.Linear(512, 48)
    reports = quantize_model(model, get_recipe("int6"))
    got = {r.name: (r.format, r.params) for r in reports}
    assert got == {"q_proj": ("int8", {"group_size": 32}), "down_proj": ("int6", {})}


def test_quantize_keeps_what_the_recipe_skips(tiny_dirs):
    model = build(open_source(tiny_dirs["smollm2"]), torch.float32, max_seq_len=64)
    ref = logits(model)
    only_mlp = lambda name: {"format": "lut4"} if ".mlp.gate" in name else None
    reports = quantize_model(model, only_mlp)
    assert [r.name for r in reports] == ["layers.0.mlp.gate_proj", "layers.1.mlp.gate_proj"]
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.embed_tokens, nn.Embedding)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert ((logits(model) - ref).norm() / ref.norm()) < 0.15


@pytest.mark.slow
def test_quantize_imports_gguf_blocks(smollm2_gguf):
    """The default model is Q4_1 with a Q8_0 table: int4 g32 asymmetric imports every
    tensor losslessly, so the dequantized model's logits are exactly the float model's.
    On the kernels they are within ~1e-2 (of 15-25): the prompt's GEMM keeps 15 bits of
    the activations per block of 32 where the CPU has vpdpbusd; the kernels' error is
    bounded against the reference in test_kernels_q.py."""
    lm = load_model(smollm2_gguf, max_seq_len=32, dequantize=True)
    ref = logits(lm.model)
    reports = quantize_model(lm.model, get_recipe("int4"), gguf=lm.source.gguf)
    assert len(reports) == 7 * 30 + 1
    assert all(r.imported and r.rel_rms_error == 0 and r.max_abs_error == 0 for r in reports)
    assert {(r.format, r.params["group_size"]) for r in reports} == {("int4", 32), ("int8", 32)}
    assert sum(r.bytes_after for r in reports) == sum(
        t.nbytes for t in lm.source.gguf.tensors.values() if len(t.shape) == 2
    )
    torch.testing.assert_close(logits(lm.model), ref, atol=3e-2, rtol=1e-4)
    dequantize_model(lm.model)
    assert torch.equal(logits(lm.model), ref)
