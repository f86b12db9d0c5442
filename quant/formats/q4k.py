"""q4_k: 4-bit codes in sub-blocks of 32 with 6-bit scales and mins, GGUF Q4_K's layout
and arithmetic, byte for byte.

Format (what `dequantize` computes; no parameters):

    w[n, k] = (d * sc[j]) * q[n, k] - (dmin * m[j])      j = the sub-block of 32 of k

with q in 0..15, sc and m 6-bit integers per sub-block of 32, d and dmin float16 per
super-block of 256, evaluated in float32 as written (two products, the product by q, then
the difference: three roundings, no FMA), gguf-py's order, so GGUF blocks dequantize bit
for bit as gguf does. K must be a multiple of 256.

Packed tensor (N = out_features, K = in_features): qweight uint8 (N, K / 256 * 144), each
row K / 256 blocks of ggml's block_q4_K (ggml/src/ggml-common.h):

    block_q4_K { ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[128]; }

where scales holds sc[0..7] and m[0..7] in 6 bits each (ggml's get_scale_min_k4:
j < 4: sc = scales[j] & 63, m = scales[j + 4] & 63; j >= 4: the low 4 bits from
scales[j + 4]'s low (sc) or high (m) nibble, the top 2 from bits 6-7 of scales[j - 4]
(sc) or scales[j] (m)), and qs is 4 runs of 32 bytes, run r's low nibbles sub-block
2r's codes in order and its high nibbles sub-block 2r + 1's. GGUF import keeps the
blocks where they are: the tensor is a view of the file's map.

4.5 bits per weight (int4 g32 asymmetric, float16 scale and min per 32, is 5.0).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import InferError
from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_q4k
from .base import register
from .fit import fit_groups, nearest_codes, round_up
from .superblock import QK, SuperBlockLinear

BLOCK_BYTES = 144  # 2 d + 2 dmin + 12 scales + 128 qs
KIND = 12  # the kernels' id for it (csrc/kernels.h Q4K: ggml's type id of Q4_K)


def pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """sc, m (..., 8) in 0..63 -> (..., 12) uint8, ggml's packing (get_scale_min_k4's
    inverse)."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return torch.cat((lo, mid, hi), -1)


def pack_blocks(q, sc, m, d, dmin) -> torch.Tensor:
    """Codes q (N, K) in 0..15, sc and m (N, K/32) in 0..63, d and dmin (N, K/256) float16
    -> (N, K/256*144)."""
    N, K = q.shape
    B = K // QK
    q = q.to(torch.uint8).view(N, B, 4, 2, 32)  # (block, run r, sub-block 2r + h, i)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(N, B, 128)
    halves = torch.stack((d, dmin), -1).contiguous().view(torch.uint8).view(N, B, 4)
    scales = pack_scales(sc.view(N, B, 8), m.view(N, B, 8))
    return torch.cat((halves, scales, qs), -1).reshape(N, B * BLOCK_BYTES)


def fit(w: torch.Tensor, search: bool = True, top: int = 15):
    """Quantize w (N, K) float32, K % 256 == 0: codes (N, K) in 0..top (15; q5_k's 31), sc
    and m (N, K/32) in 0..63, d and dmin (N, K/256) float16.

    Each sub-block of 32 gets its own best step s and offset o (fit.fit_groups with codes
    0..top, affine: int4's error-weighted search); its min is -o, or 0 where o > 0 (Q4_K's
    offset is never positive: the grid then starts at 0, as ggml's make_qkx2_quants has
    it). Each block's d (dmin) is its largest s (min) / 63 rounded up to float16, so no
    sc or m passes 63; sc and m are rounded to nearest, and the codes chosen again for
    the rounded step and min."""
    N, K = w.shape
    B = K // QK
    _, s, o = fit_groups(w, 32, 0, top, affine=True, dtype=torch.float32, search=search)
    s, o = s.view(N, B, 8), o.view(N, B, 8)
    high = w.view(N, B, 8, 32).amax(-1)  # where o > 0 the grid from 0 must reach it
    s = torch.where(o > 0, torch.maximum(s, high / top), s).clamp_(min=0)
    mn = (-o).clamp_(min=0)
    d = round_up(s.amax(-1, keepdim=True) / 63, torch.float16)  # (N, B, 1)
    dmin = round_up(mn.amax(-1, keepdim=True) / 63, torch.float16)
    if not (torch.isfinite(d).all() and torch.isfinite(dmin).all()):
        raise InferError("q4_k: weights too large for float16 scales")
    sc = torch.where(d == 0, 0.0, s / d).round_().clamp_(0, 63)
    m = torch.where(dmin == 0, 0.0, mn / dmin).round_().clamp_(0, 63)
    step = (d * sc).unsqueeze(-1)  # (N, B, 8, 1), as dequantize rounds them
    low = (dmin * m).unsqueeze(-1)
    c = nearest_codes(w.view(N, B, 8, 32), step, -low, 0, top)
    return (
        c.view(N, K),
        sc.view(N, K // 32),
        m.view(N, K // 32),
        d.view(N, B).half(),
        dmin.view(N, B).half(),
    )


def _fit_blocks(w: torch.Tensor, search: bool) -> torch.Tensor:
    return pack_blocks(*fit(w, search))


@register
class Q4KLinear(SuperBlockLinear):
    format: ClassVar[str] = "q4_k"
    block_bytes: ClassVar[int] = BLOCK_BYTES
    kind: ClassVar[int] = KIND
    fit_blocks = staticmethod(_fit_blocks)
    dequantize_blocks = staticmethod(dequantize_q4k)
    matmul = staticmethod(kernels.q4k_matmul)
