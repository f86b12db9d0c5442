"""The dense Llama family: Llama 2/3.x, Mistral, SmolLM/SmolLM2, Qwen2/2.5, Qwen3.

Plain nn.Modules with Hugging Face parameter names, so a safetensors state dict
loads without a table (the `model.` prefix is dropped in `sanitize`). Variants are
ModelArgs fields: qkv bias (Qwen2), q/k RMSNorm (Qwen3), GQA, tied embeddings,
rope scaling, sliding window.

The model holds weights and rope tables only: a conversation's keys and values are a
cache (a KVCache per layer, in one of kvcache.py's formats) passed to each forward call,
so several conversations can share one model (runtime/session.py). A call runs T tokens
of one sequence, or T rows of several (`Rows`: each sequence's rows attend to its own
cache).
Shapes below use T = tokens in this call, S = positions visible to attention.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels_cpu import ops, threads
from ...quant.formats.base import QuantLinear
from . import kvcache
from .config import ModelArgs
from .kvcache import KVCache
from .moe import MoE
from .rope import rope_tables


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


class Rows:
    """The rows of one pass over several sequences, in place of one sequence's cache:
    `spans` are (pos, n, cache): the next n rows continue the sequence of `cache` (a
    KVCache per layer) from position pos. Iterated, it gives each layer's view, as a
    cache list does."""

    def __init__(self, spans: list[tuple[int, int, list[KVCache]]]):
        self.spans = spans
        self.positions = [p + j for p, n, _ in spans for j in range(n)]
        self.last = list(itertools.accumulate(n for _, n, _ in spans))  # each span's end

    def __iter__(self) -> Iterator[LayerRows]:
        return (LayerRows(self.spans, i) for i in range(len(self.spans[0][2])))


class LayerRows:
    """One layer's view of Rows: (first row, end row, pos, the layer's KVCache) a span."""

    def __init__(self, spans: list, layer: int):
        self.spans, self.layer = spans, layer

    def __iter__(self):
        a = 0
        for pos, n, cache in self.spans:
            yield a, a + n, pos, cache[self.layer]
            a += n


class NoCache:
    """Stands in for a layer's KVCache in a pass over a whole sequence from position 0
    (calibration, training): attention sees this call's keys and values and nothing is
    kept, so the pass can be differentiated."""

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        return k, v


@contextlib.contextmanager
def full_sequences(model: Transformer, T: int) -> Iterator[None]:
    """Rope tables that cover passes over whole windows of T tokens (grown for the
    passes if need be; such passes keep no cache: llama.NoCache)."""
    dtype, saved_len = model.rope_cos.dtype, model.max_seq_len
    if T > saved_len:
        model.setup_rope(T, dtype)
    try:
        yield
    finally:
        if T > saved_len:
            model.setup_rope(saved_len, dtype)


# T * S * heads * head_dim from which attention runs on every thread (threads.wide)
LARGE_ATTENTION = 1 << 26
# The names of the modules that are matrix multiplications (MoE routers aside)
_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}


def rope_rows(cos, sin, pos: int, T: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The rope tables' rows for a pass: [pos, pos + T), or the Rows' positions."""
    if isinstance(cache, Rows):
        at = torch.tensor(cache.positions)
        return cos[at], sin[at]
    return cos[pos : pos + T], sin[pos : pos + T]


# Rows the quantized kernels run as one GEMV each, computed as each row alone (kernels.h)
GEMV_ROWS = 4


def last_rows(x: torch.Tensor, cache) -> torch.Tensor:
    """The states (1, 1 or spans, dim) whose logits generation needs: the last row, or
    each sequence's last row in a pass of Rows."""
    if isinstance(cache, Rows):
        return x[:, [end - 1 for end in cache.last]]
    return x[:, -1:]


def rows_apply(fn, x: torch.Tensor, cache) -> torch.Tensor:
    """fn(x) for x (1, T, dim); for a pass of Rows a few rows at a time, so that each
    row's output is that of the row alone (the output layer of a decode pass)."""
    if not isinstance(cache, Rows):
        return fn(x)
    return torch.cat([fn(x[:, i : i + GEMV_ROWS]) for i in range(0, x.shape[1], GEMV_ROWS)], 1)


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

    scale = None  # of the scores: 1/sqrt(head_dim)

    def forward(self, x, pos: int, cos, sin, cache: KVCache | LayerRows) -> torch.Tensor:
        T = x.shape[1]
        q, k, v = self.project(x)  # (1, T, heads, D) each
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (1, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if isinstance(cache, LayerRows):  # each sequence's rows attend to its own cache
            parts = [self.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], p, c)
                     for a, b, p, c in cache]  # fmt: skip
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        else:
            out = self.attend(q, k, v, pos, cache)
        return self.o_proj(out.transpose(1, 2).reshape(1, T, -1))

    def project(self, x: torch.Tensor):
        """q (1, T, H, D), k and v (1, T, n_kv, D) of x (1, T, dim), normed if need be."""
        T = x.shape[1]
        q = self.q_proj(x).view(1, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(1, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(1, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm_full:
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, q, k, v, pos: int, cache: KVCache) -> torch.Tensor:
        """(1, H, T, D) attention output of one sequence's T rows at [pos, pos + T), whose
        k and v (1, n_kv, T, D) go into its cache first."""
        T = q.shape[2]
        k, v = cache.update(pos, k, v)  # (1, n_kv, S, D)
        # With a sliding window, the keys before the first row's window are no row's.
        lo = max(0, pos - self.sliding_window + 1) if self.sliding_window else 0
        k, v = k[:, :, lo:], v[:, :, lo:]
        # GQA without copying K/V: fold each kv head's group of query heads into
        # the query length, (1, n_kv, n_rep * T, D), and attend to (1, n_kv, S, D).
        n_rep = self.n_heads // self.n_kv_heads
        q = q.reshape(1, self.n_kv_heads, n_rep * T, self.head_dim)
        mask = self._mask(pos, T, lo, lo + k.shape[2], q.device)
        if mask is not None:
            mask = mask.repeat(n_rep, 1)  # (n_rep * T, S), rows in q's folded order
        # A long prompt's attention, torch's one large op, gets every thread back.
        large = T * k.shape[2] * self.n_heads * self.head_dim >= LARGE_ATTENTION
        with threads.wide() if large else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.view(1, self.n_heads, T, self.head_dim)

    def _mask(self, pos: int, T: int, lo: int, S: int, device) -> torch.Tensor | None:
        """Boolean (T, S - lo) mask of rows [pos, pos + T) over keys [lo, S), True where
        attention is allowed; None when all are."""
        window = self.sliding_window
        if T == 1 and (window is None or S - lo <= window):
            return None  # one new token sees every cached position
        q_pos = torch.arange(pos, pos + T, device=device)[:, None]
        k_pos = torch.arange(lo, S, device=device)[None, :]
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

    def forward(self, x, pos: int, cos, sin, cache: KVCache) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), pos, cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def norm_weights(self) -> tuple:
        """The fused step's norm weights w (out = w * normed x): input, pre-MLP, q, k, after
        attention, after the MLP; None where the block has none."""
        a = self.self_attn
        qk = (a.q_norm.weight, a.k_norm.weight) if a.q_norm is not None else (None, None)
        return (self.input_layernorm.weight, self.post_attention_layernorm.weight, *qk, None, None)


class Transformer(nn.Module):
    mlp_act = "silu"  # the fused step's activation
    attn_scale = None  # queries scaled by 1/sqrt(head_dim)
    kv_cache = None  # new_cache's default kind (the loader's --kv-cache); None: float

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # from_pretrained skips the random init, slow even on the meta device
        # (nn.init.normal_ imports torch._dynamo); the checkpoint assigns the weight.
        # Zeros, not empty: free on the meta device, defined when built on a real one.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.zeros(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_seq_len = 0  # positions the rope tables cover (setup_rope)

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

    def setup_rope(self, max_seq_len: int, dtype: torch.dtype) -> None:
        """Rope tables for `max_seq_len` positions in the compute dtype; a cache covers at
        most that many."""
        self.max_seq_len = max_seq_len
        cos, sin = rope_tables(self.args, max_seq_len, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def layer_rope(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Layer i's rope tables and sliding window (the fused step's)."""
        return self.rope_cos, self.rope_sin, self.args.sliding_window

    def new_cache(self, max_seq_len: int | None = None, kind: str | None = None) -> list[KVCache]:
        """An empty KV cache for one sequence of up to `max_seq_len` positions (default and
        at most the rope tables'), of `kind` (kvcache.KINDS; default `self.kv_cache`, which
        the loader sets, else the compute dtype's float)."""
        n = min(max_seq_len or self.max_seq_len, self.max_seq_len)
        kind = kind or self.kv_cache or kvcache.float_kind(self.rope_cos.dtype)
        a = self.args
        return kvcache.new_cache(kind, len(self.layers), a.n_kv_heads, n, a.head_dim)

    def runs_on_kernels(self) -> bool:
        """Whether the C kernels run every matmul but the routers': every projection and
        the output layer is a quantized format (a float one, or a stand-in quant/tune.py
        trains, runs on torch's threads). MoE routers and shared-expert gates stay float
        in every recipe, and are small."""
        linears = [m for name, m in self.named_modules() if name.rpartition(".")[2] in _LINEARS]
        return ops.available() and all(isinstance(m, QuantLinear) for m in linears)

    def forward(
        self, tokens: torch.Tensor, pos: int, cache: list[KVCache] | Rows,
        all_logits: bool = False, blocks=None, states: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """tokens (1, T) at positions [pos, pos + T) -> logits (1, T or 1, vocab); writes
        their keys and values into `cache`. With `cache` Rows, the tokens are rows of
        several sequences at the Rows' positions (`pos` unused). `blocks`, when given,
        runs every block on (x, pos) in place of the loop below, which is its definition
        (the fused step). With `states`: the final norm's states (1, T, dim) in place of
        logits (what an embedding pools)."""
        x = self.embed(tokens)
        if blocks is not None:
            x = blocks(x, pos)
        else:
            cos, sin = rope_rows(self.rope_cos, self.rope_sin, pos, tokens.shape[1], cache)
            for layer, layer_cache in zip(self.layers, cache):
                x = layer(x, pos, cos, sin, layer_cache)
        return self.norm(x) if states else self.head(x, cache, all_logits)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The states (1, T, dim) the first block takes, in the compute dtype."""
        # .to(): a quantized embedding table dequantizes rows in float32.
        return self.embed_tokens(tokens).to(self.rope_cos.dtype)

    def head(self, x: torch.Tensor, cache, all_logits: bool) -> torch.Tensor:
        """Logits (1, T or 1, vocab) of the last block's states x (1, T, dim); without
        `all_logits`, of the last position only (of each sequence's, for Rows)."""
        if not all_logits:
            x = last_rows(x, cache)
        return rows_apply(lambda h: self.lm_head(self.norm(h)), x, cache)
