"""Read GGUF files: header, key/values and tensor infos parsed here, tensor data memory-mapped.

Layout (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset, offsets aligned

A string is a u64 byte length followed by UTF-8 bytes; an array is u32 element type,
u64 count, then the elements (arrays may nest). GGUF lists dims innermost first, so
torch shapes are the reversed dims.

We parse the header ourselves rather than with gguf.GGUFReader, which builds a numpy
view per field and so takes seconds to open a file with a large vocabulary. The
`gguf` package is used only for its type constants and, for K-quants and other types
dequantized nowhere else here, `gguf.quants.dequantize`.
"""

import itertools
import math
import mmap
import re
import struct
from collections.abc import Container
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ... import InferError
from ..model.config import shown
from . import hugepages
from .gguf_tensor import PLAIN_DTYPES, GGUFTensor, block_bytes, dequantize

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays; garbage could otherwise recurse without bound


def is_gguf(path: Path) -> bool:
    """True if `path` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


SUPPORTED_ARCHS = {
    "llama": "LlamaForCausalLM",  # Mixtral too: a llama file with experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# GGUF architecture -> Hugging Face model_type, where they differ.
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
_FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_INTEGER_TYPES = tuple(GGMLQuantizationType[t] for t in ("I8", "I16", "I32", "I64"))
# config.json key -> the GGUF key (after "<arch>.") it is read from
_CONFIG_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
    "rope_scaling.factor": "rope.scaling.factor",
    "rope_scaling.original_max_position_embeddings": "rope.scaling.original_context_length",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "norm_topk_prob": "expert_weights_norm",
    "sliding_window": "attention.sliding_window",
    "rope_local_base_freq": "rope.freq_base_swa",
    "final_logit_softcapping": "final_logit_softcapping",
}
_TOKENIZER_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}
# Whether llama.cpp renormalises the top-k expert weights for this architecture when the
# file has no `expert_weights_norm` key (build_moe_ffn's norm_w in src/models/<arch>.cpp).
_NORM_TOPK_PROB = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}

# ---------------------------------------------------------------------------------------
# Key/value parsing
# ---------------------------------------------------------------------------------------

# GGUF value types (gguf.GGUFValueType) -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS = {
    0: ("<B", np.dtype("<u1")),  # UINT8
    1: ("<b", np.dtype("<i1")),  # INT8
    2: ("<H", np.dtype("<u2")),  # UINT16
    3: ("<h", np.dtype("<i2")),  # INT16
    4: ("<I", np.dtype("<u4")),  # UINT32
    5: ("<i", np.dtype("<i4")),  # INT32
    6: ("<f", np.dtype("<f4")),  # FLOAT32
    7: ("<?", np.dtype("?")),  # BOOL
    10: ("<Q", np.dtype("<u8")),  # UINT64
    11: ("<q", np.dtype("<i8")),  # INT64
    12: ("<d", np.dtype("<f8")),  # FLOAT64
}
_STRING = 8
_ARRAY = 9
# The fewest bytes one element of each value type takes, to reject absurd array counts early.
_MIN_SIZE = {**{t: dt.itemsize for t, (_, dt) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _HeaderReader:
    """A cursor over the file's bytes that raises InferError instead of reading past the end."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, problem: str) -> InferError:
        return InferError(f"{self.path}: {problem}")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.fail(f"truncated GGUF file: {what} runs past the end of the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            fmt, dt = _SCALARS[vtype]
            self.need(dt.itemsize, what)
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
            self.pos += dt.itemsize
            return v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what, depth=1)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> list:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self.u32(what)
        count = self.u64(what)
        if etype not in _MIN_SIZE:
            raise self.fail(f"{what} is an array of unknown value type {etype}")
        if count * _MIN_SIZE[etype] > self.size - self.pos:
            raise self.fail(
                f"truncated GGUF file: {what} claims {count} elements, more than the file holds"
            )
        if etype in _SCALARS:
            # Numeric arrays (token scores, token types) in one read.
            dt = _SCALARS[etype][1]
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            return arr.tolist()
        if etype == _STRING:
            return self._string_array(count, what)
        return [self.array(what, depth + 1) for _ in range(count)]

    def _string_array(self, count: int, what: str) -> list[str]:
        # The vocabulary and merges: ~100k strings, so the loop is inlined for speed.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out = []
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise self.fail(f"truncated GGUF file: {what} runs past the end of the file")
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise self.fail(f"truncated GGUF file: {what} runs past the end of the file")
                out.append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError:
            raise self.fail(f"{what}: element {len(out)} is not valid UTF-8") from None
        self.pos = pos
        return out


# ---------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------

# Types stored as plain arrays; everything else is stored as blocks of bytes.
# BF16 has no numpy dtype: its data is the raw uint16 bit patterns.
# ---------------------------------------------------------------------------------------
# Names: the one GGUF -> Hugging Face name map
# ---------------------------------------------------------------------------------------

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs.weight",  # llama 3.1 rope scaling factors, no HF tensor
}
# blk.N.<key>.<weight|bias> -> model.layers.N.<value>.<weight|bias>
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts (runtime/model/moe.py)
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # a vector here, (1, dim) in HF
}
# Where an architecture's block names differ: Gemma 3's ffn_norm is the norm before the
# MLP, its post-attention norm its own tensor.
_ARCH_BLOCK_NAMES = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
}
# llama.cpp's converter stores Gemma's RMSNorm weights plus one (conversion/gemma.py,
# Gemma3Model.norm_shift); Hugging Face's (and ours) are without.
_NORM_SHIFT = {"gemma3": 1.0}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_BLOCK_INDEX_RE = re.compile(r"blk\.(\d+)\.")
# blk.N.<key>.weight stacks all experts, (n_expert, rows, cols) in torch order: expert E's
# slice is model.layers.N.mlp.experts.E.<value>.weight.
_STACKED_EXPERTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Older Mixtral files store each expert's matrix alone: blk.N.ffn_<gate|up|down>.E.weight.
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def _stacked(gguf_name: str) -> re.Match | None:
    """The _BLOCK_RE match of a stacked expert tensor's name, None for any other name."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    return m if m and m.group(2) in _STACKED_EXPERTS and m.group(3) == "weight" else None


def _unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (HF rotate-half -> interleaved pairs).

    convert_hf_to_gguf.py LlamaModel.permute writes
        w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    so GGUF row (h, j, s) holds HF row (h, s, j). HF row (h, s, j) is therefore GGUF row
    (h, j, s): index GGUF rows with arange viewed as (n_head, half, 2) swapped to (n_head, 2, half).
    """
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


# ---------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------


class GGUFFile:
    """A GGUF file: metadata as python values, tensors as views of one memory map."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.file_bytes = self.path.stat().st_size
        except OSError as err:
            raise InferError(f"{self.path}: cannot open GGUF file ({err.strerror})") from None
        if self.file_bytes < 4:
            raise InferError(f"{self.path}: not a GGUF file (only {self.file_bytes} bytes)")
        # Copy-on-write map (MAP_PRIVATE, as torch uses for mmapped checkpoints): the file is opened
        # read-only and never written, and torch.from_numpy gets a writable array, so
        # zero-copy tensors need no warning and an accidental in-place op copies a page
        # instead of faulting. Pages are read from disk only when touched.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        # Pages read from now on come in 2 MiB folios, mapped whole (runtime/files/hugepages.py).
        hugepages.advise(self._map)
        r = _HeaderReader(memoryview(self._map), self.path)

        magic = bytes(self._map[:4])
        if magic != GGUF_MAGIC:
            raise r.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        r.pos = 4
        self.version = r.u32("header")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise r.fail(
                f"unsupported GGUF version {self.version}{hint}; supported: "
                + ", ".join(map(str, SUPPORTED_VERSIONS))
            )
        n_tensors = r.u64("header")
        n_kv = r.u64("header")
        # Each key/value takes at least 13 bytes, each tensor info at least 32.
        if n_kv * 13 + n_tensors * 32 > self.file_bytes:
            raise r.fail(
                f"bad GGUF header: {n_kv} key/values and {n_tensors} tensors "
                f"cannot fit in {self.file_bytes} bytes"
            )

        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = r.string(f"key {i}")
            vtype = r.u32(f"key {key!r}")
            if key in self.metadata:
                raise r.fail(f"duplicate key {key!r}")
            self.metadata[key] = r.value(vtype, f"value of {key!r}")

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0:
            raise r.fail(f"bad general.alignment {self.alignment!r}")
        if self.alignment & (self.alignment - 1):
            raise r.fail(f"general.alignment {self.alignment} is not a power of two")

        infos = []  # (name, ggml_type, shape, relative offset)
        for i in range(n_tensors):
            name = r.string(f"tensor info {i}")
            what = f"tensor info of {name!r}"
            n_dims = r.u32(what)
            if not 1 <= n_dims <= MAX_DIMS:
                raise r.fail(f"tensor {name!r} has {n_dims} dims (GGUF allows 1 to {MAX_DIMS})")
            dims = [r.u64(what) for _ in range(n_dims)]
            if 0 in dims:
                raise r.fail(f"tensor {name!r} has a dimension of 0 ({dims})")
            raw_type = r.u32(what)
            offset = r.u64(what)
            try:
                ggml_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise r.fail(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            infos.append((name, ggml_type, tuple(reversed(dims)), offset))

        # Tensor data starts at the first aligned offset after the tensor infos.
        data_start = -(-r.pos // self.alignment) * self.alignment
        self.data_offset = data_start
        self.tensors: dict[str, GGUFTensor] = {}
        spans = []  # (start, end, name) in absolute file bytes
        for name, ggml_type, shape, offset in infos:
            if name in self.tensors:
                raise r.fail(f"duplicate tensor {name!r}")
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            if shape[-1] % block_size:
                raise r.fail(
                    f"tensor {name!r}: row length {shape[-1]} is not a multiple of the "
                    f"{ggml_type.name} block size {block_size}"
                )
            if offset % self.alignment:
                raise r.fail(
                    f"tensor {name!r}: data offset {offset} is not aligned to {self.alignment}"
                )
            n_elements = math.prod(shape)
            nbytes = n_elements // block_size * type_size
            start = data_start + offset
            if start + nbytes > self.file_bytes:
                raise r.fail(
                    f"truncated GGUF file: data of tensor {name!r} ends at byte "
                    f"{start + nbytes}, past the end of the file ({self.file_bytes} bytes)"
                )
            spans.append((start, start + nbytes, name))
            raw = self._map[start : start + nbytes]
            if ggml_type in PLAIN_DTYPES:
                data = raw.view(PLAIN_DTYPES[ggml_type]).reshape(shape)
            else:
                data = raw.reshape(block_bytes(ggml_type, shape))
            self.tensors[name] = GGUFTensor(name, ggml_type, shape, data, start)

        # Writers lay tensors back to back, each padded to the alignment: a gap means a
        # tensor's type or shape was changed to one that takes fewer bytes.
        spans.sort()
        for (_, prev_end, prev), (start, _, name) in itertools.pairwise(spans):
            if start < prev_end:
                raise r.fail(f"tensors {prev!r} and {name!r} overlap in the file")
            if start - prev_end >= self.alignment:
                raise r.fail(
                    f"{start - prev_end} bytes no tensor holds after {prev!r}: "
                    "its type or shape does not match its data"
                )
        if spans and (
            spans[0][0] != data_start or self.file_bytes - spans[-1][1] >= self.alignment
        ):
            where = "before the first" if spans[0][0] != data_start else "after the last"
            raise r.fail(
                f"bytes no tensor holds {where} tensor: a type or shape does not match its data"
            )

        # Blocks the tensors hold: blk.0 to blk.N-1 (what block_count must say).
        blocks = (_BLOCK_INDEX_RE.match(name) for name in self.tensors)
        self.n_blocks = max((int(m.group(1)) + 1 for m in blocks if m), default=0)

        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise r.fail("no general.architecture key")
        self.arch: str = arch
        # HF name -> (GGUF name, expert index into a stacked tensor or None)
        self._hf_to_gguf: dict[str, tuple[str, int | None]] | None = None

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, v{self.version}, arch={self.arch!r}, "
            f"{len(self.metadata)} keys, {len(self.tensors)} tensors)"
        )

    # --- Hugging Face view ------------------------------------------------------------

    def _key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    def _require(self, name: str) -> Any:
        value = self._key(name)
        if value is None:
            raise InferError(f"{self.path}: missing metadata key {self.arch}.{name}")
        return value

    def config(self) -> dict:
        """A Hugging Face config.json-style dict from the GGUF metadata. Values are as the
        file has them: ModelArgs.from_dict checks them, naming keys by `config_keys`."""
        if self.arch not in SUPPORTED_ARCHS:
            raise InferError(
                f"{self.path}: unsupported architecture {self.arch!r}; supported: "
                + ", ".join(SUPPORTED_ARCHS)
            )
        vocab_size = self._key("vocab_size")
        if vocab_size is None:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            if isinstance(tokens, list):
                vocab_size = len(tokens)
            elif "token_embd.weight" in self.tensors:
                vocab_size = self.tensors["token_embd.weight"].shape[0]
            else:
                raise InferError(f"{self.path}: cannot tell the vocabulary size")
        # Layers are counted by the tensors, which the file's size bounds.
        n_layers = self._require("block_count")
        if not isinstance(n_layers, int) or n_layers != self.n_blocks:
            raise InferError(
                f"{self.path}: {self.arch}.block_count = {shown(n_layers)}, "
                f"but the file has tensors for {self.n_blocks} blocks"
            )
        hidden = self._require("embedding_length")
        n_head = self._require("attention.head_count")
        head_dim = None  # from_dict says why when it cannot be had
        if (
            isinstance(hidden, int)
            and isinstance(n_head, int)
            and n_head > 0
            and hidden % n_head == 0
        ):
            head_dim = hidden // n_head
        n_expert = self._key("expert_count", 0)
        model_type = _MODEL_TYPES.get(self.arch, self.arch)
        architecture = SUPPORTED_ARCHS[self.arch]
        if self.arch == "llama" and n_expert:
            model_type, architecture = "mixtral", "MixtralForCausalLM"
        config = {
            "model_type": model_type,
            "architectures": [architecture],
            "hidden_size": hidden,
            "intermediate_size": self._require("feed_forward_length"),
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_head,
            "num_key_value_heads": self._key("attention.head_count_kv", n_head),
            "head_dim": self._key("attention.key_length", head_dim),
            "rms_norm_eps": _short_float(self._require("attention.layer_norm_rms_epsilon")),
            "rope_theta": _short_float(self._key("rope.freq_base", 10000.0)),
            "max_position_embeddings": self._require("context_length"),
            "vocab_size": vocab_size,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        if n_expert:
            config.update(self._moe_config(n_expert, n_layers))
        if self.arch == "gemma3":
            config.update(self._gemma3_config(n_layers, hidden, n_head))
        return config

    @property
    def config_keys(self) -> dict[str, str]:
        """config.json key -> the metadata key `config` took it from (for messages)."""
        return {hf: f"{self.arch}.{key}" for hf, key in _CONFIG_KEYS.items()} | _TOKENIZER_KEYS

    def _gemma3_config(self, n_layers: int, hidden: Any, n_head: Any) -> dict:
        """Gemma 3's keys, with llama.cpp's defaults (src/models/gemma3.cpp) for those a
        file leaves out: every 6th layer global, a local rope base of 10000, queries
        scaled by 1/sqrt(head_dim) (27B, 62 layers: 1/sqrt(hidden / heads))."""
        window = self._key("attention.sliding_window", 0)
        pattern = self._key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
            # every pattern-th layer global; 0: none
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
        elif isinstance(pattern, list) and [type(p) for p in pattern] == [bool] * n_layers:
            sliding = pattern  # one bool per layer
        else:
            raise InferError(
                f"{self.path}: {self.arch}.attention.sliding_window_pattern = {shown(pattern)}: "
                f"must be a layer count or one true/false for each of {n_layers} layers"
            )
        config = {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": window or None,  # from_dict checks it
            "layer_types": [
                "sliding_attention" if s and window else "full_attention" for s in sliding
            ],
            "rope_local_base_freq": _short_float(self._key("rope.freq_base_swa", 10000.0)),
            "final_logit_softcapping": _short_float(self._key("final_logit_softcapping")),
        }
        if n_layers == 62 and isinstance(hidden, int) and isinstance(n_head, int) and n_head > 0:
            config["query_pre_attn_scalar"] = hidden // n_head  # else head_dim's
        return config

    def _moe_config(self, n_expert: int, n_layers: int) -> dict:
        """The MoE keys of config.json. Which layers are sparse, and the expert widths,
        are read off the tensors where the metadata does not say."""
        sparse = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in self.tensors]
        if not sparse:
            raise InferError(f"{self.path}: expert_count is {n_expert} but no layer has a router")
        first = sparse[0]
        # Experts are counted by the router (one row each), as layers by the tensors.
        rows = self.tensors[f"blk.{first}.ffn_gate_inp.weight"].shape[0]
        if n_expert != rows:
            raise InferError(
                f"{self.path}: {self.arch}.expert_count = {shown(n_expert)}, "
                f"but the router of block {first} has {rows} rows"
            )
        gate = self.tensors.get(f"blk.{first}.ffn_gate_exps.weight")
        if gate is None:  # the older one-tensor-per-expert layout
            gate = self.tensors.get(f"blk.{first}.ffn_gate.0.weight")
        if gate is None:
            raise InferError(f"{self.path}: layer {first} has a router but no expert tensors")
        gating = self._key("expert_gating_func", 1)  # gguf.ExpertGatingFuncType.SOFTMAX
        scale = self._key("expert_weights_scale", 1.0)
        if gating != 1 or scale not in (0.0, 1.0):
            raise InferError(
                f"{self.path}: unsupported expert routing (gating function {gating}, "
                f"weights scale {scale}); supported: softmax, unscaled"
            )
        norm = self._key("expert_weights_norm")
        moe = {
            "num_experts": n_expert,
            "num_experts_per_tok": self._require("expert_used_count"),
            "moe_intermediate_size": self._key("expert_feed_forward_length", gate.shape[-2]),
            "norm_topk_prob": _NORM_TOPK_PROB[self.arch] if norm is None else norm,
            "mlp_only_layers": [i for i in range(n_layers) if i not in sparse],
        }
        shared = self.tensors.get(f"blk.{first}.ffn_up_shexp.weight")
        if shared is not None:
            moe["shared_expert_intermediate_size"] = self._key(
                "expert_shared_feed_forward_length", shared.shape[0]
            )
        return moe

    def _rope_scaling(self) -> dict | None:
        # Best effort: llama.cpp writes rope.scaling.{type,factor,original_context_length}
        # for linear and yarn. Llama 3.1-style scaling travels as the rope_freqs.weight tensor.
        kind = self._key("rope.scaling.type")
        factor = self._key("rope.scaling.factor")
        if kind not in ("linear", "yarn") or factor is None:
            return None
        scaling = {"rope_type": kind, "factor": _short_float(factor)}
        original = self._key("rope.scaling.original_context_length")
        if kind == "yarn" and original is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling

    def hf_name(self, gguf_name: str) -> str:
        """The Hugging Face parameter name of a GGUF tensor name (not a stacked one: see
        `hf_names`)."""
        if gguf_name in _TOP_LEVEL_NAMES:
            return _TOP_LEVEL_NAMES[gguf_name]
        m = _EXPERT_RE.fullmatch(gguf_name)
        if m is not None:
            layer, proj, expert = m.groups()
            return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
        if _stacked(gguf_name) is not None:
            raise InferError(f"{self.path}: {gguf_name!r} stacks experts: it has one name each")
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(self.arch, {})}
        m = _BLOCK_RE.fullmatch(gguf_name)
        if m is None or m.group(2) not in names:
            raise InferError(f"{self.path}: unsupported tensor {gguf_name!r}")
        layer, key, kind = m.groups()
        return f"model.layers.{layer}.{names[key]}.{kind}"

    def hf_names(self, gguf_name: str) -> list[str]:
        """The Hugging Face names of a tensor of this file: one per expert for a stacked
        MoE tensor, in expert order; otherwise the one `hf_name`."""
        m = _stacked(gguf_name)
        if m is None:
            return [self.hf_name(gguf_name)]
        shape = self.tensors[gguf_name].shape
        if len(shape) != 3:
            raise InferError(
                f"{self.path}: {gguf_name!r} has shape {shape}, not (experts, rows, cols)"
            )
        prefix = f"model.layers.{m.group(1)}.mlp.experts"
        return [f"{prefix}.{e}.{_STACKED_EXPERTS[m.group(2)]}.weight" for e in range(shape[0])]

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each Hugging Face name's shape as `hf_tensor` gives it, from the header alone.
        A tensor of an integer type, or a one-dim tensor (norm, bias) not in a float
        type, fails: no writer stores weights so, and it would load as garbage."""
        shapes = {}
        for name, t in self.tensors.items():
            if t.ggml_type in _INTEGER_TYPES or (len(t.shape) == 1 and t.ggml_type not in _FLOATS):
                raise InferError(
                    f"{self.path}: tensor {name!r} cannot be of type {t.ggml_type.name}"
                )
            stacked = _stacked(name) is not None
            for hf in self.hf_names(name):
                if hf in shapes:
                    raise InferError(f"{self.path}: two tensors for {hf!r}")
                if stacked:
                    shapes[hf] = t.shape[1:]
                elif name.endswith(".ffn_gate_inp_shexp.weight") and len(t.shape) == 1:
                    shapes[hf] = (1, *t.shape)  # see hf_tensor
                else:
                    shapes[hf] = t.shape
        return shapes

    def release(self, t: GGUFTensor) -> None:
        """Let the whole pages of `t`, copied elsewhere, go: they stop counting in this
        process's memory and are read from the file again if touched."""
        raw = getattr(self._map, "_mmap", None)
        if t.offset < 0 or raw is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = -(-t.offset // page) * page
        end = (t.offset + t.nbytes) // page * page
        if end > start:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def hf_tensor(self, hf_name: str) -> GGUFTensor:
        """The raw tensor for a Hugging Face name, still in its ggml type, q/k rows un-permuted,
        an expert's slice of a stacked tensor.

        Rows are whole runs of blocks (blocks run along the input dim), so reordering rows of
        quantized data, or taking one expert's rows, is lossless: the result can be imported
        block for block.
        """
        if self._hf_to_gguf is None:
            self._hf_to_gguf = {}
            for name in self.tensors:
                stacked = _stacked(name) is not None
                for e, hf in enumerate(self.hf_names(name)):
                    self._hf_to_gguf[hf] = (name, e if stacked else None)
        if hf_name not in self._hf_to_gguf:
            raise InferError(f"{self.path}: no tensor for {hf_name!r}")
        name, expert = self._hf_to_gguf[hf_name]
        t = self.tensors[name]
        if expert is not None:  # a view of the map: expert E's rows follow expert E-1's
            data = t.data[expert]
            return GGUFTensor(
                f"{name}[{expert}]", t.ggml_type, t.shape[1:], data, t.offset + expert * data.nbytes
            )
        if name.endswith(".ffn_gate_inp_shexp.weight") and len(t.shape) == 1:
            # Qwen2-MoE's shared expert gate: llama.cpp stores the (1, dim) Linear as a vector.
            return GGUFTensor(name, t.ggml_type, (1, *t.shape), t.data[None], t.offset)
        n_head = self._permuted_heads(t.name)
        if n_head is None:
            return t
        rows = t.shape[0]
        if t.data.shape[0] != rows or rows % (2 * n_head):
            raise InferError(
                f"{self.path}: cannot un-permute {t.name!r} of shape {t.shape} over {n_head} heads"
            )
        data = t.data[_unpermute_rows(rows, n_head)]
        return GGUFTensor(t.name, t.ggml_type, t.shape, data)

    def _permuted_heads(self, gguf_name: str) -> int | None:
        """Head count llama.cpp permuted this tensor's rows over, or None if it did not."""
        # Only the llama converter permutes (Mistral GGUFs are arch llama too); qwen2/3 do not.
        if self.arch != "llama":
            return None
        m = _BLOCK_RE.fullmatch(gguf_name)
        if m is None or m.group(2) not in ("attn_q", "attn_k"):
            return None
        n_head = self._require("attention.head_count")
        if m.group(2) == "attn_k":
            return self._key("attention.head_count_kv", n_head)
        return n_head

    def hf_state_dict(
        self, dtype: torch.dtype = torch.float32, skip: Container[str] = ()
    ) -> dict[str, torch.Tensor]:
        """All tensors by Hugging Face name but those in `skip`, dequantized to `dtype`,
        q/k un-permuted.

        Tensors already stored in `dtype` (e.g. F32 norms) share memory with the map.
        """
        self.config()  # fail early, with the list of supported architectures
        shift = _NORM_SHIFT.get(self.arch)
        state = {}
        for name in self.tensors:
            for hf in self.hf_names(name):
                if hf not in skip:
                    state[hf] = dequantize(self.hf_tensor(hf), dtype)
                    if shift and hf.endswith("norm.weight"):
                        state[hf] = state[hf] - shift
        return state


def _short_float(x: Any) -> Any:
    """A float32 metadata value as its shortest decimal (9.99999974738e-06 -> 1e-05), as
    config.json writes it; it rounds back to the same float32. Anything but a float is
    left for ModelArgs.from_dict to refuse."""
    if isinstance(x, float) and abs(x) <= np.finfo(np.float32).max:
        return float(str(np.float32(x)))
    return x
