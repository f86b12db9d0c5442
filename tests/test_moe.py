"""Mixture-of-experts architectures (runtime/model/moe.py) against transformers, from Hugging Face
safetensors, GGUF (stacked expert tensors) and our own format (one unit per expert)."""

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from tiny import MOE_ARCHS, make_hf_model, random_blocks

from infer import InferError
from infer.quant.formats.base import QuantLinear
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.files.build import build
from infer.runtime.files.checkpoint import read_checkpoint
from infer.runtime.files.gguf import GGUFFile
from infer.runtime.files.gguf_tensor import dequantize
from infer.runtime.files.sources import open_source
from infer.runtime.loader import load_model
from infer.runtime.model.config import ModelArgs
from infer.runtime.model.llama import Transformer
from infer.runtime.model.moe import MoE, ResidentExperts
from infer.runtime.session import Session

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]


def moe_blocks(model: Transformer) -> dict[int, MoE]:
    return {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)}


@pytest.fixture(scope="module", params=sorted(MOE_ARCHS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = make_hf_model(request.param, path)
    ours = build(open_source(path), torch.float32, max_seq_len=64)
    return ref, ours


# ---------------------------------------------------------------------------------------
# Parity with transformers
# ---------------------------------------------------------------------------------------


@torch.inference_mode()
def test_prompt_and_token_by_token_match_transformers(pair):
    ref, ours = pair
    expected = ref(torch.tensor([PROMPT])).logits
    got = ours(torch.tensor([PROMPT]), 0, ours.new_cache(), all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    session = Session(ours)
    for pos, token in enumerate(PROMPT):  # decode: one token, its k experts only
        got = session.step(token)
        torch.testing.assert_close(got, expected[0, pos], atol=1e-4, rtol=1e-4)
    session.reset()
    got = session.prefill(PROMPT, chunk=5)
    torch.testing.assert_close(got, expected[0, -1], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_router_and_block_match_transformers(pair):
    ref, ours = pair
    blocks = moe_blocks(ours)
    assert blocks, "a MoE architecture with no MoE layer"
    torch.manual_seed(1)
    for i, block in blocks.items():
        theirs = ref.model.layers[i].mlp
        x = torch.randn(1, 48, ref.config.hidden_size)
        ids, weights = block.route(x)
        logits, their_weights, their_ids = theirs.gate(x.view(-1, x.shape[-1]))
        torch.testing.assert_close(block.probs(x), logits.float().softmax(-1))
        assert torch.equal(ids, their_ids)
        torch.testing.assert_close(weights, their_weights.float(), atol=1e-6, rtol=1e-6)
        assert ids.unique().numel() == block.n_experts  # every expert runs in the grouped path
        torch.testing.assert_close(block(x), theirs(x), atol=1e-6, rtol=1e-5)


@torch.inference_mode()
def test_decode_path_equals_grouped_path(pair):
    _, ours = pair
    torch.manual_seed(2)
    for block in moe_blocks(ours).values():
        x = torch.randn(1, 16, block.gate.in_features)
        one_by_one = torch.cat([block(x[:, t : t + 1]) for t in range(16)], dim=1)
        torch.testing.assert_close(block(x), one_by_one, atol=1e-6, rtol=1e-6)


@torch.inference_mode()
def test_sanitize_maps_transformers_in_memory_names(pair):
    """transformers 5 holds experts stacked (mlp.experts.gate_up_proj / down_proj);
    sanitize splits them into one view per expert."""
    ref, ours = pair
    sd = ref.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    with torch.device("meta"):
        model = Transformer(ours.args)
    model.load_state_dict(Transformer.sanitize(sd, ours.args), strict=True, assign=True)
    model.setup_rope(64, torch.float32)
    expected = ours(torch.tensor([PROMPT]), 0, ours.new_cache(), all_logits=True)
    torch.testing.assert_close(
        model(torch.tensor([PROMPT]), 0, model.new_cache(), all_logits=True), expected
    )


@torch.inference_mode()
def test_bfloat16_close_to_float32(pair):
    _, ours = pair
    with torch.device("meta"):
        bf16 = Transformer(ours.args)
    state = {k: v.bfloat16() for k, v in ours.state_dict().items()}
    bf16.load_state_dict(state, strict=True, assign=True)
    bf16.setup_rope(64, torch.bfloat16)
    a = ours(torch.tensor([PROMPT]), 0, ours.new_cache(), all_logits=True)
    b = bf16(torch.tensor([PROMPT]), 0, bf16.new_cache(), all_logits=True).float()
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert Session(bf16).forward([PROMPT[-1]], 0).dtype == torch.bfloat16


def test_n_params_counts_every_expert(pair):
    _, ours = pair
    assert ours.args.n_params == sum(p.numel() for p in ours.parameters())


def test_active_params_count_top_k_experts(pair):
    _, ours = pair
    a = ours.args
    unused = a.n_experts - a.n_experts_per_tok
    expert = 3 * a.dim * a.moe_hidden_dim
    assert a.n_moe_layers == len(moe_blocks(ours))
    assert a.n_active_params == a.n_params - a.n_moe_layers * unused * expert


@pytest.mark.slow
def test_info_lists_experts(tmp_path):
    make_hf_model("qwen2_moe", tmp_path)  # with a shared expert
    a = open_source(tmp_path).args
    cmd = [sys.executable, "-m", "infer.cli.main", "info", str(tmp_path)]
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert (data["experts"], data["experts_per_token"]) == (a.n_experts, a.n_experts_per_tok)
    assert data["shared_expert_intermediate_size"] == a.shared_expert_dim > 0
    assert data["active_parameters"] == a.n_active_params < data["parameters"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and f"{a.n_experts} per MoE layer" in r.stdout
    assert "shared expert" in r.stdout


# ---------------------------------------------------------------------------------------
# The provider an expert cache replaces: routed, then run once per used expert
# ---------------------------------------------------------------------------------------


class Recording(ResidentExperts):
    """Resident experts that note what the block asks of them."""

    def __init__(self, modules):
        super().__init__(modules)
        self.routed_ids, self.ran = [], []

    def routed(self, x, probs, ids, weights) -> None:
        assert not self.ran  # told before any expert runs
        self.routed_ids.append(ids)

    def run(self, e, x):
        self.ran.append(e)
        return super().run(e, x)


@torch.inference_mode()
def test_experts_are_run_once_each_through_the_provider(tmp_path):
    make_hf_model("qwen2_moe", tmp_path)
    model = build(open_source(tmp_path), torch.float32, 64)
    block = model.layers[0].mlp
    assert isinstance(block.provider, ResidentExperts) and block.provider.resident
    torch.manual_seed(3)
    for T_ in (1, 6):
        x = torch.randn(1, T_, block.gate.in_features)
        expected = block(x)
        ids, _ = block.route(x)
        resident, block.provider = block.provider, Recording(block.experts)
        try:
            got = block(x)
            rec = block.provider
        finally:
            block.provider = resident
        assert len(rec.routed_ids) == 1 and torch.equal(rec.routed_ids[0], ids)
        assert rec.ran == sorted(set(ids.flatten().tolist()))  # used ones, once, ascending
        assert torch.equal(got, expected)
    assert all(k.startswith(("gate.", "experts.", "shared_expert")) for k in block.state_dict())


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
    "norm_topk_prob": True,
}


def test_config_moe_fields():
    args = ModelArgs.from_dict(QWEN3_MOE)
    assert (args.n_experts, args.n_experts_per_tok, args.moe_hidden_dim) == (8, 2, 32)
    assert args.norm_topk_prob and args.qk_norm and not args.qk_norm_full
    assert [args.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    # transformers 5 writes num_local_experts for the same thing.
    cfg = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert ModelArgs.from_dict({**cfg, "num_local_experts": 8}) == args

    mixtral = {**QWEN3_MOE, "model_type": "mixtral", "norm_topk_prob": False}
    mixtral = ModelArgs.from_dict(mixtral)
    assert mixtral.norm_topk_prob and not mixtral.qk_norm  # Mixtral always renormalises
    olmoe = ModelArgs.from_dict({**QWEN3_MOE, "model_type": "olmoe", "clip_qkv": None})
    assert olmoe.qk_norm and olmoe.qk_norm_full
    qwen2 = ModelArgs.from_dict(
        {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48}
    )
    assert qwen2.shared_expert_dim == 48 and qwen2.attention_bias
    assert not ModelArgs.from_dict({**QWEN3_MOE, "num_experts": 0}).is_moe_layer(1)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9: must be 1 to 8"),
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
        ({"model_type": "olmoe", "clip_qkv": 8.0}, "clip_qkv"),
        ({"model_type": "qwen2_moe"}, "shared_expert_intermediate_size"),
    ],
)
def test_bad_moe_configs_are_one_line_errors(change, words):
    cfg = {k: v for k, v in {**QWEN3_MOE, **change}.items() if v is not None}
    with pytest.raises(InferError, match=words):
        ModelArgs.from_dict(cfg)


def test_recipes_quantize_experts_and_keep_routers_float():
    for name in ["int8", "int4", "lut3", "mixed", "q4_k_m"]:
        recipe = get_recipe(name, n_layers=8)
        assert recipe("layers.3.mlp.gate") is None
        assert recipe("layers.3.mlp.shared_expert_gate") is None
        for proj in ["gate_proj", "up_proj", "down_proj"]:
            expected = recipe(f"layers.4.mlp.{proj}")  # the dense MLP's projection
            assert expected is not None
            assert recipe(f"layers.4.mlp.experts.17.{proj}") == expected
            assert recipe(f"layers.4.mlp.shared_expert.{proj}") == expected
    # q4_k_m gives ffn_down more bits in llama.cpp's layers, experts' included (ffn_down_exps).
    q4_k_m = get_recipe("q4_k_m", n_layers=8)
    assert q4_k_m("layers.0.mlp.experts.3.down_proj")["format"] == "int8"
    assert q4_k_m("layers.1.mlp.experts.3.down_proj")["format"] == "int4"


# ---------------------------------------------------------------------------------------
# GGUF: stacked ffn_*_exps tensors, as llama.cpp's convert_hf_to_gguf.py writes them
# ---------------------------------------------------------------------------------------

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
# Our (HF) block names -> llama.cpp's, written out here rather than taken from the reader.
GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half rows -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_moe_gguf(ref, path: Path, qtype=None, stacked=True, extra_kv=()) -> Path:
    """A GGUF of the transformers MoE model `ref`: experts stacked per layer as
    blk.N.ffn_{gate,up,down}_exps (n_expert, rows, cols), or with stacked=False one
    blk.N.ffn_{gate,up,down}.E tensor each (older Mixtral files); in `qtype` if given
    (a K-quant, which gguf-py cannot quantize to, as random blocks).
    q/k rows permuted for arch llama; the shared expert gate a vector."""
    cfg = ref.config
    arch = GGUF_ARCH[cfg.model_type]
    tensors = {}

    def add(name, t, quantize=False):
        a = t.detach().float().numpy()
        if quantize and qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K):
            rows = random_blocks(qtype, a.size // a.shape[-1], a.shape[-1], seed=len(tensors))
            tensors[name] = (rows.reshape(*a.shape[:-1], -1), qtype)
            return
        tensors[name] = (gguf.quants.quantize(a, qtype), qtype) if quantize and qtype else a

    sd = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    add("token_embd.weight", sd.pop("embed_tokens.weight"))
    add("output_norm.weight", sd.pop("norm.weight"))
    add("output.weight", sd.pop("lm_head.weight"))
    for key, t in sd.items():
        _, i, rest = key.split(".", 2)
        module, _, kind = rest.rpartition(".")
        if module == "mlp.experts":  # gate_up_proj (E, 2I, H) / down_proj (E, H, I)
            parts = t.chunk(2, dim=1) if kind == "gate_up_proj" else (t,)
            for proj, w in zip(("gate", "up") if len(parts) == 2 else ("down",), parts):
                if stacked:
                    add(f"blk.{i}.ffn_{proj}_exps.weight", w, quantize=True)
                else:
                    for e, we in enumerate(w):
                        add(f"blk.{i}.ffn_{proj}.{e}.weight", we, quantize=True)
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            n_head = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
            t = torch.from_numpy(llama_permute(t.numpy(), n_head))
        if module == "mlp.shared_expert_gate":
            t = t.reshape(-1)
        add(f"blk.{i}.{GGUF_BLOCK[module]}.{kind}", t)

    w = gguf.GGUFWriter(path, arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    for adder, key, value in [
        ("add_uint32", "block_count", cfg.num_hidden_layers),
        ("add_uint32", "context_length", cfg.max_position_embeddings),
        ("add_uint32", "embedding_length", cfg.hidden_size),
        ("add_uint32", "feed_forward_length", cfg.intermediate_size),
        ("add_uint32", "attention.head_count", cfg.num_attention_heads),
        ("add_uint32", "attention.head_count_kv", cfg.num_key_value_heads),
        ("add_uint32", "attention.key_length", head_dim),
        ("add_float32", "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps),
        ("add_float32", "rope.freq_base", cfg.rope_parameters["rope_theta"]),
        ("add_uint32", "expert_count", n_experts),
        ("add_uint32", "expert_used_count", cfg.num_experts_per_tok),
        *extra_kv,
    ]:
        getattr(w, adder)(f"{arch}.{key}", value)
    if hasattr(cfg, "moe_intermediate_size"):
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if hasattr(cfg, "shared_expert_intermediate_size"):
        w.add_uint32(
            f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size
        )
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return {
        arch: make_hf_model(arch, tmp_path_factory.mktemp(arch))
        for arch in ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_nonorm", "olmoe"]
    }


@pytest.mark.parametrize(
    ("arch", "stacked", "extra_kv"),
    [
        ("mixtral", True, ()),
        ("mixtral", False, ()),  # older Mixtral files: one tensor per expert
        ("qwen2_moe", True, ()),  # shared expert, its gate a vector; layer 1 dense
        ("qwen3_moe", True, ()),  # llama.cpp renormalises qwen3moe without being told
        ("qwen3_moe_nonorm", True, [("add_bool", "expert_weights_norm", False)]),
        ("olmoe", True, ()),
    ],
)
@torch.inference_mode()
def test_gguf_float_matches_transformers(hf_models, tmp_path, arch, stacked, extra_kv):
    ref = hf_models[arch]
    path = write_moe_gguf(ref, tmp_path / "m.gguf", stacked=stacked, extra_kv=extra_kv)
    info = open_source(path)
    cfg, args = info.config, info.args
    assert cfg["model_type"] == ref.config.model_type
    assert (args.n_experts, args.n_experts_per_tok) == (8, ref.config.num_experts_per_tok)
    assert args.norm_topk_prob == bool(getattr(ref.config, "norm_topk_prob", True))
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.model.layers]
    assert [args.is_moe_layer(i) for i in range(args.n_layers)] == sparse
    model = build(info, torch.float32, 64)
    expected = ref(torch.tensor([PROMPT])).logits
    got = model(torch.tensor([PROMPT]), 0, model.new_cache(), all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_gguf_expert_names(hf_models, tmp_path):
    f = GGUFFile(write_moe_gguf(hf_models["qwen2_moe"], tmp_path / "m.gguf"))
    assert f.hf_names("blk.2.ffn_down_exps.weight") == [
        f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(8)
    ]
    assert f.hf_names("blk.0.ffn_gate_inp.weight") == ["model.layers.0.mlp.gate.weight"]
    assert (
        f.hf_name("blk.0.ffn_up_shexp.weight") == "model.layers.0.mlp.shared_expert.up_proj.weight"
    )
    assert f.hf_name("blk.3.ffn_gate.5.weight") == "model.layers.3.mlp.experts.5.gate_proj.weight"
    with pytest.raises(InferError, match="stacks experts"):
        f.hf_name("blk.0.ffn_gate_exps.weight")
    gate = f.hf_tensor("model.layers.0.mlp.shared_expert_gate.weight")
    assert gate.shape == (1, 64) and gate.data.shape == (1, 64)


@pytest.mark.parametrize(
    ("qtype", "recipe"),
    [(T.Q8_0, ("int8", {})), (T.Q4_0, ("int4", {"symmetric": True})), (T.Q4_1, ("int4", {}))],
)
@torch.no_grad()
def test_gguf_quantized_experts_import_bit_exact(hf_models, tmp_path, qtype, recipe):
    """Each expert's rows of a quantized stacked tensor are a view of the file, and `infer
    quantize` moves their blocks into int8/int4 without requantizing."""
    path = write_moe_gguf(hf_models["olmoe"], tmp_path / "q.gguf", qtype=qtype)
    f = GGUFFile(path)
    for proj in ("gate", "up", "down"):
        stacked = f.tensors[f"blk.1.ffn_{proj}_exps.weight"]
        assert stacked.ggml_type == qtype and len(stacked.shape) == 3
        whole = gguf.quants.dequantize(stacked.data, qtype).reshape(stacked.shape)
        for e in range(8):
            t = f.hf_tensor(f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight")
            assert t.shape == stacked.shape[1:] and t.ggml_type == qtype
            assert bytes(f._map[t.offset : t.offset + t.nbytes]) == t.data.tobytes()
            assert np.array_equal(dequantize(t).numpy(), whole[e])

    model = build(open_source(path), torch.float32, 64, dequantize=True)
    name, overrides = recipe
    reports = {r.name: r for r in quantize_model(model, get_recipe(name, **overrides), gguf=f)}
    for e in range(8):
        module = f"layers.1.mlp.experts.{e}.down_proj"
        assert reports[module].imported, module
        q = model.get_submodule(module)
        source = f.hf_tensor(f"model.{module}.weight")
        assert torch.equal(q.dequantize(), dequantize(source))
    assert "layers.1.mlp.gate" not in reports  # the router stays float
    assert isinstance(model.layers[1].mlp.gate, torch.nn.Linear)

    # Loaded to run, the file's experts are those same modules, and the model computes
    # what the dequantized one does.
    native = build(open_source(path), torch.float32, 64)
    for e in range(8):
        module = f"layers.1.mlp.experts.{e}.up_proj"
        q = native.get_submodule(module)
        assert type(q) is type(model.get_submodule(module))
        assert torch.equal(q.dequantize(), model.get_submodule(module).dequantize())
    assert isinstance(native.layers[1].mlp.gate, torch.nn.Linear)
    ref = build(open_source(path), torch.float32, 64, dequantize=True)
    ids = torch.tensor([[3, 9, 14, 2, 27, 5]])
    expected = ref(ids, 0, ref.new_cache(), all_logits=True)
    got = native(ids, 0, native.new_cache(), all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
@torch.no_grad()
def test_gguf_k_quant_experts_run_on_the_kernels(tmp_path, qtype):
    """K-quant stacked experts (rows of 256) load onto the kernels one expert at a time, as
    a 2-D K-quant tensor does: their blocks as q4_k, q5_k and int6, as they are; prompt
    and token-by-token logits follow the dequantized model."""
    from infer.quant.formats.int6 import Int6Linear
    from infer.quant.formats.q4k import Q4KLinear
    from infer.quant.formats.q5k import Q5KLinear

    ref = make_hf_model("olmoe", tmp_path / "hf", hidden_size=256, intermediate_size=256)
    path = write_moe_gguf(ref, tmp_path / "k.gguf", qtype=qtype)
    f = GGUFFile(path)
    native = build(open_source(path), torch.float32, 64)
    kind = {T.Q4_K: Q4KLinear, T.Q5_K: Q5KLinear, T.Q6_K: Int6Linear}[qtype]
    for i in range(2):
        for e in range(8):
            for proj in ("gate", "up", "down"):
                module = f"layers.{i}.mlp.experts.{e}.{proj}_proj"
                q = native.get_submodule(module)
                assert type(q) is kind, module
                expected = dequantize(f.hf_tensor(f"model.{module}.weight"))
                assert torch.equal(q.dequantize(), expected), module  # the blocks as they are
        assert isinstance(native.layers[i].mlp.gate, torch.nn.Linear)  # the router stays float
    ref_model = build(open_source(path), torch.float32, 64, dequantize=True)
    ids = torch.tensor([PROMPT])
    expected = ref_model(ids, 0, ref_model.new_cache(), all_logits=True)
    scale = expected.abs().max().item()
    tol = 1e-3
    torch.testing.assert_close(
        native(ids, 0, native.new_cache(), all_logits=True), expected, atol=tol * scale, rtol=0
    )
    session = Session(native)
    for pos, token in enumerate(PROMPT):
        got = session.step(token)
        torch.testing.assert_close(got, expected[0, pos], atol=tol * scale, rtol=0)


# ---------------------------------------------------------------------------------------
# Our format: each expert one 4 KiB-aligned unit; `infer quantize` and `infer run`
# ---------------------------------------------------------------------------------------


def infer(*args):
    return subprocess.run(
        [sys.executable, "-m", "infer.cli.main", *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_moe") / "hf"
    return path, make_hf_model("qwen2_moe", path)


@pytest.mark.slow
@pytest.mark.parametrize(("to", "tolerance"), [("int8", 0.02), ("int4", 0.2)])
def test_quantize_writes_one_unit_per_expert(qwen2_moe_dir, tmp_path, to, tolerance):
    path, ref = qwen2_moe_dir
    out = tmp_path / to
    r = infer("quantize", path, "-o", out, "--to", to, "--json")
    assert r.returncode == 0, r.stderr

    ckpt = read_checkpoint(out)
    args = ckpt.args
    for i in range(args.n_layers):
        experts = [u for u in ckpt.ranges if u.startswith(f"layers.{i}.mlp.experts.")]
        if not args.is_moe_layer(i):
            assert not experts
            continue
        assert sorted(experts) == sorted(f"layers.{i}.mlp.experts.{e}" for e in range(8))
        for unit in experts:
            assert ckpt.ranges[unit][0] % 4096 == 0
            # The unit holds exactly its expert's three quantized projections.
            owners = {name.rpartition(".")[0] for name in ckpt.units[unit]}
            assert owners == {f"{unit}.{p}_proj" for p in ("gate", "up", "down")}
            assert all(ckpt.quant[o]["format"] == to for o in owners)
        # Router and shared expert gate stay float, in the layer's own unit.
        for gate in (f"layers.{i}.mlp.gate", f"layers.{i}.mlp.shared_expert_gate"):
            assert gate not in ckpt.quant
            assert f"{gate}.weight" in ckpt.units[f"layers.{i}"]

    loaded = load_model(out, max_seq_len=64)
    # Each expert's weights are its own, as close to the float ones as the format allows
    # (a misplaced expert would be off by ~140%).
    float_model = build(open_source(path), torch.float32, 64)
    for name, q in loaded.model.named_modules():
        if ".experts." in name and isinstance(q, QuantLinear):
            w = float_model.get_submodule(name).weight
            rel = (q.dequantize() - w).norm() / w.norm()
            assert rel < tolerance, (name, rel)
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits
        got = loaded.model(torch.tensor([PROMPT]), 0, loaded.model.new_cache(), all_logits=True)
    err = (got - expected).abs().max() / expected.abs().max()
    assert err < tolerance, err
    if to == "int4":
        r = infer("run", out, "hello", "-n", "4", "--temperature", "0", "--no-chat", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tokens_generated"] == 4


@pytest.mark.slow
@torch.no_grad()
def test_gptq_rounds_experts_the_calibration_never_reaches(tmp_path):
    make_hf_model("mixtral", tmp_path)
    model = build(open_source(tmp_path), torch.float32, 64)
    block = model.layers[0].mlp
    # A router that never picks expert 7: the same logits, minus 1e4 for expert 7.
    never_7 = torch.nn.Linear(model.args.dim, 8)
    never_7.weight = block.gate.weight
    never_7.bias = torch.nn.Parameter(torch.tensor([0.0] * 7 + [-1e4]))
    block.gate = never_7
    torch.manual_seed(4)
    calibration = torch.randint(0, 300, (2, 16))
    reports = {
        r.name: r for r in quantize_model(model, get_recipe("int4"), calibration=calibration)
    }
    assert all(isinstance(m, QuantLinear) for m in block.experts[7].children())
    assert all(
        reports[f"layers.0.mlp.experts.7.{p}_proj"].rel_output_error is None
        for p in ("gate", "up", "down")
    )
    gptq = [n for n, r in reports.items() if ".experts." in n and r.rel_output_error is not None]
    assert len(gptq) >= 3 * 6  # experts the calibration text did reach: GPTQ
