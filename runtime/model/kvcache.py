"""A layer's KV cache in one of its formats: float (f32, bf16) or int8.

Each holds one sequence's keys and values for up to max_seq_len positions, preallocated,
and has one verb, `update(pos, k, v)`: store the new rows, return what attention reads,
[0, pos + T), in the compute dtype. A model's `new_cache` makes one per layer.

    f32, bf16  k, v  (1, n_kv_heads, max_seq_len, head_dim) in that dtype
    int8       k, v  int8 (1, n_kv_heads, max_seq_len, head_dim) and k_scale, v_scale
                     float16 (1, n_kv_heads, max_seq_len, head_dim / g): value = q * d
                     per run of g = 32 values of a head's row (g = head_dim where 32
                     does not divide it): llama.cpp's q8_0 cache, 34 bytes per 32 values

int8 is quantized on write as ggml's quantize_row_q8_0_ref does (d = max |x| / 127, q =
x * (1 / d) rounded), except that ties round to even (ggml rounds them away from zero;
they are rare and a step apart). csrc/decode.c writes the same bytes (tests compare them).
"""

from __future__ import annotations

import torch
from torch import nn

KINDS = ("f32", "bf16", "int8")
_FLOATS = {"f32": torch.float32, "bf16": torch.bfloat16}
INT8_GROUP = 32  # values per scale, as q8_0's blocks


def float_kind(dtype: torch.dtype) -> str:
    """The float cache of a compute dtype: the default cache."""
    return "bf16" if dtype == torch.bfloat16 else "f32"


def int8_group(head_dim: int) -> int:
    return INT8_GROUP if head_dim % INT8_GROUP == 0 else head_dim


def bytes_per_position(kind: str, n_kv_heads: int, head_dim: int) -> int:
    """A layer's bytes for one position's keys and values."""
    if kind == "int8":
        return 2 * n_kv_heads * (head_dim + 2 * (head_dim // int8_group(head_dim)))
    return 2 * n_kv_heads * head_dim * _FLOATS[kind].itemsize


def cache_bytes(args, max_seq_len: int, kind: str) -> int:
    """A sequence's cache of `kind` over `max_seq_len` positions, every layer (args: the
    model's ModelArgs)."""
    return args.n_layers * max_seq_len * bytes_per_position(kind, args.n_kv_heads, args.head_dim)


def quantize_int8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> q int8 (..., D) and d float16 (..., D / group), q8_0's way (above)."""
    blocks = x.float().unflatten(-1, (-1, group))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1.0 / d)
    q = torch.nan_to_num(torch.round(blocks * inv), nan=0.0).clamp(-127, 127)
    return q.to(torch.int8).flatten(-2), d.squeeze(-1).to(torch.float16)


def dequantize_int8(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., D) int8 and d (..., D / g) float16 -> (..., D): q * d in float32 (one
    product, as decode.c computes it), then in `dtype`."""
    g = q.shape[-1] // d.shape[-1]
    x = q.unflatten(-1, (-1, g)).float() * d.float().unsqueeze(-1)
    return x.flatten(-2).to(dtype)


class KVCache(nn.Module):
    """Float keys and values, (1, n_kv_heads, max_seq_len, head_dim) each in `dtype`."""

    group = 0  # values per scale: none

    def __init__(self, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (1, n_kv_heads, max_seq_len, head_dim)
        # Uninitialised: attention reads only positions already written, and pages
        # are touched (and counted in RSS) only as the context fills.
        self.register_buffer("k", torch.empty(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype), persistent=False)

    @property
    def kind(self) -> str:
        return float_kind(self.k.dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (1, n_kv_heads, T, head_dim) at `pos`; return [0, pos + T) in k's dtype
        (views when the cache holds that dtype)."""
        end = pos + k.shape[2]
        self.k[:, :, pos:end] = k
        self.v[:, :, pos:end] = v
        return self.k[:, :, :end].to(k.dtype), self.v[:, :, :end].to(v.dtype)


class Int8KVCache(nn.Module):
    """Keys and values in int8 with a float16 scale per `group` values (the top of the file)."""

    kind = "int8"

    def __init__(self, n_kv_heads: int, max_seq_len: int, head_dim: int):
        super().__init__()
        self.group = int8_group(head_dim)
        shape = (1, n_kv_heads, max_seq_len, head_dim)
        scales = (1, n_kv_heads, max_seq_len, head_dim // self.group)
        for name in ("k", "v"):  # uninitialised, as KVCache's
            self.register_buffer(name, torch.empty(shape, dtype=torch.int8), persistent=False)
            self.register_buffer(
                f"{name}_scale", torch.empty(scales, dtype=torch.float16), persistent=False
            )

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        """Quantize k, v (1, n_kv_heads, T, head_dim) into place at `pos`; return [0, pos + T)
        dequantized, in k's dtype."""
        end = pos + k.shape[2]
        self.k[:, :, pos:end], self.k_scale[:, :, pos:end] = quantize_int8(k, self.group)
        self.v[:, :, pos:end], self.v_scale[:, :, pos:end] = quantize_int8(v, self.group)
        return (
            dequantize_int8(self.k[:, :, :end], self.k_scale[:, :, :end], k.dtype),
            dequantize_int8(self.v[:, :, :end], self.v_scale[:, :, :end], v.dtype),
        )


def new_cache(
    kind: str, n_layers: int, n_kv_heads: int, max_seq_len: int, head_dim: int
) -> list[KVCache | Int8KVCache]:
    """A cache of `kind` (KINDS) per layer."""
    if kind == "int8":
        return [Int8KVCache(n_kv_heads, max_seq_len, head_dim) for _ in range(n_layers)]
    if kind not in _FLOATS:
        raise ValueError(f"unknown KV cache {kind!r}: one of {', '.join(KINDS)}")
    return [KVCache(n_kv_heads, max_seq_len, head_dim, _FLOATS[kind]) for _ in range(n_layers)]
