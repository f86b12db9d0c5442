"""The dense Llama family: Llama 2/3.x, Mistral, SmolLM/SmolLM2, Qwen2/2.5, Qwen3.

Plain nn.Modules with Hugging Face parameter names, so a safetensors state dict
loads without a table (the `model.` prefix is dropped in `sanitize`). Variants are
ModelArgs fields: qkv bias (Qwen2), q/k RMSNorm (Qwen3), GQA, tied embeddings,
rope scaling, sliding window.

Batch size is 1: this runtime serves one conversation. Shapes below use
T = tokens in this call, S = positions visible to attention.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels_cpu import ops
from ...quant.formats.base import QuantLinear
from .config import ModelArgs, rope_inv_freq
from .moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the compute dtype, as the reference does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    """Preallocated keys and values for one layer: (1, n_kv_heads, max_seq_len, head_dim)."""

    def __init__(self, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (1, n_kv_heads, max_seq_len, head_dim)
        # Uninitialised: attention reads only positions already written, and pages
        # are touched (and counted in RSS) only as the context fills.
        self.register_buffer("k", torch.empty(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype), persistent=False)

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (1, n_kv_heads, T, head_dim) at `pos`; return views of [0, pos + T)."""
        end = pos + k.shape[2]
        self.k[:, :, pos:end] = k
        self.v[:, :, pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


# T * S * heads * head_dim from which attention runs on every thread (ops.torch_threads)
LARGE_ATTENTION = 1 << 26
# The names of the modules that are matrix multiplications (MoE routers aside)
_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (the HF layout). x: (1, H, T, D); cos, sin: (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.sliding_window = args.sliding_window
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.qk_norm_full = args.qk_norm_full
        if args.qk_norm:
            # Per head (Qwen3), or over the whole projection (OLMoE).
            q_dim, k_dim = (args.n_heads, args.n_kv_heads) if args.qk_norm_full else (1, 1)
            self.q_norm = RMSNorm(q_dim * args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(k_dim * args.head_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.cache: KVCache | None = None

    def forward(self, x, pos: int, cos, sin) -> torch.Tensor:
        T = x.shape[1]
        # (1, T, H * D) -> (1, H, T, D)
        q = self.q_proj(x).view(1, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(1, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(1, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm_full:
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        k, v = self.cache.update(pos, k, v.transpose(1, 2))  # (1, n_kv, S, D)

        # GQA without copying K/V: fold each kv head's group of query heads into
        # the query length, (1, n_kv, n_rep * T, D), and attend to (1, n_kv, S, D).
        n_rep = self.n_heads // self.n_kv_heads
        q = q.reshape(1, self.n_kv_heads, n_rep * T, self.head_dim)
        mask = self._mask(pos, T, k.shape[2], x.device)
        if mask is not None:
            mask = mask.repeat(n_rep, 1)  # (n_rep * T, S), rows in q's folded order
        # A long prompt's attention, torch's one large op, gets every thread back.
        large = T * k.shape[2] * self.n_heads * self.head_dim >= LARGE_ATTENTION
        with ops.torch_threads() if large else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.view(1, self.n_heads, T, self.head_dim).transpose(1, 2).reshape(1, T, -1)
        return self.o_proj(out)

    def _mask(self, pos: int, T: int, S: int, device) -> torch.Tensor | None:
        """Boolean (T, S) mask, True where attention is allowed; None when all are."""
        window = self.sliding_window
        if T == 1 and (window is None or S <= window):
            return None  # one new token sees every cached position
        q_pos = torch.arange(pos, pos + T, device=device)[:, None]
        k_pos = torch.arange(S, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        # A sparse mixture of experts (moe.py), each expert an MLP, or one dense MLP.
        self.mlp = MoE(args, MLP) if args.is_moe_layer(layer) else MLP(args)

    def forward(self, x, pos: int, cos, sin) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), pos, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # from_pretrained skips the random init, which on the meta device costs ~1 s
        # (nn.init.normal_ imports torch._dynamo); the checkpoint assigns the weight.
        # Zeros, not empty: free on the meta device, defined when built on a real one.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.zeros(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_seq_len = 0
        # Token ids whose keys and values the caches hold, in order (see generate.py).
        self.cached_tokens: list[int] = []
        # Every block for one token in one C call (kernels_cpu/decode.py), when the model
        # is one it runs; built by setup_caches, over the current weights and caches.
        self.fused_decode = None
        # The context a forward pass runs in: ops.kernel_threads when the kernels' pool
        # does the matmuls (torch's threads step aside), else a no-op. Set with the step.
        self.threads = contextlib.nullcontext

    @staticmethod
    def sanitize(state_dict: dict, args: ModelArgs) -> dict:
        """Map a checkpoint's names onto ours: the one place for every naming exception
        (a tied output layer is the build's: runtime/files/build.py)."""
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
        # Llama 3.1 GGUF files carry rope scaling as per-frequency factors.
        rope_freqs = sd.pop("rope_freqs.weight", None)
        if rope_freqs is not None:
            args.rope_freq_factors = rope_freqs.float().tolist()
        # MoE blocks: Mixtral's names; transformers 5's stacked experts, gate_up_proj
        # (E, 2 * moe_hidden, dim) gate rows then up rows and down_proj (E, dim, moe_hidden),
        # split into one view per expert.
        w_names = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
        for key in [k for k in sd if ".block_sparse_moe." in k]:
            head, _, tail = key.replace(".block_sparse_moe.", ".mlp.").partition(".experts.")
            if tail:  # "E.w1.weight" -> ".experts.E.gate_proj.weight"
                e, w, kind = tail.split(".")
                tail = f".experts.{e}.{w_names.get(w, w)}.{kind}"
            sd[head + tail] = sd.pop(key)
        for key in [k for k in sd if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
            prefix, _, proj = key.rpartition(".")
            for e, w in enumerate(sd.pop(key)):
                if proj == "down_proj":
                    sd[f"{prefix}.{e}.down_proj.weight"] = w
                else:
                    sd[f"{prefix}.{e}.gate_proj.weight"], sd[f"{prefix}.{e}.up_proj.weight"] = (
                        w.chunk(2)
                    )
        # Buffers computed at setup, never loaded.
        return {k: v for k, v in sd.items() if "rotary_emb" not in k}

    def setup_caches(self, max_seq_len: int, dtype: torch.dtype) -> None:
        """Allocate the KV caches and rope tables for `max_seq_len` positions."""
        args = self.args
        self.max_seq_len = max_seq_len
        self.cached_tokens = []
        for layer in self.layers:
            layer.self_attn.cache = KVCache(args.n_kv_heads, max_seq_len, args.head_dim, dtype)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), rope_inv_freq(args))
        angles = torch.cat((angles, angles), dim=-1)  # (max_seq_len, head_dim)
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)
        self.prepare_fused_decode()

    def prepare_fused_decode(self) -> None:
        """(Re)build the fused decode step and choose `threads`; call after swapping
        modules or weights."""
        from .fused_decode import FusedDecode

        self.fused_decode = FusedDecode.prepare(self)
        self.threads = ops.kernel_threads if self._matmuls_on_kernels() else contextlib.nullcontext

    def _matmuls_on_kernels(self) -> bool:
        """Whether the C kernels run every matmul but the routers': every projection and
        the output layer is a QuantLinear (a float one, or a stand-in quant/tune.py
        trains, runs on torch's threads). MoE routers and shared-expert gates (`gate`,
        `shared_expert_gate`) stay float in every recipe, and are small."""
        linears = [m for name, m in self.named_modules() if name.rpartition(".")[2] in _LINEARS]
        return ops.available() and all(isinstance(m, QuantLinear) for m in linears)

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool = False) -> torch.Tensor:
        """tokens (1, T) at positions [pos, pos + T) -> logits (1, T or 1, vocab)."""
        T = tokens.shape[1]
        cos, sin = self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]
        with self.threads():
            # .to(): a quantized embedding table dequantizes rows in float32.
            x = self.embed_tokens(tokens).to(cos.dtype)
            if T == 1 and self.fused_decode is not None:
                x = self.fused_decode(x, pos)  # Block.forward is its definition
            else:
                for layer in self.layers:
                    x = layer(x, pos, cos, sin)
            if not all_logits:
                x = x[:, -1:]  # generation needs only the last position's logits
            return self.lm_head(self.norm(x))
