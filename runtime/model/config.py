"""ModelArgs: the architecture numbers of a Llama-family checkpoint, dense or mixture-of-experts.

Every number comes from the checkpoint (config.json, or GGUF metadata turned into
a config.json-style dict by `files.gguf.GGUFFile.config`); nothing is guessed from
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
    def from_dict(cls, cfg: dict) -> ModelArgs:
        """Build from a Hugging Face config.json dict, keeping only known keys."""
        model_type = cfg.get("model_type", "")
        if model_type not in FAMILIES:
            raise InferError(
                f"unsupported architecture '{model_type or cfg.get('architectures')}'"
                f" (supported: {', '.join(FAMILIES)})"
            )
        args = base_args(cfg)
        if cfg.get("hidden_act", "silu") not in ("silu", "swish") or cfg.get("mlp_bias"):
            raise InferError(
                f"unsupported MLP (hidden_act={cfg.get('hidden_act')}, mlp_bias={cfg.get('mlp_bias')})"
            )
        # transformers >= 5 keeps rope settings in `rope_parameters`; older
        # configs have `rope_theta` and `rope_scaling` at the top level.
        rope = dict(cfg.get("rope_parameters") or {})
        args["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        args["rope_scaling"] = rope_scaling(cfg.get("rope_scaling") or rope)
        args.update(FAMILIES[model_type])
        if model_type in MOE_FAMILIES:
            args.update(_moe_args(cfg, model_type))
        if "attention_bias" in cfg:
            args["attention_bias"] = bool(cfg["attention_bias"])
        if "qkv_bias" in cfg:  # Qwen2-MoE's name for it
            args["attention_bias"] = bool(cfg["qkv_bias"])
        default_window = model_type in ("mistral", "mixtral")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", default_window):
            args["sliding_window"] = int(cfg["sliding_window"])
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
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention_bias:
            attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        norms = 2 * self.dim
        if self.qk_norm:
            norms += self.head_dim * (self.n_heads + self.n_kv_heads if self.qk_norm_full else 2)
        mlps = 0
        for i in range(self.n_layers):
            if not self.is_moe_layer(i):
                mlps += 3 * self.dim * self.hidden_dim
                continue
            mlps += self.n_experts * self.dim + experts * 3 * self.dim * self.moe_hidden_dim
            if self.shared_expert_dim:
                mlps += self.dim + 3 * self.dim * self.shared_expert_dim
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + norms) + mlps + embed + self.dim


def base_args(cfg: dict) -> dict:
    """The ModelArgs fields every family's config.json spells the same way."""
    try:
        dim = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        args = dict(
            model_type=cfg.get("model_type", ""),
            vocab_size=int(cfg["vocab_size"]),
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            hidden_dim=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InferError(f"config is missing or has a bad value for {e}") from None
    args["bos_token_id"] = cfg.get("bos_token_id")
    eos = cfg.get("eos_token_id")
    args["eos_token_id"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return args


def rope_scaling(scaling: dict | None) -> dict | None:
    """A config's rope scaling dict with its `rope_type` spelled out; None for none."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise InferError(f"unsupported rope scaling '{rope_type}'")
    return dict(scaling, rope_type=rope_type) if rope_type != "default" else None


def _moe_args(cfg: dict, model_type: str) -> dict:
    """The MoE fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config.json, with
    transformers' defaults for keys a config leaves out."""
    try:
        # transformers 5 writes num_local_experts for every family; hub configs of Qwen
        # and OLMoE models say num_experts.
        n_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        moe = {
            "n_experts": n_experts,
            "n_experts_per_tok": int(cfg["num_experts_per_tok"]) if n_experts else 0,
            # Mixtral and OLMoE experts are intermediate_size wide; Qwen's have their own.
            "moe_hidden_dim": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
            "mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []],
        }
        if model_type != "mixtral":  # Mixtral always renormalises (see FAMILIES)
            moe["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", False))
        if model_type == "qwen2_moe" and n_experts:
            moe["shared_expert_dim"] = int(cfg["shared_expert_intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise InferError(f"config is missing or has a bad value for {e}") from None
    if n_experts and not 0 < moe["n_experts_per_tok"] <= n_experts:
        raise InferError(
            f"num_experts_per_tok {moe['n_experts_per_tok']} must be 1 to {n_experts} (num_experts)"
        )
    if model_type == "olmoe" and cfg.get("clip_qkv") is not None:
        raise InferError(f"unsupported OLMoE variant (clip_qkv={cfg['clip_qkv']})")
    return moe


def rope_inv_freq(args: ModelArgs):
    """Inverse frequencies (head_dim // 2,), with llama3 or linear scaling applied."""
    import torch

    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
    )
    if args.rope_freq_factors is not None:
        return inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float64)
    s = args.rope_scaling
    if s is None:
        return inv_freq
    factor = float(s.get("factor", 1.0))
    if s["rope_type"] == "linear":
        return inv_freq / factor
    # llama3 (Llama 3.1/3.2): keep high frequencies, divide low ones by `factor`,
    # interpolate smoothly between (transformers' _compute_llama3_parameters).
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, out)
