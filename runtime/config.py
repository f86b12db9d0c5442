"""ModelArgs: the architecture numbers of a dense Llama-family checkpoint.

Every number comes from the checkpoint (config.json, or GGUF metadata turned into
a config.json-style dict by `gguf_file.GGUFFile.config`); nothing is guessed from
a file or model name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .errors import InferError

# model_type -> the variant fields it implies. Llama, Mistral, SmolLM (model_type
# llama), Qwen2 and Qwen3 differ only in these; one model file serves them all.
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
}


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
    sliding_window: int | None = None  # Mistral v0.1
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelArgs:
        """Build from a Hugging Face config.json dict, keeping only known keys."""
        model_type = cfg.get("model_type", "")
        if model_type not in FAMILIES:
            raise InferError(
                f"unsupported architecture '{model_type or cfg.get('architectures')}'"
                f" (supported: {', '.join(FAMILIES)})"
            )
        try:
            dim = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            args = dict(
                model_type=model_type,
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
        if cfg.get("hidden_act", "silu") not in ("silu", "swish") or cfg.get("mlp_bias"):
            raise InferError(
                f"unsupported MLP (hidden_act={cfg.get('hidden_act')}, mlp_bias={cfg.get('mlp_bias')})"
            )
        # transformers >= 5 keeps rope settings in `rope_parameters`; older
        # configs have `rope_theta` and `rope_scaling` at the top level.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or rope
        args["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise InferError(f"unsupported rope scaling '{rope_type}'")
        args["rope_scaling"] = (
            dict(scaling, rope_type=rope_type) if rope_type != "default" else None
        )
        args.update(FAMILIES[model_type])
        if "attention_bias" in cfg:
            args["attention_bias"] = bool(cfg["attention_bias"])
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
            args["sliding_window"] = int(cfg["sliding_window"])
        args["bos_token_id"] = cfg.get("bos_token_id")
        eos = cfg.get("eos_token_id")
        args["eos_token_id"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in known})

    @property
    def n_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attention_bias:
            attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.hidden_dim
        norms = 2 * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + norms) + embed + self.dim


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
