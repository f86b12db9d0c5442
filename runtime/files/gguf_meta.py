"""A GGUF header read as a Hugging Face checkpoint: the config.json its metadata amounts
to, and each tensor's Hugging Face name and shape. No torch, no numpy: `infer info`
describes a GGUF file with this alone; gguf.GGUFFile adds the tensors' data.
"""

from __future__ import annotations

import re
import struct
from typing import Any

from ... import InferError
from ..model.config import shown
from .ggml_types import GGMLType
from .gguf_header import GGUFHeader

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
_FLOATS = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
_INTEGER_TYPES = (GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64)
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
_F32 = struct.Struct("<f")
_FLOAT32_MAX = 3.4028234663852886e38

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
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
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


# ---------------------------------------------------------------------------------------
# The header as a Hugging Face checkpoint
# ---------------------------------------------------------------------------------------


class GGUFMeta(GGUFHeader):
    """A GGUF file's header, read as a Hugging Face checkpoint's config.json and names."""

    # HF name -> (GGUF name, expert index into a stacked tensor or None), once asked for
    _hf_to_gguf: dict[str, tuple[str, int | None]] | None = None

    def _key(self, name: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{name}", default)

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
            vocab_size = self.count("tokenizer.ggml.tokens")  # the tokens, not decoded
        if vocab_size is None:
            if "token_embd.weight" not in self.tensors:
                raise InferError(f"{self.path}: cannot tell the vocabulary size")
            vocab_size = self.tensors["token_embd.weight"].shape[0]
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
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.get("tokenizer.ggml.eos_token_id"),
        }
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        pooling = POOLING_TYPES.get(self._key("pooling_type"))
        if pooling is not None:  # an embedding model's (llama.cpp's enum); not a config.json key
            config["pooling"] = pooling
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

    def gguf_name(self, hf_name: str) -> tuple[str, int | None]:
        """The GGUF tensor a Hugging Face name is, and the expert it is of a stacked tensor
        (None for any other)."""
        if self._hf_to_gguf is None:
            self._hf_to_gguf = {}
            for name in self.tensors:
                stacked = _stacked(name) is not None
                for e, hf in enumerate(self.hf_names(name)):
                    self._hf_to_gguf[hf] = (name, e if stacked else None)
        if hf_name not in self._hf_to_gguf:
            raise InferError(f"{self.path}: no tensor for {hf_name!r}")
        return self._hf_to_gguf[hf_name]

    def permuted_heads(self, gguf_name: str) -> int | None:
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


# {arch}.pooling_type -> how an embedding is pooled from the last states (llama.h's
# llama_pooling_type; 0 "none" and 4 "rank" have no single vector).
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}


def _short_float(x: Any) -> Any:
    """A float32 metadata value as its shortest decimal (9.99999974738e-06 -> 1e-05), as
    config.json writes it; it rounds back to the same float32. Anything but a float is
    left for ModelArgs.from_dict to refuse."""
    if not isinstance(x, float) or not abs(x) <= _FLOAT32_MAX:
        return x
    for digits in range(1, 10):  # 9 significant digits round-trip every float32
        y = float(f"{x:.{digits}g}")
        if _F32.unpack(_F32.pack(y))[0] == x:
            return y
    return x
