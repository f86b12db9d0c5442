"""The fused decode step (runtime/model/fused_decode.py, csrc/decode.c) against its definition,
Block.forward, on every architecture variant and every quantized format it runs."""

import pytest
import torch
from tiny import ARCHS, MOE_ARCHS, make_hf_model

from infer.kernels_cpu import ops
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import dequantize_model, quantize_model
from infer.runtime.loader import load_model
from infer.runtime.model.fused_decode import FusedDecode, cache_words
from infer.runtime.model.llama import Rows
from infer.runtime.model.moe import MoE
from infer.runtime.session import Session

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]  # 12 tokens: past a window of 8
NEXT = [41, 7, 233, 18, 90]

pytestmark = pytest.mark.skipif(not ops.available(), reason="C extension not built")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    for arch in [*ARCHS, *MOE_ARCHS]:
        make_hf_model(arch, root / arch)
    return root


def decode_logits(model, fused: bool, threads: int | None = None) -> torch.Tensor:
    """Prefill PROMPT, then decode NEXT one token at a time; the decode steps' logits."""
    session = Session(model, threads=threads)
    if fused:
        assert isinstance(session.fused, FusedDecode)
    else:
        session.fused = None  # Block.forward, the definition
    session.forward(PROMPT, 0)
    return torch.stack([session.step(t) for t in NEXT])


def fused_step(model):
    return Session(model).fused


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize(
    "recipe, overrides",
    [("int8", {}), ("int8", {"group_size": 0}), ("int4", {"symmetric": True}),
     ("int4", {"symmetric": False}), ("int5", {"symmetric": True}),
     ("int5", {"symmetric": False}), ("lut2", {"group_size": 32}), ("lut3", {}),
     ("lut2_m", {"group_size": 32})],  # lut2 q beside lut3 k, v: tables shared across bits
)  # fmt: skip
def test_fused_equals_blocks(hf_dirs, arch, recipe, overrides):
    model = load_model(hf_dirs / arch, max_seq_len=64).model
    assert fused_step(model) is None  # float linears: the blocks run
    quantize_model(model, get_recipe(recipe, n_layers=model.args.n_layers, **overrides))
    assert isinstance(fused_step(model), FusedDecode)
    ref = decode_logits(model, fused=False)
    got = decode_logits(model, fused=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_fused_runs_int6(tmp_path):
    """int6 needs rows of whole 256-weight blocks: a model that wide, every linear int6."""
    from infer.quant.formats.int6 import Int6Linear

    make_hf_model("llama", tmp_path / "m", hidden_size=256, intermediate_size=512)
    model = load_model(tmp_path / "m", max_seq_len=64).model
    quantize_model(model, get_recipe("int6"))
    linears = [m for n, m in model.named_modules() if n.endswith("proj")]
    assert linears and all(type(m) is Int6Linear for m in linears)
    assert isinstance(fused_step(model), FusedDecode)
    ref = decode_logits(model, fused=False)
    got = decode_logits(model, fused=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_fused_runs_q4_k_beside_int4(tmp_path):
    """The q4_k recipe on a model 256 wide: q4_k where rows are whole blocks of 256,
    int4 in down_proj (rows of 320), as a Q4_K_M file mixes formats; one q_gemv_many job
    runs gate and up (q4_k) and the next down (int4); logits and greedy tokens are the
    blocks'."""
    from infer.quant.formats.int4 import Int4Linear
    from infer.quant.formats.q4k import Q4KLinear

    make_hf_model("llama", tmp_path / "m", hidden_size=256, intermediate_size=320)
    model = load_model(tmp_path / "m", max_seq_len=64).model
    quantize_model(model, get_recipe("q4_k"))
    mlp = model.layers[0].mlp
    assert type(mlp.gate_proj) is Q4KLinear and type(mlp.down_proj) is Int4Linear
    assert type(model.layers[0].self_attn.k_proj) is Q4KLinear
    assert isinstance(fused_step(model), FusedDecode)
    ref = decode_logits(model, fused=False)
    got = decode_logits(model, fused=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_fused_runs_q3_k_beside_q4_k(tmp_path):
    """The q3_k_m recipe on a model 256 wide: q3_k q, k, gate and up beside q4_k o, q5_k
    v in the first two layers and q4_k after, int4 down (rows of 320), as a Q3_K_M file
    mixes them; q and k share one x, v its own (q4_k's layout of x differs); logits and
    greedy tokens are the blocks'."""
    from infer.quant.formats.q3k import Q3KLinear
    from infer.quant.formats.q4k import Q4KLinear
    from infer.quant.formats.q5k import Q5KLinear

    make_hf_model(
        "llama", tmp_path / "m", hidden_size=256, intermediate_size=320, num_hidden_layers=3
    )
    model = load_model(tmp_path / "m", max_seq_len=64).model
    quantize_model(model, get_recipe("q3_k_m", n_layers=len(model.layers)))
    first, attn = model.layers[0].self_attn, model.layers[2].self_attn
    assert type(first.v_proj) is Q5KLinear and type(first.o_proj) is Q4KLinear
    assert type(attn.q_proj) is Q3KLinear and type(attn.v_proj) is Q4KLinear
    assert type(model.layers[0].mlp.up_proj) is Q3KLinear
    assert isinstance(fused_step(model), FusedDecode)
    ref = decode_logits(model, fused=False)
    got = decode_logits(model, fused=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_fused_runs_int5_beside_int4(hf_dirs):
    """int5 k and v beside int4 q, o and MLP, as a Q5_0 / Q4_0 GGUF file loads: one
    q_gemv_many job shares x's digits across the two formats; the fused step's logits
    and greedy tokens are the blocks'."""
    from infer.quant.formats.int5 import Int5Linear

    model = load_model(hf_dirs / "qwen2", max_seq_len=64).model
    int4 = {"format": "int4", "group_size": 32, "symmetric": True}
    int5 = {"format": "int5", "symmetric": True}
    quantize_model(model, lambda name: int5 if name.endswith(("k_proj", "v_proj")) else int4)
    assert any(type(m) is Int5Linear for m in model.modules())
    ref = decode_logits(model, fused=False)
    got = decode_logits(model, fused=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))  # olmoe: q/k norms over the projection
@pytest.mark.parametrize(
    "recipe, overrides",
    [("int8", {}), ("int4", {"symmetric": True}), ("lut2_m", {"group_size": 32})],
)
def test_fused_runs_mixtures_of_experts(hf_dirs, arch, recipe, overrides):
    """MoE layers: attention in C, the block's own router in torch, the chosen experts
    (and a shared expert) in one C call, equal to Block.forward to rounding."""
    model = load_model(hf_dirs / arch, max_seq_len=64).model
    quantize_model(model, get_recipe(recipe, n_layers=model.args.n_layers, **overrides))
    step = fused_step(model)
    assert isinstance(step, FusedDecode)
    assert sorted(step._moe) == [
        i for i in range(model.args.n_layers) if model.args.is_moe_layer(i)
    ]
    ref = decode_logits(model, fused=False)
    got = decode_logits(model, fused=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_fused_moe_runs_the_blocks_pre_hooks(hf_dirs):
    """A routing recorder's forward pre-hook sees the MoE input the block computes on."""
    model = load_model(hf_dirs / "qwen2_moe", max_seq_len=64).model
    quantize_model(model, get_recipe("int8"))
    seen = {True: [], False: []}
    for fused in (True, False):
        handles = [
            layer.mlp.register_forward_pre_hook(lambda m, a, f=fused: seen[f].append(a[0].clone()))
            for layer in model.layers
            if isinstance(layer.mlp, MoE)
        ]
        try:
            decode_logits(model, fused=fused)
        finally:
            for h in handles:
                h.remove()
    assert len(seen[True]) == len(seen[False]) == 2 * (1 + len(NEXT))  # 2 MoE layers
    for a, b in zip(seen[True], seen[False]):
        torch.testing.assert_close(a.view(-1), b.view(-1), rtol=1e-4, atol=1e-4)


def test_bad_experts_are_refused(hf_dirs, monkeypatch):
    model = load_model(hf_dirs / "mixtral", max_seq_len=64).model
    quantize_model(model, get_recipe("int8"))
    session = Session(model)
    block = model.layers[0].mlp
    weights = torch.ones(1, 2)
    for ids in ([[0, block.n_experts]], [[-1, 0]]):  # an expert the layer does not have
        monkeypatch.setattr(block, "select", lambda xn, ids=ids: (torch.tensor(ids), weights))
        with pytest.raises(ValueError, match="decode_experts: bad table"):
            session.step(1)


@pytest.mark.parametrize("isa", ops.supported_isas())
@pytest.mark.parametrize("window", [None, 300])
def test_fused_attention_long_context_odd_head_dim(tmp_path, monkeypatch, isa, window):
    """Attention's 16-float vectors and blocks of 256 positions on every path: heads of
    24 (one vector and a scalar tail); 600 positions (three blocks, the last partial, so
    the blocks' partial softmaxes are weighed together), or a sliding window of 300 (two
    blocks counted from the window's start)."""
    make_hf_model(  # 4 heads of 24
        "mistral", tmp_path, hidden_size=96, sliding_window=window, max_position_embeddings=1024
    )
    model = load_model(tmp_path, max_seq_len=1024).model
    assert model.args.head_dim == 24
    quantize_model(model, get_recipe("int8", n_layers=model.args.n_layers))
    monkeypatch.setattr(ops, "_default_isa", lambda: ops.ISAS.index(isa))
    T = 600
    prompt = torch.randint(3, 320, (T,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for fused in (False, True):
        session = Session(model)
        if not fused:
            session.fused = None
        session.forward(prompt, 0)
        out[fused] = torch.stack([session.step(t) for t in NEXT])
    ref = out[False]
    torch.testing.assert_close(out[True], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize(("arch", "recipe"), [("qwen3", "int4"), ("qwen3_moe", "lut2_m")])
def test_threads_do_not_change_results(hf_dirs, arch, recipe):
    model = load_model(hf_dirs / arch, max_seq_len=64).model
    quantize_model(model, get_recipe(recipe, n_layers=model.args.n_layers))
    results = []
    for n in (1, 2, 3):
        results.append(decode_logits(model, fused=True, threads=n))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_not_used_where_it_cannot_run(hf_dirs):
    model = load_model(hf_dirs / "llama", max_seq_len=64, dtype=torch.bfloat16).model
    quantize_model(model, get_recipe("int8"))
    assert fused_step(model) is None  # bfloat16 activations: the kernels take float32
    model = load_model(hf_dirs / "llama", max_seq_len=64).model
    quantize_model(model, get_recipe("int8"))
    assert isinstance(fused_step(model), FusedDecode)
    dequantize_model(model)  # float again: no plan over float modules
    assert fused_step(model) is None
    # Only the embeddings and output quantized: the blocks' linears are float.
    model = load_model(hf_dirs / "llama", max_seq_len=64).model
    quantize_model(model, lambda name: None if name.startswith("layers.") else {
        "format": "int8", "group_size": 32})  # fmt: skip
    assert FusedDecode.prepare(model) is None


def test_bad_position_is_refused(hf_dirs):
    model = load_model(hf_dirs / "llama", max_seq_len=16).model
    quantize_model(model, get_recipe("int8"))
    x = torch.zeros(1, 1, model.args.dim)
    cache = model.new_cache()
    words = cache_words(cache).view(1, -1)
    with pytest.raises(ValueError, match="bad plan, rows"):
        fused_step(model)(x, Rows([(16, 1, cache)]), words)
