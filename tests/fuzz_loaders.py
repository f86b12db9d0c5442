"""A mutation fuzzer over the three model loaders: GGUF files, Hugging Face folders and
our checkpoints, mutated in their headers, metadata, config.json, tensor shapes, types
and counts, tokenizers and chat templates.

Each case runs in a forked child process (one import of torch for all) under a memory
limit and a time limit, through what `infer run` does: load the model, encode a chat
turn, run a prompt and one decode step. It must end one of two ways: it answers with
finite logits, or it fails with a one-line InferError. Anything else is a finding:
another exception type, a hang, a crash, more memory than the limit.

    python tests/fuzz_loaders.py --cases 6000 --seed 1     # the long run
    python tests/fuzz_loaders.py --cases 200 --only gguf   # one loader
    python tests/fuzz_loaders.py --replay 1:4711           # one case again, traceback shown

tests/test_fuzz.py runs a short seeded run. Cases are numbered; (seed, number) makes
the same mutation again.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import os
import random
import re
import resource
import select
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # children are forked

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).parent))
from tiny import CHATML, write_tokenizer

from infer import InferError
from infer.quant.formats.base import FORMATS, set_module
from infer.runtime.files.checkpoint import save_checkpoint
from infer.runtime.loader import load_model
from infer.runtime.model import chat_template
from infer.runtime.model.config import ModelArgs
from infer.runtime.model.llama import Transformer
from infer.runtime.session import Session

CASE_SECONDS = 20  # a case that takes longer hangs
MEMORY_BYTES = 3 << 30  # address space a case may add to what the parent maps
DEFAULT_REAL = Path("~/.cache/infer/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")

# ---------------------------------------------------------------------------------------
# Interesting values
# ---------------------------------------------------------------------------------------

INTS = [
    *(0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 255, 256),
    *(1000, 1023, 1024, 4096, 32767, 32768, 65535, 65536, 1 << 20, 2**31 - 1, 2**31),
    *(2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1),
    *(-1, -2, -(2**31), -(2**63)),
]
FLOATS = [
    *(0.0, -0.0, -1.0, 1e-30, 1e-12, 1e-6, 1e-5, 0.1, 0.5, 1.0, 2.0, 3.0, 8.0, 1e4, 5e5),
    *(1e10, 1e30, 3.4e38, 1e300, float("nan"), float("inf"), float("-inf")),
]
STRINGS = ["", "x", "llama", "gpt2", "linear", "llama3", "yarn", "silu", "\u00e9\u20ac", "a" * 5000]


def near(rng: random.Random, v: int) -> int:
    return rng.choice([v - 1, v + 1, v * 2, v // 2, v + 32, 0, -v])


def any_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind <= 1:
        return rng.choice(INTS)
    if kind == 2:
        return rng.choice(FLOATS)
    if kind == 3:
        return rng.choice(STRINGS)
    if kind == 4:
        return rng.choice([True, False])
    if kind == 5:
        return None
    if kind == 6:
        return [any_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["factor", "rope_type", "type", "x"]): any_json(rng, depth + 1)}


# ---------------------------------------------------------------------------------------
# GGUF: a permissive model of a file, and its writer
# ---------------------------------------------------------------------------------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?"}
_FMT |= {U64: "Q", I64: "q", F64: "d"}
_RANGE = {U8: (0, 255), I8: (-128, 127), U16: (0, 65535), I16: (-32768, 32767)}
_RANGE |= {U32: (0, 2**32 - 1), I32: (-(2**31), 2**31 - 1), U64: (0, 2**64 - 1)}
_RANGE |= {I64: (-(2**63), 2**63 - 1)}


@dataclasses.dataclass
class Tensor:
    name: str
    dims: list[int]  # GGUF order: innermost first
    ttype: int
    data: bytes
    offset: int | None = None  # None: laid out by the writer


@dataclasses.dataclass
class Gguf:
    kvs: list[list]  # [key, vtype, value]; an array's value is (element vtype, items)
    tensors: list[Tensor]
    version: int = 3

    def kv(self, key: str) -> list | None:
        return next((kv for kv in self.kvs if kv[0] == key), None)


def _string(s) -> bytes:
    raw = s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value) -> bytes:
    if vtype == STR:
        return _string(value)
    if vtype == ARR:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    if vtype == F32:
        with np.errstate(over="ignore"):
            return np.float32(value).tobytes()  # 1e300 becomes inf, as a writer would make it
    if vtype == F64:
        return struct.pack("<d", float(value))
    if vtype == BOOL:
        return struct.pack("<?", bool(value))
    lo, hi = _RANGE[vtype]
    return struct.pack("<" + _FMT[vtype], min(max(int(value), lo), hi))


def write_gguf(g: Gguf) -> bytes:
    align = g.kv("general.alignment")
    align = align[2] if align and isinstance(align[2], int) and align[2] in (8, 16, 32, 64) else 32
    out = bytearray(b"GGUF" + struct.pack("<IQQ", g.version, len(g.tensors), len(g.kvs)))
    for key, vtype, value in g.kvs:
        out += _string(key) + struct.pack("<I", vtype) + _value(vtype, value)
    at, offsets = 0, []
    for t in g.tensors:
        offsets.append(at if t.offset is None else t.offset)
        at += -(-len(t.data) // align) * align
    for t, offset in zip(g.tensors, offsets):
        out += _string(t.name) + struct.pack("<I", len(t.dims))
        out += struct.pack(f"<{len(t.dims)}Q", *(d % 2**64 for d in t.dims))
        out += struct.pack("<IQ", t.ttype % 2**32, offset % 2**64)
    out += bytes(-len(out) % align)
    for i, t in enumerate(g.tensors):
        out += t.data
        if i + 1 < len(g.tensors):
            out += bytes(-len(t.data) % align)
    return bytes(out)


def encode(w: np.ndarray, ttype: int) -> bytes:
    """`w` (torch order) stored as `ttype`."""
    if ttype == T.F32:
        return w.astype(np.float32).tobytes()
    if ttype == T.F16:
        return w.astype(np.float16).tobytes()
    if ttype == T.BF16:
        return (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    if ttype in (T.I8, T.I16, T.I32):
        return w.astype({T.I8: np.int8, T.I16: np.int16, T.I32: np.int32}[ttype]).tobytes()
    return gguf.quants.quantize(w.astype(np.float32), T(ttype)).tobytes()


def tensor(name: str, w: np.ndarray, ttype: int = T.F32) -> Tensor:
    return Tensor(name, list(reversed(w.shape)), int(ttype), encode(w, ttype))


# ---------------------------------------------------------------------------------------
# Bases: small models of every loader, written once per run
# ---------------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokens() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return SPECIALS + sorted(ByteLevel.alphabet())


def _gpt2_tokenizer_kvs() -> list[list]:
    tokens = [*_byte_tokens(), "Ġt", "he", "Ġthe"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return [
        ["tokenizer.ggml.model", STR, "gpt2"],
        ["tokenizer.ggml.pre", STR, "smollm"],
        ["tokenizer.ggml.tokens", ARR, (STR, tokens)],
        ["tokenizer.ggml.token_type", ARR, (I32, types)],
        ["tokenizer.ggml.merges", ARR, (STR, ["Ġ t", "h e", "Ġt he"])],
        ["tokenizer.ggml.bos_token_id", U32, 0],
        ["tokenizer.ggml.eos_token_id", U32, 2],
        ["tokenizer.chat_template", STR, CHATML],
    ]


def _spm_tokenizer_kvs() -> list[list]:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "▁t", "h", "e", "he", "▁the", "i", "H", "▁Hi"]
    tokens = pieces + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    return [
        ["tokenizer.ggml.model", STR, "llama"],
        ["tokenizer.ggml.tokens", ARR, (STR, tokens)],
        ["tokenizer.ggml.scores", ARR, (F32, scores)],
        ["tokenizer.ggml.token_type", ARR, (I32, types)],
        ["tokenizer.ggml.bos_token_id", U32, 1],
        ["tokenizer.ggml.eos_token_id", U32, 2],
        ["tokenizer.ggml.unknown_token_id", U32, 0],
        ["tokenizer.chat_template", STR, CHATML.replace("<|im_start|>", "<s>")],
    ]


def gguf_base(kind: str, rng: np.random.Generator) -> Gguf:
    """ "llama": untied, quantized blocks, rope factors, a byte-level tokenizer;
    "qwen3moe": stacked experts, q/k norms, tied; "qwen2": biases, a SentencePiece one."""
    arch = kind
    tok = _spm_tokenizer_kvs() if kind == "qwen2" else _gpt2_tokenizer_kvs()
    vocab = len(next(kv[2][1] for kv in tok if kv[0] == "tokenizer.ggml.tokens"))
    dim, heads, kv_heads, head_dim, ffn, layers = 64, 4, 2, 16, 96, 2

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        return (1 + rng.standard_normal(n) * 0.1).astype(np.float32)

    ts = [
        tensor("token_embd.weight", w(vocab, dim, scale=0.5), T.Q8_0 if kind == "llama" else T.F32)
    ]
    if kind == "llama":
        ts.append(tensor("output.weight", w(vocab, dim), T.Q8_0))
        ts.append(tensor("rope_freqs.weight", np.linspace(1, 8, head_dim // 2, dtype=np.float32)))
    for i in range(layers):
        q = T.Q4_1 if (kind == "llama" and i == 1) else T.Q8_0 if kind == "llama" else T.F32
        ts += [
            tensor(f"blk.{i}.attn_norm.weight", norm(dim)),
            tensor(f"blk.{i}.ffn_norm.weight", norm(dim)),
            tensor(f"blk.{i}.attn_q.weight", w(heads * head_dim, dim), q),
            tensor(f"blk.{i}.attn_k.weight", w(kv_heads * head_dim, dim), q),
            tensor(f"blk.{i}.attn_v.weight", w(kv_heads * head_dim, dim), q),
            tensor(f"blk.{i}.attn_output.weight", w(dim, heads * head_dim), q),
        ]
        if kind == "qwen2":
            for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                ts.append(tensor(f"blk.{i}.attn_{p}.bias", w(n * head_dim)))
        if kind == "qwen3moe":
            ts += [
                tensor(f"blk.{i}.attn_q_norm.weight", norm(head_dim)),
                tensor(f"blk.{i}.attn_k_norm.weight", norm(head_dim)),
                tensor(f"blk.{i}.ffn_gate_inp.weight", w(8, dim)),
                tensor(f"blk.{i}.ffn_gate_exps.weight", w(8, 32, dim)),
                tensor(f"blk.{i}.ffn_up_exps.weight", w(8, 32, dim)),
                tensor(f"blk.{i}.ffn_down_exps.weight", w(8, dim, 32)),
            ]
        else:
            ts += [
                tensor(f"blk.{i}.ffn_gate.weight", w(ffn, dim), q),
                tensor(f"blk.{i}.ffn_up.weight", w(ffn, dim), q),
                tensor(f"blk.{i}.ffn_down.weight", w(dim, ffn), q),
            ]
    ts.append(tensor("output_norm.weight", norm(dim)))
    kvs = [
        ["general.architecture", STR, arch],
        ["general.alignment", U32, 32],
        [f"{arch}.block_count", U32, layers],
        [f"{arch}.context_length", U32, 256],
        [f"{arch}.embedding_length", U32, dim],
        [f"{arch}.feed_forward_length", U32, ffn],
        [f"{arch}.attention.head_count", U32, heads],
        [f"{arch}.attention.head_count_kv", U32, kv_heads],
        [f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-5],
        [f"{arch}.rope.freq_base", F32, 10000.0],
        *tok,
    ]
    if kind == "qwen3moe":
        kvs += [
            [f"{arch}.attention.key_length", U32, head_dim],
            [f"{arch}.expert_count", U32, 8],
            [f"{arch}.expert_used_count", U32, 2],
            [f"{arch}.expert_feed_forward_length", U32, 32],
        ]
    return Gguf(kvs, ts)


HF_CONFIGS = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "sliding_window": 64,
        "use_sliding_window": False,
    },
}


def hf_weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights of every tensor our model takes, under Hugging Face names."""
    args = ModelArgs.from_dict(config)
    with torch.device("meta"):
        model = Transformer(args)
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and args.tie_embeddings:
            continue
        scale = 0.5 if "embed" in name else 0.08
        w = rng.standard_normal(tuple(p.shape)) * scale
        if "norm" in name:
            w = 1 + w
        out[name if name == "lm_head.weight" else f"model.{name}"] = w.astype(np.float32)
    return out


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict | None = None) -> bytes:
    from safetensors.numpy import save

    return save(tensors, metadata=metadata)


def write_hf(path: Path, kind: str, rng: np.random.Generator) -> None:
    path.mkdir(parents=True)
    config = HF_CONFIGS[kind]
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(safetensors_bytes(hf_weights(config, rng)))
    write_tokenizer(path)


def write_checkpoint(path: Path, hf: Path) -> None:
    """The "llama" Hugging Face base quantized: attention int8, MLPs int4, as `infer
    quantize` writes it."""
    from infer.runtime.files.build import build
    from infer.runtime.files.sources import open_source

    source = open_source(hf)
    model = build(source, torch.float32)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            fmt, params = ("int8", {}) if "self_attn" in name else ("int4", {"group_size": 32})
            set_module(model, name, FORMATS[fmt].from_float(m.weight, m.bias, **params))
    record = {"path": str(hf), "sha256": {}, "format": "safetensors"}
    save_checkpoint(model, source.config, source.tokenizer(), path, source=record)


# ---------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------

TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10000000000 }}",
    "{{ 'ab' * 100000 * 100000 }}",
    (
        "{% set s = namespace(x='a') %}{% for i in range(64) %}{% set s.x = s.x ~ s.x %}"
        "{% endfor %}{{ s.x }}"
    ),
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ raise_exception('no') }}",
    "{% for m in messages %}{{ m.content",
    "{{ ''.__class__.__mro__ }}",
    "{{ messages[5]['content'] }}",
    "{{ messages|tojson }}{{ 1/0 }}",
    "{{ (messages * 1000000000)|length }}",
    "{{ range(10**12)|list }}",
    "",
    "{% for m in messages %}{{ m['role'] }}{% endfor %}",
]
GGUF_KEYS = [
    "vocab_size", "context_length", "embedding_length", "feed_forward_length", "block_count",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_feed_forward_length", "expert_weights_norm",
    "expert_gating_func", "expert_weights_scale",
]  # fmt: skip
HF_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "attention_bias", "qkv_bias", "sliding_window", "use_sliding_window", "hidden_act",
    "mlp_bias", "bos_token_id", "eos_token_id", "num_experts", "num_local_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "model_type", "clip_qkv",
]  # fmt: skip
WHOLE_CONFIGS = [b"[]", b"null", b"5", b'"x"', b"", b"\xff\xfe{}", b"{", b"[" * 100000, b"{}"]


def _gguf_value(rng: random.Random, vtype: int, old=None):
    """A value for `vtype`: near the old one, or one of the interesting ones."""
    if vtype == STR:
        return rng.choice([*STRINGS, b"\xff\xfe", "llama", "qwen2", "gemma3"])
    if vtype == BOOL:
        return rng.random() < 0.5
    if vtype in (F32, F64):
        return rng.choice(FLOATS)
    if vtype == ARR:
        etype = rng.choice([U32, I32, F32, STR])
        return (etype, [_gguf_value(rng, etype) for _ in range(rng.randrange(4))])
    lo, hi = _RANGE[vtype]
    if isinstance(old, int) and rng.random() < 0.4:
        return min(max(near(rng, old), lo), hi)
    return rng.choice([v for v in INTS if lo <= v <= hi])


def _mutate_array(rng: random.Random, kv: list) -> str:
    etype, items = kv[2]
    items = list(items)
    i = rng.randrange(len(items)) if items else 0
    op = rng.choice(["edit", "drop", "add", "dup", "empty", "retype", "truncate"])
    if op == "edit" and items:
        v = items[i]
        if isinstance(v, str):
            items[i] = rng.choice(
                [v[::-1], v + "x", "", b"\xc3(", v[:1], items[(i + 1) % len(items)]]
            )
        else:
            items[i] = _gguf_value(rng, etype, v)
    elif op == "drop" and items:
        del items[i]
    elif op == "add":
        items.append(_gguf_value(rng, etype))
    elif op == "dup" and items:
        items.append(items[i])
    elif op == "empty":
        items = []
    elif op == "retype":
        etype = rng.choice([U8, I32, F32, STR, BOOL, U64])
        items = [_gguf_value(rng, etype) for _ in items[:400]]
    elif op == "truncate":
        items = items[: rng.randrange(len(items) + 1)]
    kv[2] = (etype, items)
    return f"{kv[0]} array {op}[{i}]"


def mutate_gguf(rng: random.Random, g: Gguf) -> tuple[str, bytes]:
    g = copy.deepcopy(g)
    arch = g.kv("general.architecture")[2]
    kind = rng.choices(
        ["kv", "kv_type", "kv_drop", "kv_add", "array", "template", "tensor_dims",
         "tensor_shape", "tensor_type", "tensor_retype", "tensor_offset", "tensor_name",
         "tensor_drop", "tensor_dup", "raw", "truncate", "multi"],
        [14, 5, 5, 8, 10, 4, 6, 8, 5, 6, 3, 4, 3, 2, 5, 2, 5],
    )[0]  # fmt: skip
    if kind == "multi":  # several numbers at once, each plausible on its own
        keys = rng.sample([kv for kv in g.kvs if kv[1] in (U32, F32)], 3)
        for kv in keys:
            kv[2] = _gguf_value(rng, kv[1], kv[2])
        return "multi " + ", ".join(f"{kv[0]}={kv[2]!r}" for kv in keys), write_gguf(g)
    if kind in ("kv", "kv_type", "kv_drop"):
        kv = rng.choice(g.kvs)
        if kind == "kv_drop":
            g.kvs.remove(kv)
            return f"drop {kv[0]}", write_gguf(g)
        if kind == "kv_type":
            kv[1] = rng.choice([U8, I8, U32, I32, U64, I64, F32, F64, BOOL, STR, ARR])
        kv[2] = _gguf_value(rng, kv[1], kv[2] if kind == "kv" else None)
        return f"{kv[0]} = {_show(kv[2])} ({kv[1]})", write_gguf(g)
    if kind == "kv_add":
        key = f"{arch}.{rng.choice(GGUF_KEYS)}"
        vtype = rng.choice([U32, U32, F32, STR, I32, U64, BOOL])
        value = _gguf_value(rng, vtype)
        old = g.kv(key)
        if old:
            old[1:] = [vtype, value]
        else:
            g.kvs.append([key, vtype, value])
        return f"add {key} = {_show(value)} ({vtype})", write_gguf(g)
    if kind == "array":
        arrays = [kv for kv in g.kvs if kv[1] == ARR]
        return _mutate_array(rng, rng.choice(arrays)), write_gguf(g)
    if kind == "template":
        kv = g.kv("tokenizer.chat_template")
        kv[2] = rng.choice(TEMPLATES)
        return f"template {kv[2][:50]!r}", write_gguf(g)
    t = rng.choice(g.tensors)
    if kind == "tensor_dims":
        i = rng.randrange(len(t.dims))
        t.dims[i] = rng.choice(INTS) % 2**64 if rng.random() < 0.5 else near(rng, t.dims[i])
        return f"{t.name} dims {t.dims} (data kept)", write_gguf(g)
    if kind == "tensor_shape":  # a consistent tensor of another shape
        shape = list(reversed(t.dims))
        op = rng.choice(["dim", "swap", "add", "drop"])
        if op == "dim":
            i = rng.randrange(len(shape))
            shape[i] = max(1, rng.choice([shape[i] - 1, shape[i] + 1, shape[i] * 2, shape[i] // 2]))
        elif op == "swap":
            shape.reverse()
        elif op == "add":
            shape.insert(0, rng.choice([1, 2]))
        elif len(shape) > 1:
            shape = shape[1:]
        w = np.random.default_rng(rng.randrange(2**32)).standard_normal(shape) * 0.05
        ttype = t.ttype
        block = gguf.GGML_QUANT_SIZES[T(ttype)][0]
        if shape[-1] % block:
            ttype = T.F32
        t.dims, t.ttype, t.data = list(reversed(shape)), int(ttype), encode(w, ttype)
        return f"{t.name} shape {tuple(shape)} ({T(ttype).name}, consistent)", write_gguf(g)
    if kind == "tensor_type":  # the data kept, the type changed
        t.ttype = rng.choice([*range(40), 99, 2**31])
        return f"{t.name} type {t.ttype} (data kept)", write_gguf(g)
    if kind == "tensor_retype":  # the values stored again in another type
        shape = list(reversed(t.dims))
        w = _decode(t)
        ttype = rng.choice([T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.I8, T.I32])
        if shape[-1] % gguf.GGML_QUANT_SIZES[ttype][0]:
            ttype = T.F16
        t.ttype, t.data = int(ttype), encode(w.reshape(shape), ttype)
        return f"{t.name} stored as {ttype.name} (consistent)", write_gguf(g)
    if kind == "tensor_offset":
        t.offset = rng.choice([0, 32, 64, 1, 31, 2**32, 2**63, 2**64 - 1, len(t.data)])
        return f"{t.name} offset {t.offset}", write_gguf(g)
    if kind == "tensor_name":
        old = t.name
        n = rng.choice([2, 3, 99, 2**31, 10**30])
        t.name = rng.choice(
            [old.replace("blk.0", f"blk.{n}"), old.replace(".weight", ".bias"), "blk.0.foo.weight",
             "output.weight", "token_embd.weight", "", "\u00e9", old.replace("blk.1", "blk.0"),
             "blk.0.ffn_gate.0.weight", "rope_freqs.weight", "blk.0.attn_q.bias"]
        )  # fmt: skip
        return f"rename {old} -> {t.name}", write_gguf(g)
    if kind == "tensor_drop":
        g.tensors.remove(t)
        return f"drop tensor {t.name}", write_gguf(g)
    if kind == "tensor_dup":
        g.tensors.append(copy.deepcopy(t))
        return f"duplicate tensor {t.name}", write_gguf(g)
    data = bytearray(write_gguf(g))
    header_end = len(data) - sum(len(t.data) for t in g.tensors) - 32 * len(g.tensors)
    if kind == "truncate":
        cut = rng.randrange(len(data))
        return f"truncate at {cut}", bytes(data[:cut])
    for _ in range(rng.choice([1, 1, 2, 4])):  # raw: bytes of the header overwritten
        at = rng.randrange(4, max(5, header_end))
        data[at] = rng.randrange(256)
    return "raw header bytes", bytes(data)


def _decode(t: Tensor) -> np.ndarray:
    from infer.runtime.files.gguf_tensor import GGUFTensor, block_bytes, dequantize

    shape = tuple(reversed(t.dims))
    raw = np.frombuffer(bytearray(t.data), np.uint8)
    if T(t.ttype) == T.F32:
        data = raw.view(np.float32).reshape(shape)
    else:
        data = raw.reshape(block_bytes(T(t.ttype), shape))
    return dequantize(GGUFTensor(t.name, T(t.ttype), shape, data)).numpy()


def _show(v) -> str:
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


def mutate_config(rng: random.Random, config: dict) -> tuple[str, bytes]:
    """config.json mutated: a value, its type, a key dropped or added, or the whole file."""
    cfg = copy.deepcopy(config)
    kind = rng.choices(["value", "drop", "add", "nested", "whole", "multi"], [10, 3, 8, 4, 2, 3])[0]
    if kind == "whole":
        data = rng.choice([*WHOLE_CONFIGS, json.dumps(cfg).encode()[: rng.randrange(50)]])
        return f"config.json is {data[:20]!r}", data
    if kind == "drop":
        key = rng.choice(list(cfg))
        del cfg[key]
        return f"drop {key}", json.dumps(cfg).encode()
    if kind == "nested":
        key = rng.choice(["rope_scaling", "rope_parameters"])
        sub = dict(
            cfg.get(key) or {"rope_type": rng.choice(["llama3", "linear", "default", "yarn"])}
        )
        field = rng.choice(["factor", "low_freq_factor", "high_freq_factor", "rope_type", "type",
                            "original_max_position_embeddings", "rope_theta"])  # fmt: skip
        sub[field] = any_json(rng)
        cfg[key] = sub
        return f"{key}.{field} = {_show(sub[field])}", json.dumps(cfg).encode()
    keys = rng.sample(HF_KEYS, 3 if kind == "multi" else 1)
    for key in keys:
        old = cfg.get(key)
        if (
            kind != "add"
            and isinstance(old, int)
            and not isinstance(old, bool)
            and rng.random() < 0.5
        ):
            cfg[key] = near(rng, old)
        else:
            cfg[key] = any_json(rng)
    shown = ", ".join(f"{k} = {_show(cfg[k])}" for k in keys)
    return shown, json.dumps(cfg).encode()


def _read_safetensors_header(data: bytes) -> tuple[dict, int]:
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + n]), n


def _with_header(data: bytes, header: dict, keep_size: bool) -> bytes:
    _, n = _read_safetensors_header(data)
    raw = json.dumps(header).encode()
    if keep_size and len(raw) <= n:
        raw += b" " * (n - len(raw))  # tensor data stays where the offsets say
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def mutate_safetensors(rng: random.Random, data: bytes, ours: bool) -> tuple[str, bytes]:
    header, n = _read_safetensors_header(data)
    names = [k for k in header if k != "__metadata__"]
    kind = rng.choices(["entry", "not_object", "drop", "rename", "length", "raw", "meta"],
                       [10, 2, 3, 3, 2, 3, 6 if ours else 1])[0]  # fmt: skip
    name = rng.choice(names)
    if kind == "entry":
        field = rng.choice(["dtype", "shape", "data_offsets"])
        entry = header[name]
        if field == "dtype":
            entry["dtype"] = rng.choice(["F16", "BF16", "I32", "I8", "U8", "BOOL", "F64", "Q4", 5])
        elif field == "shape" and entry["shape"] and rng.random() < 0.7:
            i = rng.randrange(len(entry["shape"]))
            entry["shape"][i] = rng.choice([*INTS, near(rng, entry["shape"][i]), 1.5, "x"])
        else:
            entry[field] = rng.choice([[], [0], [1, 2, 3], [2**64, 2**64], "x", None, [-1, 5]])
        desc = f"{name}.{field} = {_show(entry[field])}"
    elif kind == "not_object":
        header[name] = rng.choice(["x", 5, [], None, ["F32", [1], [0, 4]]])
        desc = f"{name} entry = {_show(header[name])}"
    elif kind == "drop":
        del header[name]
        desc = f"drop {name}"
    elif kind == "rename":
        new = rng.choice([name.replace("layers.0", "layers.9"), name + "x", "rope_freqs.weight",
                          name.replace("layers.1", "layers.0"), "lm_head.weight", "__metadata__",
                          name.replace("mlp.", "block_sparse_moe.experts."),
                          "model.layers.0.mlp.experts.gate_up_proj",
                          "model.layers.1.mlp.experts.down_proj"])  # fmt: skip
        header[new] = header.pop(name)
        desc = f"rename {name} -> {new}"
    elif kind == "length":
        value = rng.choice([0, 1, n - 1, n + 1, 2**63, 2**64 - 1])
        return f"header length {value}", struct.pack("<Q", value) + data[8:]
    elif kind == "raw":
        b = bytearray(data)
        for _ in range(rng.choice([1, 3])):
            b[rng.randrange(8, 8 + n)] = rng.randrange(256)
        return "raw header bytes", bytes(b)
    else:
        meta = header.setdefault("__metadata__", {})
        key = rng.choice(["quant", "ranges", "crc32", "format", "format_version", "source"])
        try:
            value = json.loads(meta.get(key, "null"))
        except ValueError:
            value = meta.get(key)
        if isinstance(value, dict) and value and rng.random() < 0.8:
            sub = rng.choice(list(value))
            if isinstance(value[sub], dict) and value[sub] and rng.random() < 0.7:
                field = rng.choice(list(value[sub]))
                value[sub][field] = any_json(rng)
                desc = f"metadata {key}[{sub}][{field}] = {_show(value[sub][field])}"
            else:
                value[sub] = any_json(rng)
                desc = f"metadata {key}[{sub}] = {_show(value[sub])}"
        else:
            value = any_json(rng)
            desc = f"metadata {key} = {_show(value)}"
        meta[key] = value if isinstance(value, str) and rng.random() < 0.3 else json.dumps(value)
    return desc, _with_header(data, header, keep_size=True)


def mutate_tokenizer_config(rng: random.Random, text: str) -> tuple[str, bytes]:
    cfg = json.loads(text)
    key = rng.choice(["chat_template", "chat_template", "eos_token", "bos_token", "add_bos_token"])
    cfg[key] = rng.choice(TEMPLATES) if key == "chat_template" else any_json(rng)
    return f"tokenizer_config {key} = {_show(cfg[key])}", json.dumps(cfg).encode()


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bases:
    root: Path
    ggufs: dict[str, Gguf]
    dirs: dict[str, Path]  # "hf-llama", "hf-qwen2_moe", "checkpoint"
    real: Path | None = None


def make_bases(root: Path, real: Path | None = None) -> Bases:
    rng = np.random.default_rng(0)
    ggufs = {k: gguf_base(k, rng) for k in ("llama", "qwen3moe", "qwen2")}
    dirs = {}
    for kind in HF_CONFIGS:
        dirs[f"hf-{kind}"] = root / f"hf-{kind}"
        write_hf(dirs[f"hf-{kind}"], kind, rng)
    dirs["checkpoint"] = root / "checkpoint"
    write_checkpoint(dirs["checkpoint"], dirs["hf-llama"])
    if real is not None:
        real_copy = root / "real.gguf"
        real_copy.write_bytes(real.read_bytes())
        real = real_copy
    return Bases(root, ggufs, dirs, real)


LOADERS = ("gguf", "hf", "checkpoint", "real")


def make_case(bases: Bases, rng: random.Random, loaders) -> tuple[str, str, dict]:
    """(loader, description, {relative path: bytes}); "" as the path is the model file."""
    loader = rng.choice([x for x in loaders if x != "real" or bases.real is not None])
    if loader == "gguf":
        name = rng.choice(list(bases.ggufs))
        desc, data = mutate_gguf(rng, bases.ggufs[name])
        return loader, f"gguf {name}: {desc}", {"model.gguf": data}
    if loader == "real":
        return loader, *mutate_real(rng, bases.real)
    base = bases.dirs[
        "checkpoint" if loader == "checkpoint" else rng.choice(["hf-llama", "hf-qwen2_moe"])
    ]
    files = {f.name: f.read_bytes() for f in base.iterdir()}
    part = rng.choices(["config", "safetensors", "tokenizer"], [6, 5, 1])[0]
    if part == "config":
        desc, files["config.json"] = mutate_config(rng, json.loads(files["config.json"]))
    elif part == "safetensors":
        desc, files["model.safetensors"] = mutate_safetensors(
            rng, files["model.safetensors"], loader == "checkpoint"
        )
    else:
        desc, files["tokenizer_config.json"] = mutate_tokenizer_config(
            rng, files["tokenizer_config.json"].decode()
        )
    return loader, f"{base.name}: {desc}", files


def mutate_real(rng: random.Random, path: Path) -> tuple[str, dict]:
    """The default model with one number of its header changed in place (same size, so
    the copy is patched, not rewritten)."""
    spots = _real_scalars(path)
    key, vtype, at = rng.choice(spots)
    value = _gguf_value(rng, vtype)
    return f"real {key} = {_show(value)}", {"@patch": (at, _value(vtype, value))}


_REAL_SCALARS: dict[Path, list] = {}


def _real_scalars(path: Path) -> list:
    """(key, vtype, byte offset of the value) of every scalar number in the header."""
    if path not in _REAL_SCALARS:
        data = path.read_bytes()[: 8 << 20]
        pos, spots = 24, []
        (n_kv,) = struct.unpack_from("<Q", data, 16)
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", data, pos)
            key = data[pos + 8 : pos + 8 + n].decode()
            pos += 8 + n
            (vtype,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if vtype in _FMT:
                spots.append((key, vtype, pos))
            pos = _skip(data, pos, vtype)
        _REAL_SCALARS[path] = spots
    return _REAL_SCALARS[path]


def _skip(data: bytes, pos: int, vtype: int) -> int:
    if vtype in _FMT:
        return pos + struct.calcsize("<" + _FMT[vtype])
    if vtype == STR:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    etype, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if etype in _FMT:
        return pos + count * struct.calcsize("<" + _FMT[etype])
    for _ in range(count):
        pos = _skip(data, pos, etype)
    return pos


# ---------------------------------------------------------------------------------------
# Running a case in a child process
# ---------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """The case ran out of time (a BaseException: no `except Exception` swallows it)."""


def exercise(path: Path) -> dict:
    """What `infer run` does with a model: load, encode a chat turn, a prompt and a step."""
    lm = load_model(path, max_seq_len=64)
    args = lm.args
    _ = args.n_params, args.n_active_params, lm.source.held_bytes(torch.float32)
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": "Hi there"}])[:48]
    if not ids:
        ids = lm.tokenizer.encode("Hi") or [0]
    session = Session(lm.model, threads=1)
    ids = ids[-(session.max_seq_len - 1) :] if session.max_seq_len > 1 else []
    logits = session.forward(ids or [0], 0)
    token = int(logits[-1].argmax())
    step = session.forward([token], len(ids or [0])) if session.max_seq_len > 1 else logits
    lm.tokenizer.decode([token])
    finite = bool(torch.isfinite(logits).all() and torch.isfinite(step).all())
    return {"finite": finite, "out": [token, round(float(step[-1].max()), 3)]}


def _child(path: Path, seconds: int, memory: int, out_fd: int) -> None:
    def timeout(*_):
        raise _Timeout

    signal.signal(signal.SIGALRM, timeout)
    torch.set_num_threads(1)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _mapped_bytes() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.alarm(seconds)
    try:
        result = {"outcome": "ok", **exercise(path)}
        if not result["finite"]:
            result["outcome"] = "nonfinite"
    except InferError as err:
        line = str(err)
        result = {"outcome": "error" if "\n" not in line else "multiline", "message": line}
    except _Timeout:
        result = {"outcome": "timeout", "where": _where()}
    except BaseException as err:  # noqa: BLE001  (that is the finding)
        result = {
            "outcome": "raw",
            "type": type(err).__name__,
            "message": " ".join(str(err).split())[:300],
            "where": _where(),
        }
    signal.alarm(0)
    os.write(out_fd, json.dumps(result).encode()[:60000])
    os._exit(0)


def _where() -> str:
    frames = traceback.extract_tb(sys.exc_info()[2])
    ours = [f for f in frames if "/infer" in f.filename or "harden" in f.filename] or frames
    f = ours[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def run_case(path: Path, seconds: int = CASE_SECONDS, memory: int = MEMORY_BYTES) -> dict:
    """Run one case in a forked child; its result, or how it died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _child(path, seconds, memory, w)
        finally:
            os._exit(3)
    os.close(w)
    chunks, deadline = [], time.monotonic() + seconds + 10
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([r], [], [], max(0.0, left))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {"outcome": "hang", "where": "killed after the deadline"}
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {status >> 8}"
        return {"outcome": "crash", "where": how}
    return json.loads(b"".join(chunks))


def write_case(dest: Path, files: dict, bases: Bases) -> Path:
    """The case's model on disk: a file or a folder."""
    if "@patch" in files:
        return bases.real
    if "model.gguf" in files:
        dest.write_bytes(files["model.gguf"])
        return dest
    dest.mkdir()
    for name, data in files.items():
        (dest / name).write_bytes(data)
    return dest


@dataclasses.dataclass
class Report:
    cases: int = 0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    findings: list = dataclasses.field(default_factory=list)  # (case, loader, desc, result)
    changed: list = dataclasses.field(default_factory=list)  # loaded, output not the base's
    errors: list = dataclasses.field(default_factory=list)  # (case, desc, InferError message)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.findings


FINDINGS = ("raw", "timeout", "hang", "crash", "multiline", "nonfinite")


def fuzz(
    n: int,
    seed: int,
    loaders=LOADERS,
    root: Path | None = None,
    real: Path | None = None,
    seconds: int = CASE_SECONDS,
    only_case: int | None = None,
    log=None,
) -> Report:
    """Run `n` cases (or only case `only_case`) from `seed`; what they did."""
    t0 = time.monotonic()
    torch.set_num_threads(1)  # the parent forks: no thread pool may be running in it
    chat_template.RENDER_SECONDS = 1.0  # a runaway template needs no more to be caught
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tmp = Path(tmp)
        bases = make_bases(tmp / "bases", real if "real" in loaders else None)
        base_out = {}
        for name, g in bases.ggufs.items():
            (tmp / f"{name}.gguf").write_bytes(write_gguf(g))
            base_out[f"gguf {name}"] = run_case(tmp / f"{name}.gguf", seconds)
        for name, path in bases.dirs.items():
            base_out[name] = run_case(path, seconds)
        if bases.real is not None:
            base_out["real"] = run_case(bases.real, seconds)
        for name, result in base_out.items():
            if result["outcome"] != "ok":
                raise RuntimeError(f"the unmutated base {name} does not load: {result}")
        report = Report()
        original = bases.real.read_bytes()[: 8 << 20] if bases.real else b""
        for i in range(n) if only_case is None else [only_case]:
            rng = random.Random(f"{seed}:{i}")
            loader, desc, files = make_case(bases, rng, loaders)
            path = write_case(tmp / f"case{i}", files, bases)
            if "@patch" in files:
                at, raw = files["@patch"]
                with open(path, "r+b") as f:
                    f.seek(at)
                    f.write(raw)
            try:
                result = run_case(path, seconds)
            finally:
                if "@patch" in files:
                    with open(path, "r+b") as f:
                        f.seek(at)
                        f.write(original[at : at + len(raw)])
                elif path.is_dir():
                    for f in path.iterdir():
                        f.unlink()
                    path.rmdir()
                else:
                    path.unlink()
            report.cases += 1
            report.outcomes[result["outcome"]] += 1
            if log and report.cases % 500 == 0:
                log(f"... {report.cases} cases, {len(report.findings)} findings")
            if result["outcome"] in FINDINGS:
                report.findings.append((i, loader, desc, result))
                if log:
                    log(f"case {seed}:{i} {loader} {desc}: {result}")
            elif result["outcome"] == "error":
                report.errors.append((i, desc, result["message"]))
            elif result["outcome"] == "ok":
                base = next(v for k, v in base_out.items() if desc.startswith(_base_key(k)))
                if result["out"] != base["out"]:
                    report.changed.append((i, loader, desc))
        report.seconds = time.monotonic() - t0
        return report


def _base_key(name: str) -> str:
    return {"real": "real "}.get(name, name + ":")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=6000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", nargs="+", choices=LOADERS, default=list(LOADERS))
    p.add_argument("--real", type=Path, default=DEFAULT_REAL.expanduser())
    p.add_argument("--replay", help="SEED:CASE: run one case in this process, traceback shown")
    p.add_argument("--seconds", type=int, default=CASE_SECONDS)
    p.add_argument("--errors", action="store_true", help="show the InferErrors, one per kind")
    p.add_argument("--json", action="store_true", help="end with the counts as one JSON line")
    a = p.parse_args()
    real = a.real if a.real.is_file() else None
    if a.replay:
        seed, case = map(int, a.replay.split(":"))
        replay(seed, case, a.only, real)
        return
    report = fuzz(
        a.cases, a.seed, a.only, real=real, seconds=a.seconds, log=lambda m: print(m, flush=True)
    )
    print(f"\n{report.cases} cases, seed {a.seed}, {report.seconds:.0f} s")
    for outcome, count in report.outcomes.most_common():
        print(f"  {outcome:10} {count}")
    if a.errors:
        print(f"\nerrors, one case of each kind ({len(report.errors)} in all):")
        kinds = {}
        for i, desc, message in report.errors:
            kinds.setdefault(re.sub(r"\d+|'[^']*'|/\S+", "#", message), (i, desc, message))
        for i, desc, message in kinds.values():
            print(f"  {a.seed}:{i} {desc}\n      -> {message}")
    print(f"\nloaded with another output than the base's ({len(report.changed)}):")
    for i, loader, desc in report.changed:
        print(f"  {a.seed}:{i} {desc}")
    print(f"\nfindings ({len(report.findings)}):")
    for i, loader, desc, result in report.findings:
        print(f"  {a.seed}:{i} {desc}: {result}")
    if a.json:
        print(json.dumps({"cases": report.cases, "outcomes": report.outcomes}))
    sys.exit(1 if report.findings else 0)


def replay(seed: int, case: int, loaders, real: Path | None) -> None:
    """Case `case` of `seed` again, in this process: the traceback, not a summary."""
    with tempfile.TemporaryDirectory() as tmp:
        bases = make_bases(Path(tmp) / "bases", real if "real" in loaders else None)
        loader, desc, files = make_case(bases, random.Random(f"{seed}:{case}"), loaders)
        print(f"{loader}: {desc}")
        path = write_case(Path(tmp) / "case", files, bases)
        if "@patch" in files:
            at, raw = files["@patch"]
            with open(path, "r+b") as f:
                f.seek(at)
                f.write(raw)
        print(exercise(path))


if __name__ == "__main__":
    main()
