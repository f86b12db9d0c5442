"""Gemma3Args: the architecture numbers of a Gemma 3 (text) checkpoint, read from its
config.json as ModelArgs reads a Llama's; gemma3.py is the model they build."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ... import InferError
from .config import (
    MAX_CONTEXT,
    MAX_DIM,
    MAX_LAYERS,
    ROPE_THETA_RANGE,
    ModelArgs,
    base_args,
    config_fields,
    rope_scaling,
    shown,
)

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # config.json's layer types
MAX_SOFTCAP = 1e4  # final_logit_softcapping: Gemma 2's is 30


@dataclass
class Gemma3Args(ModelArgs):
    model_type: str = "gemma3_text"
    rope_local_theta: float = 10000.0  # the sliding layers' rope base (never scaled)
    sliding_layers: list[bool] = field(default_factory=list)  # per layer: local attention
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, cfg: dict, origin: str = "config", names: dict | None = None) -> Gemma3Args:
        """From a Gemma3TextConfig dict: transformers 5's (`layer_types`, `rope_parameters`
        per layer type) or the older hub form (`sliding_window_pattern`, `rope_theta`,
        `rope_local_base_freq`, `rope_scaling`). Every number is checked, and a bad one
        fails, as ModelArgs.from_dict says."""
        c = config_fields(cfg, origin, names)
        args = {"model_type": "gemma3_text", **base_args(c)}
        act_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        act = cfg.get(act_key)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise c.fail(act_key, act, "unsupported (Gemma 3's MLP is the tanh GELU)")
        if cfg.get("attn_logit_softcapping") or cfg.get("use_bidirectional_attention"):
            raise InferError(
                f"{origin}: unsupported Gemma 3 variant (attn_logit_softcapping="
                f"{shown(cfg.get('attn_logit_softcapping'))}, use_bidirectional_attention="
                f"{shown(cfg.get('use_bidirectional_attention'))})"
            )
        n = args["n_layers"]
        if cfg.get("layer_types") is None:  # every pattern-th layer global
            pattern = c.int("sliding_window_pattern", 1, MAX_LAYERS, default=6)
            types = [LOCAL if (i + 1) % pattern else GLOBAL for i in range(n)]
        else:
            types = c.list("layer_types")
            if len(types) != n:
                raise c.fail("layer_types", types, f"has {len(types)} entries for {n} layers")
            for t in types:
                if t not in (LOCAL, GLOBAL):
                    raise c.fail("layer_types", t, f"must be {LOCAL!r} or {GLOBAL!r}")
        # transformers 5: one rope object per layer type; older configs: top-level keys.
        rope = c.sub("rope_parameters")
        full, local = rope.sub(GLOBAL), rope.sub(LOCAL)
        theta = c.float("rope_theta", *ROPE_THETA_RANGE, default=1e6, open_low=False)
        local_theta = c.float(
            "rope_local_base_freq", *ROPE_THETA_RANGE, default=10000.0, open_low=False
        )
        if rope_scaling(local) is not None:
            raise InferError(f"{origin}: unsupported rope scaling on Gemma 3's sliding layers")
        window = c.int("sliding_window", 1, MAX_CONTEXT) if cfg.get("sliding_window") else None
        scalar = c.float("query_pre_attn_scalar", 0.0, MAX_DIM, default=float(args["head_dim"]))
        cap = c.float("final_logit_softcapping", 0.0, MAX_SOFTCAP, default=None, open_low=False)
        args.update(
            rope_theta=full.float("rope_theta", *ROPE_THETA_RANGE, default=theta, open_low=False),
            rope_scaling=rope_scaling(c.sub("rope_scaling") if c.dict("rope_scaling") else full),
            rope_local_theta=local.float(
                "rope_theta", *ROPE_THETA_RANGE, default=local_theta, open_low=False
            ),
            sliding_window=window,
            sliding_layers=[t == LOCAL for t in types],
            qk_norm=True,
            query_pre_attn_scalar=scalar,
            final_logit_softcapping=cap or None,  # 0: no cap
            tie_embeddings=c.bool("tie_word_embeddings", True),
        )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in known})

    def _layer_shapes(self, i: int, p: str) -> dict[str, tuple[int, ...]]:
        # Llama's, and the norms before and after the MLP
        norms = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
        return super()._layer_shapes(i, p) | {p + n: (self.dim,) for n in norms}
