"""runtime/files/gguf.py against gguf-py: tiny files written with gguf.GGUFWriter, and the
real default model read by both our reader and gguf.GGUFReader."""

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from tiny import random_blocks

from infer import InferError
from infer.runtime.files.gguf import GGUFFile
from infer.runtime.files.gguf_tensor import GGUFTensor, dequantize
from infer.runtime.session import Session


def write_gguf(path: Path, arch: str, tensors: dict, kv=(), alignment: int | None = None) -> Path:
    """Write a GGUF file. tensors: name -> float array (stored F32/F16 by its dtype) or
    (uint8 blocks, ggml type). kv: (adder name, key, value), e.g. ("add_uint32", "k", 3)."""
    w = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for adder, key, value in kv:
        getattr(w, adder)(key, value)
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


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> GGUF rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights: GGUF rows -> HF rows."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(2, 1)
        .reshape(w.shape)
    )


# ---------------------------------------------------------------------------------------
# Dequantization is bit-exact with gguf.quants
# ---------------------------------------------------------------------------------------

QUANT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory) -> Path:
    """One tensor per type: real quantizations of Gaussian data, and random raw blocks
    (every bit pattern, including NaN/inf scales) for the block types."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    w[3] = 0.0  # an all-zero row: scale 0
    tensors = {
        "f32": w,
        "f32_1d": w[0].copy(),
        "f16": w.astype(np.float16),
        "bf16": (gguf.quants.quantize(w, T.BF16), T.BF16),
    }
    for qtype in QUANT_TYPES:
        tensors[qtype.name] = (gguf.quants.quantize(w, qtype), qtype)
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (16, 8 * type_size), dtype=np.uint8)
        tensors[qtype.name + "_raw"] = (raw, qtype)
    # Other K-quants go through gguf.quants.dequantize, Q6_K through our own (the int8
    # hold of most K-quant files' output and down layers): random bytes, 2 blocks a row.
    for qtype in (T.Q4_K, T.Q6_K):
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (4, 2 * type_size), dtype=np.uint8)
        tensors[qtype.name + "_raw"] = (raw, qtype)
    tensors["Q6_K"] = (random_blocks(T.Q6_K, 8, 512), T.Q6_K)  # sane scales
    return write_gguf(tmp_path_factory.mktemp("typed") / "typed.gguf", "llama", tensors)


def test_dequantize_bit_exact_with_gguf(typed_file):
    ours = GGUFFile(typed_file)
    reader = gguf.GGUFReader(typed_file)
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for rt in reader.tensors:
        t = ours.tensors[rt.name]
        assert t.ggml_type == rt.tensor_type
        assert t.shape == tuple(reversed(rt.shape.tolist()))
        assert t.data.tobytes() == rt.data.tobytes()
        with np.errstate(invalid="ignore"):  # random blocks hold NaN/inf scales
            ref = np.array(gguf.quants.dequantize(rt.data, rt.tensor_type)).reshape(t.shape)
        got = dequantize(t)
        assert got.dtype == torch.float32 and got.shape == t.shape
        assert np.array_equal(got.numpy(), ref, equal_nan=True), rt.name
        # Other dtypes are the float32 values rounded once.
        assert torch.equal(
            dequantize(t, torch.bfloat16).float().nan_to_num(),
            torch.from_numpy(ref).to(torch.bfloat16).float().nan_to_num(),
        ), rt.name


def test_block_layout_shapes(typed_file):
    f = GGUFFile(typed_file)
    assert f.tensors["f32"].data.dtype == np.float32 and f.tensors["f32"].data.shape == (48, 256)
    assert f.tensors["f16"].data.dtype == np.float16
    assert f.tensors["bf16"].data.dtype == np.uint16 and f.tensors["bf16"].shape == (48, 256)
    # Q4_1: 256 values per row = 8 blocks of 20 bytes.
    assert f.tensors["Q4_1"].data.shape == (48, 160) and f.tensors["Q4_1"].data.dtype == np.uint8
    assert f.tensors["Q8_0"].data.shape == (48, 272)
    raw = typed_file.read_bytes()
    for t in f.tensors.values():
        assert t.offset % f.alignment == 0
        assert raw[t.offset : t.offset + t.nbytes] == t.data.tobytes()


def test_f32_is_zero_copy(typed_file):
    f = GGUFFile(typed_file)
    t = f.tensors["f32"]
    assert dequantize(t).data_ptr() == t.data.ctypes.data
    assert (
        f.tensors["f16"].data.ctypes.data == dequantize(f.tensors["f16"], torch.float16).data_ptr()
    )


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux only")
def test_hold_only_keeps_the_held_pages_alone(tmp_path):
    """After hold_only, reading the held tensor (a weight used in place) maps its pages and
    no page of its neighbours (copied weights), though a fault may map a folio whole."""
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(300_000).astype(np.float32) for k in "abc"}  # 1.2 MB
    path = write_gguf(tmp_path / "t.gguf", "llama", tensors)
    with open(path, "rb+") as fd:  # out of the page cache: read back in large folios, if any
        os.fsync(fd.fileno())
        os.posix_fadvise(fd.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    f = GGUFFile(path)
    f.tensors["a"].data.sum(), f.tensors["c"].data.sum()  # copied at load
    held = torch.from_numpy(f.tensors["b"].data)
    f.hold_only([held])
    assert np.array_equal(held.numpy(), tensors["b"])  # read after, as a forward pass does
    page, base = 4096, f._map.ctypes.data

    def mapped(name: str) -> np.ndarray:  # whether each page wholly inside `name` is mapped
        t = f.tensors[name]
        first, end = -(-(base + t.offset) // page), (base + t.offset + t.nbytes) // page
        with open("/proc/self/pagemap", "rb") as pm:
            pm.seek(first * 8)
            entries = np.frombuffer(pm.read((end - first) * 8), dtype=np.uint64)
        return (entries >> np.uint64(63)).astype(bool)

    assert mapped("b").all() and not mapped("a").any() and not mapped("c").any()


# ---------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------


def test_metadata_value_types(tmp_path):
    kv = [
        ("add_uint8", "t.u8", 250),
        ("add_int8", "t.i8", -100),
        ("add_uint16", "t.u16", 65000),
        ("add_int16", "t.i16", -32000),
        ("add_uint32", "t.u32", 4_000_000_000),
        ("add_int32", "t.i32", -2_000_000_000),
        ("add_float32", "t.f32", 0.5),
        ("add_uint64", "t.u64", 2**63 + 5),
        ("add_int64", "t.i64", -(2**62)),
        ("add_float64", "t.f64", 0.1),
        ("add_bool", "t.bool", True),
        ("add_string", "t.str", "héllo ✓"),
        ("add_array", "t.strs", ["a", "", "Ġ t"]),
        ("add_array", "t.ints", [3, -1, 7]),
        ("add_array", "t.floats", [0.25, -1.5]),
        ("add_array", "t.bools", [True, False]),
        ("add_array", "t.nested", [[1, 2], [3], [4, 5, 6]]),
        ("add_array", "t.nested_str", [["x", "y"], ["z"]]),
    ]
    f = GGUFFile(write_gguf(tmp_path / "kv.gguf", "llama", {}, kv))
    for _, key, value in kv:
        assert f.metadata[key] == value, key
        assert type(f.metadata[key]) is type(value), key
    assert f.metadata["general.architecture"] == "llama"
    assert f.arch == "llama" and f.tensors == {} and f.version == 3


def test_type_tables_are_the_gguf_packages():
    from infer.runtime.files.ggml_types import FILE_TYPES, GGML_BLOCKS, GGMLType

    assert set(GGML_BLOCKS) == set(GGMLType)
    for t in GGMLType:
        assert T[t.name] == t and hash(T[t.name]) == hash(t)
        assert gguf.GGML_QUANT_SIZES[T[t.name]] == GGML_BLOCKS[t], t.name
    for value, name in FILE_TYPES.items():
        assert gguf.LlamaFileType(value).name == name


def test_short_float_is_numpys_shortest_float32():
    from infer.runtime.files.gguf_meta import _short_float

    rng = np.random.default_rng(0)
    values = rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 2000)
    values = [*values.astype(np.float32), np.float32(1e-5), np.float32(1e6), np.float32(0.1)]
    for x in values:
        assert _short_float(float(x)) == float(str(np.float32(x))), x
    assert _short_float(float("inf")) == float("inf") and _short_float(7) == 7


# ---------------------------------------------------------------------------------------
# The real default model, against gguf.GGUFReader
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(smollm2_gguf):
    return GGUFFile(smollm2_gguf), gguf.GGUFReader(smollm2_gguf)


@pytest.mark.slow
def test_real_model_matches_gguf_reader(real):
    ours, reader = real
    assert ours.version == 3 and ours.alignment == reader.alignment
    assert ours.data_offset == reader.data_offset
    assert ours.file_bytes == len(reader.data)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    md = ours.metadata  # decoded anew on each call
    assert list(md) == keys
    for key in keys:
        assert md[key] == reader.fields[key].contents(), key
    assert len(md["tokenizer.ggml.tokens"]) == 49152
    assert len(md["tokenizer.ggml.merges"]) == 48900
    assert md["tokenizer.chat_template"].startswith("{% for message in messages %}")

    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for rt in reader.tensors:
        t = ours.tensors[rt.name]
        assert t.ggml_type == rt.tensor_type, rt.name
        assert t.shape == tuple(reversed(rt.shape.tolist())), rt.name
        assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes, rt.name
    by_name = {rt.name: rt for rt in reader.tensors}
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"]:
        t, rt = ours.tensors[name], by_name[name]
        assert np.array_equal(t.data[:8], rt.data[:8]) and np.array_equal(t.data[-8:], rt.data[-8:])
    for name in ["blk.29.ffn_down.weight", "blk.13.attn_k.weight", "blk.7.ffn_norm.weight"]:
        assert ours.tensors[name].data.tobytes() == by_name[name].data.tobytes()


def test_real_model_config_and_unpermute(smollm2_gguf):
    f = GGUFFile(smollm2_gguf)  # not `real`: gguf-py's reader of the whole file is slow
    cfg = f.config()
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (
        576,
        1536,
        30,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in cfg

    # Un-permuted raw Q4_1 rows, permuted back the way llama.cpp does, are the file's rows.
    for name, n_head in [("q_proj", 9), ("k_proj", 3)]:
        hf = f.hf_tensor(f"model.layers.5.self_attn.{name}.weight")
        stored = f.tensors[f"blk.5.attn_{name[0]}.weight"]
        assert hf.ggml_type == T.Q4_1
        assert np.array_equal(llama_permute(hf.data, n_head), stored.data)


# ---------------------------------------------------------------------------------------
# Names, un-permuting, config on tiny llama/qwen files
# ---------------------------------------------------------------------------------------

N_HEAD, N_KV, HEAD_DIM, HIDDEN, VOCAB = 4, 2, 16, 64, 40


def tiny_model(
    path: Path, arch: str, permute: bool, extra_kv=(), qtypes=(T.F32, T.Q8_0, T.Q4_1),
    embed=T.F32, output=None,
) -> tuple[Path, dict]:  # fmt: skip
    """A 3-layer model: by default layer 0 in F32, layer 1 in Q8_0, layer 2 in Q4_1, an F32
    embedding table and no output layer (tied). Returns the file and the original
    (HF-order) float weights by GGUF name."""
    rng = np.random.default_rng(1)
    shapes = {
        "attn_q": (N_HEAD * HEAD_DIM, HIDDEN),
        "attn_k": (N_KV * HEAD_DIM, HIDDEN),
        "attn_v": (N_KV * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, N_HEAD * HEAD_DIM),
        "ffn_gate": (96, HIDDEN),
        "ffn_up": (96, HIDDEN),
        "ffn_down": (HIDDEN, 96),
    }

    def stored(w: np.ndarray, qtype: T):
        return w if qtype == T.F32 else (gguf.quants.quantize(w, qtype), qtype)

    originals = {"token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)}
    tensors = {"token_embd.weight": stored(originals["token_embd.weight"], embed)}
    if output is not None:
        originals["output.weight"] = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        tensors["output.weight"] = stored(originals["output.weight"], output)
    for i, qtype in enumerate(qtypes):
        for key in ["attn_norm", "ffn_norm"]:
            tensors[f"blk.{i}.{key}.weight"] = rng.standard_normal(HIDDEN).astype(np.float32)
        for key, shape in shapes.items():
            name = f"blk.{i}.{key}.weight"
            w = rng.standard_normal(shape).astype(np.float32)
            originals[name] = w
            if permute and key in ("attn_q", "attn_k"):
                w = llama_permute(w, N_HEAD if key == "attn_q" else N_KV)
            tensors[name] = stored(w, qtype)
        if arch == "qwen2":
            for key in ("attn_q", "attn_k", "attn_v"):
                tensors[f"blk.{i}.{key}.bias"] = rng.standard_normal(shapes[key][0]).astype(
                    np.float32
                )
    tensors["output_norm.weight"] = np.ones(HIDDEN, np.float32)
    kv = [
        ("add_uint32", f"{arch}.block_count", 3),
        ("add_uint32", f"{arch}.context_length", 256),
        ("add_uint32", f"{arch}.embedding_length", HIDDEN),
        ("add_uint32", f"{arch}.feed_forward_length", 96),
        ("add_uint32", f"{arch}.attention.head_count", N_HEAD),
        ("add_uint32", f"{arch}.attention.head_count_kv", N_KV),
        ("add_float32", f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        ("add_float32", f"{arch}.rope.freq_base", 500000.0),
        ("add_array", "tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)]),
        ("add_uint32", "tokenizer.ggml.bos_token_id", 1),
        ("add_uint32", "tokenizer.ggml.eos_token_id", 2),
        *extra_kv,
    ]
    return write_gguf(path, arch, tensors, kv), originals


def test_hf_names(tmp_path):
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "rope_freqs.weight": "rope_freqs.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.3.ffn_norm.weight": "model.layers.3.post_attention_layernorm.weight",
        "blk.12.attn_q.weight": "model.layers.12.self_attn.q_proj.weight",
        "blk.1.attn_k.bias": "model.layers.1.self_attn.k_proj.bias",
        "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
        "blk.1.attn_output.weight": "model.layers.1.self_attn.o_proj.weight",
        "blk.2.attn_q_norm.weight": "model.layers.2.self_attn.q_norm.weight",
        "blk.2.attn_k_norm.weight": "model.layers.2.self_attn.k_norm.weight",
        "blk.4.ffn_gate.weight": "model.layers.4.mlp.gate_proj.weight",
        "blk.4.ffn_up.weight": "model.layers.4.mlp.up_proj.weight",
        "blk.4.ffn_down.weight": "model.layers.4.mlp.down_proj.weight",
    }
    hf_name = GGUFFile(write_gguf(tmp_path / "n.gguf", "llama", {})).hf_name
    for gguf_name, hf in names.items():
        assert hf_name(gguf_name) == hf
    for bad in ["blk.0.attn_qkv.weight", "blk.x.attn_q.weight", "mystery.weight"]:
        with pytest.raises(InferError, match="unsupported tensor"):
            hf_name(bad)


def test_unpermute_llama(tmp_path):
    path, originals = tiny_model(tmp_path / "llama.gguf", "llama", permute=True)
    f = GGUFFile(path)
    for i, qtype in enumerate([T.F32, T.Q8_0, T.Q4_1]):
        for key, proj, n_head in [("attn_q", "q_proj", N_HEAD), ("attn_k", "k_proj", N_KV)]:
            hf = f.hf_tensor(f"model.layers.{i}.self_attn.{proj}.weight")
            stored = f.tensors[f"blk.{i}.{key}.weight"]
            original = originals[f"blk.{i}.{key}.weight"]
            assert hf.ggml_type == qtype and hf.shape == original.shape
            # Raw rows un-permuted, then dequantized == dequantized, then un-permuted.
            unpermuted = llama_unpermute(dequantize(stored).numpy(), n_head)
            assert np.array_equal(dequantize(hf).numpy(), unpermuted)
            # ... and == the original quantized in HF order: rows quantize independently.
            expected = (
                original
                if qtype == T.F32
                else gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
            )
            assert np.array_equal(dequantize(hf).numpy(), expected)
        # v is never permuted: hf_tensor hands back the stored tensor itself.
        v = f.hf_tensor(f"model.layers.{i}.self_attn.v_proj.weight")
        assert v is f.tensors[f"blk.{i}.attn_v.weight"]


def test_hf_state_dict_and_config_llama(tmp_path):
    extra = [
        ("add_uint32", "llama.attention.key_length", HEAD_DIM),
        ("add_string", "llama.rope.scaling.type", "yarn"),
        ("add_float32", "llama.rope.scaling.factor", 4.0),
        ("add_uint32", "llama.rope.scaling.original_context_length", 64),
    ]
    path, originals = tiny_model(tmp_path / "llama.gguf", "llama", permute=True, extra_kv=extra)
    f = GGUFFile(path)
    sd = f.hf_state_dict()
    assert set(sd) == {f.hf_name(n) for n in f.tensors}
    assert "lm_head.weight" not in sd
    assert torch.equal(
        sd["model.layers.0.self_attn.q_proj.weight"],
        torch.from_numpy(originals["blk.0.attn_q.weight"]),
    )
    assert torch.equal(
        sd["model.layers.0.self_attn.k_proj.weight"],
        torch.from_numpy(originals["blk.0.attn_k.weight"]),
    )
    # F32 tensors come straight from the map.
    norm = f.tensors["blk.1.attn_norm.weight"]
    assert sd["model.layers.1.input_layernorm.weight"].data_ptr() == norm.data.ctypes.data
    assert all(t.dtype == torch.float32 for t in sd.values())
    sd16 = f.hf_state_dict(torch.bfloat16)
    assert torch.equal(
        sd16["model.layers.2.mlp.up_proj.weight"],
        sd["model.layers.2.mlp.up_proj.weight"].bfloat16(),
    )

    cfg = f.config()
    assert cfg == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }


def test_qwen2_is_not_permuted(tmp_path):
    path, originals = tiny_model(tmp_path / "qwen2.gguf", "qwen2", permute=False)
    f = GGUFFile(path)
    q = f.hf_tensor("model.layers.0.self_attn.q_proj.weight")
    assert q is f.tensors["blk.0.attn_q.weight"]
    assert np.array_equal(q.data, originals["blk.0.attn_q.weight"])
    cfg = f.config()
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["attention_bias"] is True
    assert cfg["head_dim"] == HIDDEN // N_HEAD
    assert "model.layers.2.self_attn.v_proj.bias" in f.hf_state_dict()


@pytest.mark.parametrize(
    "arch, embed, output",
    [("llama", T.Q8_0, None), ("qwen2", T.F32, T.Q4_0), ("llama", T.Q4_1, T.Q8_0)],
    ids=["llama-tied-q8_0-table", "qwen2-bias-q4_0-output", "llama-q4_1-table-q8_0-output"],
)
def test_quantized_blocks_run_on_the_kernels(tmp_path, arch, embed, output):
    """Q8_0 / Q4_0 / Q4_1 weights load as int8 / int4 QuantLinears with the file's bits;
    the model computes what the dequantized one does, prompt and token by token."""
    from torch import nn

    from infer.quant.formats.int4 import Int4Linear
    from infer.quant.formats.int8 import Int8Linear
    from infer.runtime.files.build import build
    from infer.runtime.files.sources import open_source

    path, _ = tiny_model(tmp_path / "m.gguf", arch, arch == "llama", embed=embed, output=output)
    lm = build(open_source(path), torch.float32, 64)
    ref = build(open_source(path), torch.float32, 64, dequantize=True)
    kinds = [type(layer.self_attn.q_proj) for layer in lm.layers]
    assert kinds == [nn.Linear, Int8Linear, Int4Linear]
    assert all(type(m) is nn.Linear for m in ref.modules() if "Linear" in type(m).__name__)
    quantized = {n: m for n, m in lm.named_modules() if isinstance(m, (Int8Linear, Int4Linear))}
    modules = dict(ref.named_modules())
    for name, q in quantized.items():  # bit for bit the file's blocks: dequantize() equal
        float_weight = (
            modules[name].weight if name != "embed_tokens.table" else ref.embed_tokens.weight
        )
        assert torch.equal(q.dequantize(), float_weight), name
    if arch == "qwen2":
        assert torch.equal(lm.layers[2].self_attn.q_proj.bias, ref.layers[2].self_attn.q_proj.bias)
    table = getattr(lm.embed_tokens, "table", None)
    assert (table is not None) == (embed != T.F32)
    if output is None:  # tied: the one quantized table is the output layer
        assert lm.lm_head is table
    else:
        assert type(lm.lm_head) is {T.Q4_0: Int4Linear, T.Q8_0: Int8Linear}[output]
        assert lm.lm_head is not table

    ids = torch.tensor([[3, 17, 5, 22, 9, 31, 4, 11, 26, 8]])
    with torch.inference_mode():
        expected = ref(ids, 0, ref.new_cache(), all_logits=True)[0]
        prompt = lm(ids, 0, lm.new_cache(), all_logits=True)[0]
        session = Session(lm)
        steps = torch.stack([session.step(t) for t in ids[0].tolist()])
    scale = expected.abs().max()
    torch.testing.assert_close(prompt, expected, atol=1e-4 * scale, rtol=0)
    torch.testing.assert_close(steps, expected, atol=1e-4 * scale, rtol=0)

    # In bfloat16 the kernels do not apply (they take float32): everything converts.
    bf16 = build(open_source(path), torch.bfloat16, 64)
    assert not any("Quant" in type(m).__name__ for m in bf16.modules())


def test_q5_blocks_run_as_int5_in_the_fused_step(tmp_path):
    """Q5_0 / Q5_1 weights load as int5 with the file's bits (dequantize() equal to
    gguf's); the fused decode step gives the torch path's logits and greedy tokens."""
    from infer.quant.formats.int5 import Int5Linear
    from infer.runtime.files.build import build
    from infer.runtime.files.sources import open_source

    qtypes = (T.Q5_0, T.Q5_1, T.Q4_0)
    path, _ = tiny_model(tmp_path / "m.gguf", "qwen2", False, qtypes=qtypes, embed=T.Q8_0)
    lm = build(open_source(path), torch.float32, 64)
    ref = build(open_source(path), torch.float32, 64, dequantize=True)
    for i in (0, 1):
        q = lm.layers[i].mlp.down_proj
        assert type(q) is Int5Linear and q.symmetric == (i == 0)
        assert torch.equal(q.dequantize(), ref.layers[i].mlp.down_proj.weight)

    def greedy(fused: bool, n: int = 8):
        session = Session(lm)
        assert session.fused is not None
        if not fused:
            session.fused = None  # Block.forward in torch, each linear its kernel
        logits = session.prefill([3, 17, 5, 22, 9])
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = session.step(out[-1])
        return out, logits

    (tokens, last), (want, want_last) = greedy(True), greedy(False)
    assert tokens == want
    torch.testing.assert_close(last, want_last, atol=1e-4 * want_last.abs().max(), rtol=0)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_0, T.Q4_1, T.IQ4_NL, T.IQ3_S])
def test_copied_blocks_go_a_run_of_rows_at_a_time(monkeypatch, qtype):
    """A copied tensor goes a few rows at a time, each run's file pages let go once
    copied (its place in the file given), and equals the tensor copied whole."""
    from infer.runtime.files import gguf_blocks

    N, K = 7, 256
    if qtype in (T.IQ4_NL, T.IQ3_S):  # held in int8, a run at a time
        data = random_blocks(qtype, N, K)
    else:
        w = np.random.default_rng(2).standard_normal((N, K)).astype(np.float32)
        data = gguf.quants.quantize(w, qtype)
    t = GGUFTensor("w", qtype, (N, K), data, 4096)
    whole = gguf_blocks.to_kernels(t)
    monkeypatch.setattr(gguf_blocks, "ROWS_AT_ONCE", 3)
    released = []
    runs = gguf_blocks.to_kernels(t, release=lambda r: released.append((r.offset, r.shape)))
    assert torch.equal(runs.dequantize(), whole.dequantize())
    row = data.shape[1]
    assert released == [(4096 + i * row, (n, K)) for i, n in ((0, 3), (3, 3), (6, 1))]


@pytest.mark.parametrize(
    "qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL, T.IQ3_S, T.Q5_0, T.Q5_1]
)
def test_other_types_go_onto_the_kernels_closely(qtype):
    """The K-quants' blocks are int6's, q5_k's, q4_k's, q3_k's and q2_k's, IQ4_XS's
    iq4_xs's, Q5_0's and Q5_1's int5's, as they are; the other types are held in int8 g32:
    IQ4_NL exactly, the others within half an int8 step of their values."""
    from infer.quant.formats.int5 import Int5Linear
    from infer.quant.formats.int6 import Int6Linear
    from infer.quant.formats.int8 import Int8Linear
    from infer.quant.formats.iq4xs import IQ4XSLinear
    from infer.quant.formats.q2k import Q2KLinear
    from infer.quant.formats.q3k import Q3KLinear
    from infer.quant.formats.q4k import Q4KLinear
    from infer.quant.formats.q5k import Q5KLinear
    from infer.runtime.files import hugepages
    from infer.runtime.files.gguf_blocks import loaded_bytes, placed_bytes, to_kernels

    N, K = 6, 512
    if qtype in (T.Q5_0, T.Q5_1):
        w = np.random.default_rng(1).standard_normal((N, K)).astype(np.float32)
        data = gguf.quants.quantize(w, qtype)
    else:
        data = random_blocks(qtype, N, K)
    t = GGUFTensor("w", qtype, (N, K), data, 0)
    expected = dequantize(t)
    assert torch.equal(expected, torch.from_numpy(gguf.quants.dequantize(data, qtype)))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    q = to_kernels(t, bias)
    assert loaded_bytes(t) == q.nbytes  # what the auto budget counts it at
    arena = hugepages.Arena.of(placed_bytes(t))
    if arena is not None:  # the same weights, written into a huge-page arena of that size
        placed = to_kernels(t, bias, arena.empty)
        assert torch.equal(placed.dequantize(), q.dequantize())
        in_place = qtype in (T.Q6_K, T.Q5_K, T.Q4_K, T.Q3_K, T.Q2_K, T.IQ4_XS)
        held = [placed.qweight] + ([placed.scales] if hasattr(placed, "scales") else [])
        moved = not any(b.untyped_storage().resizable() for b in held)
        assert moved == (not in_place)  # the K-quants' blocks stay where they are
    err = (q.dequantize() - expected).abs()
    if qtype not in (T.IQ4_NL, T.IQ3_S):
        kinds = {T.Q6_K: Int6Linear, T.Q5_K: Q5KLinear, T.Q4_K: Q4KLinear, T.Q3_K: Q3KLinear,
                 T.Q2_K: Q2KLinear, T.IQ4_XS: IQ4XSLinear}  # fmt: skip
        kind = kinds.get(qtype, Int5Linear)
        assert type(q) is kind
        assert torch.equal(q.dequantize(), expected)
        assert q.nbytes == t.nbytes
    else:
        assert type(q) is Int8Linear and q.group_size == 32
        step = q.scales.float().repeat_interleave(32, 1)
        assert (err <= step / 2 * (1 + 1e-3)).all()
        if qtype == T.IQ4_NL:  # its levels are int8 values: exactly
            assert torch.equal(q.dequantize(), expected)
    # The kernel computes with the module's own weights (their distance from the file's
    # is bounded above).
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))
    y = x @ q.dequantize().T + bias
    torch.testing.assert_close(q(x), y, atol=1e-4 * y.abs().max().item(), rtol=0)


def test_q4_k_loads_as_a_view_of_the_file(tmp_path):
    """A Q4_K tensor (attn_q: rows un-permuted) loads as q4_k, its bytes as they are:
    dequantized, gguf's values; `infer quantize --to q4_k` may carry it over."""
    from infer.quant.formats.q4k import Q4KLinear
    from infer.runtime.files.gguf_blocks import from_gguf, importable, placed_bytes, to_kernels

    tensors = {"blk.0.attn_q.weight": (random_blocks(T.Q4_K, 8, 512, seed=4), T.Q4_K)}
    heads = [("add_uint32", "llama.attention.head_count", 2)]
    heads.append(("add_uint32", "llama.attention.head_count_kv", 2))
    f = GGUFFile(write_gguf(tmp_path / "q.gguf", "llama", tensors, heads))
    t = f.hf_tensor("model.layers.0.self_attn.q_proj.weight")
    q = from_gguf(t)
    assert type(q) is Q4KLinear and q.nbytes == t.nbytes and placed_bytes(t) == 0
    assert torch.equal(q.dequantize(), dequantize(t))
    rows = torch.tensor([3, 1, 0])
    assert torch.equal(q.dequantize(rows), dequantize(t)[rows])
    assert type(to_kernels(t)) is Q4KLinear
    assert importable(t, {"format": "q4_k"}) and not importable(t, {"format": "int4"})


def test_kernel_weights_picks_weights_by_type(tmp_path):
    from infer.runtime.files.gguf_blocks import kernel_weights

    K = 256
    tensors = {
        "token_embd.weight": (random_blocks(T.Q6_K, 8, K), T.Q6_K),
        "blk.0.attn_q.weight": (random_blocks(T.Q4_K, 8, K), T.Q4_K),
        "blk.0.attn_k.weight": np.zeros((8, K), np.float16),
        "blk.0.ffn_down.weight": (
            gguf.quants.quantize(np.ones((8, K), np.float32), T.Q8_0),
            T.Q8_0,
        ),
        "blk.0.attn_norm.weight": np.ones(K, np.float32),
    }
    heads = [("add_uint32", "llama.attention.head_count", 2)]
    heads.append(("add_uint32", "llama.attention.head_count_kv", 2))
    f = GGUFFile(write_gguf(tmp_path / "k.gguf", "llama", tensors, heads))
    assert set(kernel_weights(f)) == {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    }


def test_unsupported_architecture(tmp_path):
    f = GGUFFile(write_gguf(tmp_path / "g.gguf", "gemma2", {}))
    with pytest.raises(InferError, match="unsupported architecture 'gemma2'.*llama, qwen2, qwen3"):
        f.config()


# ---------------------------------------------------------------------------------------
# Broken files: always InferError, never a traceback from deep inside
# ---------------------------------------------------------------------------------------


def test_empty_missing_bad_magic_bad_version(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(InferError, match="empty.gguf: not a GGUF file"):
        GGUFFile(empty)
    with pytest.raises(InferError, match="cannot open"):
        GGUFFile(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(InferError, match="bad.gguf: not a GGUF file"):
        GGUFFile(bad)
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(InferError, match="unsupported GGUF version 1"):
        GGUFFile(v1)
    big = tmp_path / "big.gguf"
    big.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(InferError, match="big-endian"):
        GGUFFile(big)


@pytest.mark.slow
def test_truncated_anywhere(typed_file, tmp_path):
    data = typed_file.read_bytes()
    f = GGUFFile(typed_file)
    end = max(t.offset + t.nbytes for t in f.tensors.values())  # the writer pads past this
    cut = tmp_path / "cut.gguf"
    # Every cut in the header (magic, counts, key/values, tensor infos), then a stride
    # through the tensor data.
    for n in [*range(f.data_offset + 1), *range(f.data_offset + 1, end, 97), end - 1]:
        cut.write_bytes(data[:n])
        with pytest.raises(InferError):
            GGUFFile(cut)
    cut.write_bytes(data[:end])
    GGUFFile(cut)


def test_garbage_never_crashes(typed_file, tmp_path):
    data = typed_file.read_bytes()
    header_end = GGUFFile(typed_file).data_offset
    rng = np.random.default_rng(2)
    bad = tmp_path / "garbage.gguf"
    for _ in range(300):
        b = bytearray(data[: header_end + 4096])
        for pos in rng.integers(4, header_end, 3):
            b[pos] = rng.integers(0, 256)
        bad.write_bytes(bytes(b))
        try:
            GGUFFile(bad)
        except InferError:
            pass
    bad.write_bytes(b"GGUF" + rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with pytest.raises(InferError):
        GGUFFile(bad)


def test_string_length_past_the_end(tmp_path):
    """A vocabulary is stepped over, not decoded, when the header is read: a string length
    that leads far past the end still fails as a truncated file (found by the fuzzer)."""
    from infer.runtime.files.gguf_meta import GGUFMeta

    path = write_gguf(tmp_path / "s.gguf", "llama", {}, [("add_array", "t.strs", ["a", "b"])])
    data = path.read_bytes()
    strings = struct.pack("<Q", 1) + b"a" + struct.pack("<Q", 1) + b"b"
    for length in (2**63, 2**40, len(data)):
        patched = struct.pack("<Q", length) + strings[8:]  # the next length lies past it
        path.write_bytes(data.replace(strings, patched))
        for read in (GGUFFile, GGUFMeta):
            with pytest.raises(InferError, match="truncated GGUF file: value of 't.strs'"):
                read(path)


def test_string_not_utf8(tmp_path):
    from infer.runtime.files.gguf_meta import GGUFMeta

    path = write_gguf(tmp_path / "s.gguf", "llama", {}, [("add_array", "t.strs", ["a", "bc"])])
    path.write_bytes(
        path.read_bytes().replace(struct.pack("<Q", 2) + b"bc", struct.pack("<Q", 2) + b"\xff\xfe")
    )
    for read in (GGUFFile, GGUFMeta):
        with pytest.raises(InferError, match="element 1 is not valid UTF-8"):
            read(path).get("t.strs")


# Strings of every kind for an array long enough to be decoded in bulk: empty, spaces,
# NUL and control bytes, multi-byte characters, a length needing two bytes.
BULK_STRINGS = ["", " ", "a b", "\x00", "\n\t", "é", "中文", "😀👍🏽", "Ġthe", "x" * 300, "\x7f"]


def _bulk_strings(n: int = 5000) -> list[str]:
    return [f"{BULK_STRINGS[i % len(BULK_STRINGS)]}{i}" if i % 3 else "" for i in range(n)]


def test_long_string_arrays_decode_in_bulk(tmp_path):
    from infer.runtime.files.gguf_header import _BULK_STRINGS
    from infer.runtime.files.gguf_meta import GGUFMeta

    strings = _bulk_strings()
    assert len(strings) >= _BULK_STRINGS
    kv = [
        ("add_array", "t.strs", strings),
        ("add_array", "t.more", strings[:7]),
        ("add_uint32", "t.after", 9),
    ]
    path = write_gguf(tmp_path / "s.gguf", "llama", {}, kv)
    for read in (GGUFFile, GGUFMeta):
        f = read(path)
        assert f.get("t.strs") == strings and f.get("t.more") == strings[:7]
        assert f.get("t.after") == 9


def test_long_string_array_not_utf8(tmp_path):
    """Each way a string can be invalid UTF-8, in the bulk decoder: the element is named."""
    from infer.runtime.files.gguf_meta import GGUFMeta

    strings = _bulk_strings()
    strings[4321] = "abcd"
    path = write_gguf(tmp_path / "s.gguf", "llama", {}, [("add_array", "t.strs", strings)])
    good = struct.pack("<Q", 4) + b"abcd"
    data = path.read_bytes()
    assert data.count(good) == 1
    # 0xFF; a lead byte cut off; a surrogate; a lone continuation byte; an overlong "/"
    for bad in (b"ab\xffd", b"abc\xc3", b"a\xed\xb3\xbf", b"\x80bcd", b"ab\xc0\xaf"):
        path.write_bytes(data.replace(good, struct.pack("<Q", 4) + bad))
        for read in (GGUFFile, GGUFMeta):
            with pytest.raises(InferError, match="element 4321 is not valid UTF-8"):
                read(path).get("t.strs")


def test_long_string_array_length_past_the_end(tmp_path):
    strings = _bulk_strings()
    path = write_gguf(tmp_path / "s.gguf", "llama", {}, [("add_array", "t.strs", strings)])
    data = path.read_bytes()
    last = struct.pack("<Q", len(strings[-1].encode())) + strings[-1].encode()
    assert data.count(last) == 1
    path.write_bytes(data.replace(last, struct.pack("<Q", 2**40) + strings[-1].encode()))
    with pytest.raises(InferError, match="truncated GGUF file: value of 't.strs'"):
        GGUFFile(path)


def test_real_vocabulary_bulk_equals_one_by_one(smollm2_gguf):
    """The default model's tokens and merges, decoded in bulk and one string at a time."""
    from infer.runtime.files.gguf_header import _Cursor

    f = GGUFFile(smollm2_gguf)
    for key, n in (("tokenizer.ggml.tokens", 49152), ("tokenizer.ggml.merges", 48900)):
        at = f._values[key].at
        r = _Cursor(f._buf, f.path, at + 12)  # past the element type and count
        assert f.get(key) == r._string_array(n, key) and len(f.get(key)) == n


def _patch_tensor_offset(path: Path, name: str, value: int) -> None:
    """Overwrite the u64 data offset in the tensor info of `name` (the info's last field)."""
    data = bytearray(path.read_bytes())
    name_bytes = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(name_bytes) + len(name_bytes)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims + 4
    struct.pack_into("<Q", data, at, value)
    path.write_bytes(bytes(data))


def test_bad_offsets_and_counts(tmp_path):
    w = np.zeros((4, 32), np.float32)
    tensors = {"a.weight": w, "b.weight": w}
    path = write_gguf(tmp_path / "o.gguf", "llama", tensors)
    _patch_tensor_offset(path, "b.weight", 0)
    with pytest.raises(InferError, match="overlap"):
        GGUFFile(path)
    path = write_gguf(tmp_path / "o.gguf", "llama", tensors)
    _patch_tensor_offset(path, "b.weight", 520)
    with pytest.raises(InferError, match="not aligned"):
        GGUFFile(path)
    path = write_gguf(tmp_path / "o.gguf", "llama", tensors)
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 8, 2**40)  # tensor_count
    path.write_bytes(bytes(data))
    with pytest.raises(InferError, match="bad GGUF header"):
        GGUFFile(path)
    path = write_gguf(
        tmp_path / "o.gguf", "llama", tensors, [("add_uint32", "general.alignment", 48)]
    )
    with pytest.raises(InferError, match="power of two"):
        GGUFFile(path)
