"""ModelArgs: the architecture numbers of a Llama-family checkpoint, dense or mixture-of-experts.

Every number comes from the checkpoint (config.json, or GGUF metadata turned into
a config.json-style dict by `files.gguf_meta.GGUFMeta.config`); nothing is guessed from
a file or model name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ... import InferError

# model_type -> the variant fields it implies. Llama, Mistral, SmolLM (model_type
# llama), Qwen2 and Qwen3 differ only in these; one model file serves them all. The
# mixture-of-experts families add the MoE fields below (read in `_moe_args`).
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    "mixtral": {"norm_topk_prob": True},
    "qwen2_moe": {"attention_bias": True},
    "qwen3_moe": {"qk_norm": True},
    "olmoe": {"qk_norm": True, "qk_norm_full": True},
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


# Bounds on a config's numbers: past every published model, and small enough that a
# corrupt value fails here, not in a loop or an allocation sized by it.
MAX_VOCAB = 1 << 22
MAX_DIM = 1 << 16
MAX_HIDDEN = 1 << 18
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_EXPERTS = 4096
MAX_CONTEXT = 1 << 24
# rms_norm_eps: 1e-5 and 1e-6 in practice; 3 or 1e-30 would run, and answer otherwise
EPS_RANGE = (1e-12, 1e-2)
# rope_theta: 1e4 to 1e6 in practice (one 1M-context Llama has 3.6e9); 2 runs, as garbage
ROPE_THETA_RANGE = (100.0, 1e12)
MAX_ROPE_FACTOR = 1024.0


@dataclass
class ModelArgs:
    model_type: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    hidden_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_freq_factors: list[float] | None = None  # GGUF `rope_freqs` (baked llama3 scaling)
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    qk_norm_full: bool = False  # OLMoE: ... over the whole projection instead of per head
    sliding_window: int | None = None  # Mistral v0.1
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # Mixture of experts (runtime/model/moe.py); n_experts = 0 is a dense model.
    n_experts: int = 0
    n_experts_per_tok: int = 0  # top-k
    moe_hidden_dim: int = 0  # intermediate size of each routed expert
    norm_topk_prob: bool = False  # renormalise the k router weights to sum to 1
    shared_expert_dim: int = 0  # Qwen2-MoE: an expert every token takes, sigmoid-gated
    decoder_sparse_step: int = 1  # Qwen2/3-MoE: layers i with (i + 1) % step == 0 are sparse
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these (dense)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer `i` has a sparse MoE block (else a dense MLP), as transformers'
        Qwen2MoeDecoderLayer decides."""
        return (
            self.n_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, cfg: dict, origin: str = "config", names: dict | None = None) -> ModelArgs:
        """Build from a Hugging Face config.json dict, keeping only known keys.

        Every number is checked (type, range, consistency) before anything is sized by
        it; a bad one fails as "<origin>: <key> = <value>: <problem>", `names` giving the
        file's own name for a key where it differs (a GGUF file's)."""
        c = config_fields(cfg, origin, names)
        model_type = cfg.get("model_type", "")
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            name = model_type or cfg.get("architectures")
            raise InferError(
                f"{origin}: unsupported architecture {shown(name)} (supported: {', '.join(FAMILIES)})"
            )
        args = {"model_type": model_type, **base_args(c)}
        if cfg.get("hidden_act", "silu") not in ("silu", "swish") or cfg.get("mlp_bias"):
            raise InferError(
                f"{origin}: unsupported MLP (hidden_act={shown(cfg.get('hidden_act'))}, "
                f"mlp_bias={shown(cfg.get('mlp_bias'))})"
            )
        # transformers >= 5 keeps rope settings in `rope_parameters`; older
        # configs have `rope_theta` and `rope_scaling` at the top level.
        rope = c.sub("rope_parameters")
        theta = c.float("rope_theta", *ROPE_THETA_RANGE, default=10000.0, open_low=False)
        args["rope_theta"] = rope.float(
            "rope_theta", *ROPE_THETA_RANGE, default=theta, open_low=False
        )
        args["rope_scaling"] = rope_scaling(
            c.sub("rope_scaling") if c.dict("rope_scaling") else rope
        )
        args.update(FAMILIES[model_type])
        if model_type in MOE_FAMILIES:
            args.update(_moe_args(c, model_type, args["n_layers"]))
        if "attention_bias" in cfg:
            args["attention_bias"] = c.bool("attention_bias", False)
        if "qkv_bias" in cfg:  # Qwen2-MoE's name for it
            args["attention_bias"] = c.bool("qkv_bias", False)
        default_window = model_type in ("mistral", "mixtral")
        if cfg.get("sliding_window") and c.bool("use_sliding_window", default_window):
            args["sliding_window"] = c.int("sliding_window", 1, MAX_CONTEXT)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in known})

    @property
    def n_params(self) -> int:
        """Parameter count, every expert included (embeddings counted once when tied)."""
        return self._count_params(self.n_experts)

    @property
    def n_active_params(self) -> int:
        """Parameters a token uses: as n_params with top-k routed experts per MoE layer."""
        return self._count_params(self.n_experts_per_tok)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def _count_params(self, experts: int) -> int:
        shapes = self.param_shapes()
        if self.tie_embeddings:
            del shapes["lm_head.weight"]
        unused = (self.n_experts - experts) * 3 * self.dim * self.moe_hidden_dim
        return sum(math.prod(s) for s in shapes.values()) - unused * self.n_moe_layers

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every parameter of the model these numbers build, by state-dict
        name: what a checkpoint's tensors must be (the output layer's too, which a tied
        model need not store). tests/test_model.py checks it against the modules."""
        shapes = {"embed_tokens.weight": (self.vocab_size, self.dim)}
        for i in range(self.n_layers):
            shapes.update(self._layer_shapes(i, f"layers.{i}."))
        shapes["norm.weight"] = (self.dim,)
        shapes["lm_head.weight"] = (self.vocab_size, self.dim)
        return shapes

    def _layer_shapes(self, i: int, p: str) -> dict[str, tuple[int, ...]]:
        d, q, kv = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
        }
        if self.attention_bias:
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        if self.qk_norm:  # per head, or over the whole projection (qk_norm_full)
            shapes[p + "self_attn.q_norm.weight"] = (q if self.qk_norm_full else self.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (kv if self.qk_norm_full else self.head_dim,)
        if not self.is_moe_layer(i):
            return shapes | _mlp_shapes(p + "mlp.", d, self.hidden_dim)
        shapes[p + "mlp.gate.weight"] = (self.n_experts, d)
        for e in range(self.n_experts):
            shapes |= _mlp_shapes(f"{p}mlp.experts.{e}.", d, self.moe_hidden_dim)
        if self.shared_expert_dim:
            shapes |= _mlp_shapes(p + "mlp.shared_expert.", d, self.shared_expert_dim)
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, d)
        return shapes


def _mlp_shapes(p: str, dim: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        p + "gate_proj.weight": (hidden, dim),
        p + "up_proj.weight": (hidden, dim),
        p + "down_proj.weight": (dim, hidden),
    }


def config_fields(cfg: dict, origin: str = "config", names: dict | None = None) -> _Fields:
    """`cfg`'s keys for checked reads, failing as "<origin>: <key> = <value>: <problem>"
    (see ModelArgs.from_dict)."""
    if not isinstance(cfg, dict):
        raise InferError(f"{origin}: not a config object ({type(cfg).__name__})")
    return _Fields(cfg, origin, names or {})


def base_args(c: _Fields) -> dict:
    """The ModelArgs fields every family's config.json spells the same way, checked."""
    dim = c.int("hidden_size", 1, MAX_DIM)
    n_heads = c.int("num_attention_heads", 1, MAX_HEADS)
    n_kv_heads = c.int("num_key_value_heads", 1, n_heads, default=n_heads)
    if n_heads % n_kv_heads:
        raise c.fail("num_key_value_heads", n_kv_heads, f"does not divide {n_heads} heads")
    if c.cfg.get("head_dim") is None and dim % n_heads:
        raise c.fail("hidden_size", dim, f"is not a multiple of {n_heads} heads")
    head_dim = c.int("head_dim", 2, MAX_HEAD_DIM, default=dim // n_heads)
    if head_dim % 2:
        raise c.fail("head_dim", head_dim, "is odd (rope rotates pairs)")
    n_layers = c.int("num_hidden_layers", 1, MAX_LAYERS)
    eos = c.cfg.get("eos_token_id")
    eos = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    return {
        "vocab_size": c.int("vocab_size", 1, MAX_VOCAB),
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_dim": c.int("intermediate_size", 1, MAX_HIDDEN),
        "norm_eps": c.float("rms_norm_eps", *EPS_RANGE, default=1e-6, open_low=False),
        "max_seq_len": c.int("max_position_embeddings", 1, MAX_CONTEXT, default=4096),
        "tie_embeddings": c.bool("tie_word_embeddings", False),
        "bos_token_id": c.int("bos_token_id", 0, MAX_VOCAB, default=None),
        "eos_token_id": [c.int_value("eos_token_id", e, 0, MAX_VOCAB) for e in eos],
    }


def _moe_args(c: _Fields, model_type: str, n_layers: int) -> dict:
    """The MoE fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config.json, with
    transformers' defaults for keys a config leaves out."""
    # transformers 5 writes num_local_experts for every family; hub configs of Qwen
    # and OLMoE models say num_experts.
    key = "num_local_experts" if c.cfg.get("num_local_experts") else "num_experts"
    n_experts = c.int(key, 0, MAX_EXPERTS, default=0)
    moe = {
        "n_experts": n_experts,
        "n_experts_per_tok": c.int("num_experts_per_tok", 1, n_experts) if n_experts else 0,
        # Mixtral and OLMoE experts are intermediate_size wide; Qwen's have their own.
        "moe_hidden_dim": c.int(
            "moe_intermediate_size",
            1,
            MAX_HIDDEN,
            default=c.int("intermediate_size", 1, MAX_HIDDEN),
        ),
        "decoder_sparse_step": c.int("decoder_sparse_step", 1, n_layers, default=1),
        "mlp_only_layers": [
            c.int_value("mlp_only_layers", i, 0, n_layers - 1) for i in c.list("mlp_only_layers")
        ],
    }
    if model_type != "mixtral":  # Mixtral always renormalises (see FAMILIES)
        moe["norm_topk_prob"] = c.bool("norm_topk_prob", False)
    if model_type == "qwen2_moe" and n_experts:
        moe["shared_expert_dim"] = c.int("shared_expert_intermediate_size", 0, MAX_HIDDEN)
    if model_type == "olmoe" and c.cfg.get("clip_qkv") is not None:
        raise InferError(
            f"{c.origin}: unsupported OLMoE variant (clip_qkv={shown(c.cfg['clip_qkv'])})"
        )
    return moe


def rope_scaling(s: _Fields) -> dict | None:
    """The rope scaling a config's `rope_scaling` (or `rope_parameters`) object asks for,
    its numbers checked; None for plain rope."""
    scaling = s.cfg
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        if "factor" in scaling:  # a scaling that does not say which
            raise s.fail("factor", scaling["factor"], "given with no rope_type")
        return None
    if rope_type not in ("llama3", "linear"):
        raise InferError(f"{s.origin}: unsupported rope scaling {shown(rope_type)}")
    # Every number is required, as transformers reads them: a default would be a guess.
    checked = dict(
        scaling,
        rope_type=rope_type,
        factor=s.float("factor", 1.0, MAX_ROPE_FACTOR, open_low=False),
    )
    if rope_type == "llama3":
        low = s.float("low_freq_factor", 0.0, MAX_ROPE_FACTOR)
        high = s.float("high_freq_factor", 0.0, MAX_ROPE_FACTOR)
        if high <= low:
            raise s.fail("high_freq_factor", high, f"must be more than low_freq_factor {low}")
        checked.update(
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=s.int(
                "original_max_position_embeddings", 1, MAX_CONTEXT
            ),
        )
    return checked


class _Fields:
    """Typed reads of a config's keys, each failing in one line that names the key
    (`names`: the file's name for it) and the value."""

    def __init__(self, cfg: dict, origin: str, names: dict, prefix: str = ""):
        self.cfg, self.origin, self.names, self.prefix = cfg, origin, names, prefix

    def name(self, key: str) -> str:
        return self.names.get(self.prefix + key, self.prefix + key)

    def fail(self, key: str, value, problem: str) -> InferError:
        return InferError(f"{self.origin}: {self.name(key)} = {shown(value)}: {problem}")

    def get(self, key: str, default):
        value = self.cfg.get(key)
        if value is None and default is ...:
            raise InferError(f"{self.origin}: missing {self.name(key)}")
        return value

    def int(self, key: str, lo: int, hi: int, default=...):
        value = self.get(key, default)
        return default if value is None else self.int_value(key, value, lo, hi)

    def int_value(self, key: str, value, lo: int, hi: int) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 4096.0 in a hand-written config.json
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(key, value, "must be an integer")
        if not lo <= value <= hi:
            raise self.fail(key, value, f"must be {lo} to {hi}")
        return value

    def float(self, key: str, lo: float, hi: float, default=..., open_low=True) -> float:
        """A finite number at most `hi` and more than `lo` (at least `lo`: not open_low)."""
        value = self.get(key, default)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(key, value, "must be a number")
        low_ok = lo < value if open_low else lo <= value
        if not (low_ok and value <= hi):  # NaN fails too
            low = f"more than {lo:g}" if open_low else f"at least {lo:g}"
            raise self.fail(key, value, f"must be {low} and at most {hi:g}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.fail(key, value, "must be true or false")
        return default if value is None else value

    def dict(self, key: str) -> dict:
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, dict):
            raise self.fail(key, value, "must be an object")
        return value or {}

    def sub(self, key: str) -> _Fields:
        """The object under `key` (empty if none), its keys named "<key>.<name>"."""
        return _Fields(self.dict(key), self.origin, self.names, f"{self.prefix}{key}.")

    def list(self, key: str) -> list:
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, list):
            raise self.fail(key, value, "must be a list")
        return value or []


def shown(value) -> str:
    """A value for a one-line message: its repr, cut at 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_rope_freq_factors(factors: list[float], head_dim: int, origin: str) -> None:
    """A Llama 3.1 GGUF's rope factors: one per frequency, each finite and positive
    (rope_inv_freq divides by them)."""
    if len(factors) != head_dim // 2:
        raise InferError(
            f"{origin}: rope_freqs has {len(factors)} factors; head_dim {head_dim} needs {head_dim // 2}"
        )
    for i, f in enumerate(factors):
        if not 0 < f <= MAX_ROPE_FACTOR:  # NaN fails too
            raise InferError(
                f"{origin}: rope_freqs[{i}] = {f}: must be more than 0 and at most {MAX_ROPE_FACTOR:g}"
            )
