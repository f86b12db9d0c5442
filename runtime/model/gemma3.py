"""Gemma 3 (text): the Llama block with Gemma's changes, as its own family.

- RMSNorm scales by (1 + weight), in float32 before casting back;
- four norms per block: before and after attention, before and after the MLP;
- q/k RMSNorm per head; queries scaled by query_pre_attn_scalar ** -0.5;
- layers alternate sliding-window (local) and full (global) attention, each kind with
  its own rope base (and only the global one scaled);
- GeGLU MLP with the tanh GELU; embeddings scaled by sqrt(dim); tied output layer;
  an optional final logit softcap.

Reference: transformers' models/gemma3/modeling_gemma3.py (Gemma3ForCausalLM), which
tests/test_model.py checks this file against. The fused decode step (fused_decode.py)
runs these blocks too, from what Block.norm_weights, layer_rope, mlp_act and attn_scale
tell it; Block.forward is its definition.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels_cpu import ops
from ...quant.formats.base import QuantLinear
from . import kvcache, llama
from .gemma3_config import Gemma3Args
from .kvcache import KVCache
from .llama import _LINEARS, Rows, last_rows, rope_rows, rows_apply
from .rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Attention(llama.Attention):
    """llama.Attention with q/k norms per head, its own score scale and window per layer."""

    def __init__(self, args: Gemma3Args, layer: int):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.sliding_window = args.sliding_window if args.sliding_layers[layer] else None
        self.scale = args.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def project(self, x: torch.Tensor):
        """q (1, T, H, D), k and v (1, T, n_kv, D) of x (1, T, dim), q and k normed."""
        T = x.shape[1]
        q = self.q_norm(self.q_proj(x).view(1, T, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(1, T, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(1, T, self.n_kv_heads, self.head_dim)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, args: Gemma3Args):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: Gemma3Args, layer: int):
        super().__init__()
        self.sliding = args.sliding_layers[layer]
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)
        self.post_feedforward_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, pos: int, cos, sin, cache: KVCache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), pos, cos, sin, cache)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def norm_weights(self) -> tuple:
        """The fused step's norm weights as llama.Block.norm_weights gives them: 1 + w,
        in float32 as RMSNorm.forward adds it."""
        a = self.self_attn
        norms = (self.input_layernorm, self.pre_feedforward_layernorm, a.q_norm, a.k_norm,
                 self.post_attention_layernorm, self.post_feedforward_layernorm)  # fmt: skip
        return tuple(1.0 + n.weight.float() for n in norms)


class Gemma3(nn.Module):
    """The model: the same interface as llama.Transformer (forward, embed, head, new_cache,
    setup_rope, sanitize, runs_on_kernels)."""

    mlp_act = "gelu_tanh"  # the fused step's activation
    kv_cache = None  # new_cache's default kind, as llama.Transformer's

    def __init__(self, args: Gemma3Args):
        super().__init__()
        self.args = args
        self.attn_scale = args.query_pre_attn_scalar**-0.5
        # Zeros, not a random init (see llama.Transformer); the checkpoint assigns it.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.zeros(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_seq_len = 0

    @staticmethod
    def sanitize(state_dict: dict, args: Gemma3Args) -> dict:
        """Checkpoint names onto ours: drop the `model.` prefix and rope buffers."""
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        return {k: v for k, v in sd.items() if "rotary_emb" not in k}

    def setup_rope(self, max_seq_len: int, dtype: torch.dtype) -> None:
        """Rope tables for both layer kinds, (max_seq_len, head_dim) each."""
        self.max_seq_len = max_seq_len
        local = dataclasses.replace(
            self.args, rope_theta=self.args.rope_local_theta, rope_scaling=None
        )
        for kind, a in (("global", self.args), ("local", local)):
            cos, sin = rope_tables(a, max_seq_len, dtype)
            self.register_buffer(f"{kind}_cos", cos, persistent=False)
            self.register_buffer(f"{kind}_sin", sin, persistent=False)

    def layer_rope(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Layer i's rope tables and sliding window (the fused step's)."""
        if self.layers[i].sliding:
            return self.local_cos, self.local_sin, self.args.sliding_window
        return self.global_cos, self.global_sin, None

    def new_cache(self, max_seq_len: int | None = None, kind: str | None = None) -> list[KVCache]:
        """An empty KV cache for one sequence (see llama.Transformer.new_cache)."""
        n = min(max_seq_len or self.max_seq_len, self.max_seq_len)
        kind = kind or self.kv_cache or kvcache.float_kind(self.global_cos.dtype)
        a = self.args
        return kvcache.new_cache(kind, len(self.layers), a.n_kv_heads, n, a.head_dim)

    def runs_on_kernels(self) -> bool:
        """Whether every projection and the output layer run on the C kernels."""
        linears = [m for name, m in self.named_modules() if name.rpartition(".")[2] in _LINEARS]
        return ops.available() and all(isinstance(m, QuantLinear) for m in linears)

    def forward(
        self, tokens: torch.Tensor, pos: int, cache: list[KVCache] | Rows,
        all_logits: bool = False, blocks=None, states: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """tokens (1, T) at positions [pos, pos + T) -> logits (1, T or 1, vocab), or the
        final norm's states, as llama.Transformer.forward."""
        x = self.embed(tokens)
        if blocks is not None:
            x = blocks(x, pos)
        else:
            T = tokens.shape[1]
            rope = {
                False: rope_rows(self.global_cos, self.global_sin, pos, T, cache),
                True: rope_rows(self.local_cos, self.local_sin, pos, T, cache),
            }
            for layer, layer_cache in zip(self.layers, cache):
                x = layer(x, pos, *rope[layer.sliding], layer_cache)
        return self.norm(x) if states else self.head(x, cache, all_logits)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The states (1, T, dim) the first block takes: scaled by sqrt(dim)."""
        dtype = self.global_cos.dtype
        # The scale rounded to the compute dtype first, as transformers does.
        return self.embed_tokens(tokens).to(dtype) * torch.tensor(self.args.dim**0.5, dtype=dtype)

    def head(self, x: torch.Tensor, cache, all_logits: bool) -> torch.Tensor:
        """Logits of the last block's states, soft-capped (llama.Transformer.head)."""
        if not all_logits:
            x = last_rows(x, cache)
        logits = rows_apply(lambda h: self.lm_head(self.norm(h)), x, cache)
        cap = self.args.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
