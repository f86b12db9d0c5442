"""q2_k: 2-bit codes in groups of 16 with 4-bit scales and mins, GGUF Q2_K's layout and
arithmetic, byte for byte.

Format (what `dequantize` computes; no parameters):

    w[n, k] = (d * sc[j]) * q[n, k] - (dmin * m[j])      j = the group of 16 of k

with q in 0..3, sc and m 4-bit integers per group of 16, d and dmin float16 per
super-block of 256, evaluated in float32 as written (the products exact, then the
difference: one rounding), gguf-py's order. K must be a multiple of 256.

Packed tensor (N = out_features, K = in_features): qweight uint8 (N, K / 256 * 84), each
row K / 256 blocks of ggml's block_q2_K (ggml/src/ggml-common.h):

    block_q2_K { uint8_t scales[16]; uint8_t qs[64]; ggml_half d, dmin; }

where scales[j] holds sc[j] (low nibble) and m[j] (high), and element 128 h + 32 j + i
(half h, quarter j, i < 32) is bits 2j of qs[32 h + i] (kernels_cpu/reference.py's
unpack_q2k reads them). GGUF import keeps the blocks where they are: the tensor is a view
of the file's map.

2.625 bits per weight (llama.cpp's Q2_K keeps most linears at Q2_K).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import InferError
from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_q2k
from ...kernels_cpu.reference import pack_q2k as pack_blocks
from .base import register
from .fit import fit_groups, nearest_codes, round_up
from .superblock import QK, SuperBlockLinear

BLOCK_BYTES = 84  # 16 scales + 64 qs + 2 d + 2 dmin
KIND = 10  # the kernels' id for it (csrc/kernels.h Q2K: ggml's type id of Q2_K)


def fit(w: torch.Tensor, search: bool = True):
    """Quantize w (N, K) float32, K % 256 == 0: codes (N, K) in 0..3, sc and m (N, K/16)
    in 0..15, d and dmin (N, K/256) float16.

    As q4_k's fit with groups of 16 and codes 0..3: each group gets its own best step and
    offset (fit.fit_groups, affine), its min -o, or 0 where o > 0; each block's d (dmin)
    is its largest step (min) / 15 rounded up to float16, sc and m rounded to nearest, and
    the codes chosen again for the rounded step and min."""
    N, K = w.shape
    B = K // QK
    _, s, o = fit_groups(w, 16, 0, 3, affine=True, dtype=torch.float32, search=search)
    s, o = s.view(N, B, 16), o.view(N, B, 16)
    top = w.view(N, B, 16, 16).amax(-1)  # where o > 0 the grid from 0 must reach it
    s = torch.where(o > 0, torch.maximum(s, top / 3), s).clamp_(min=0)
    mn = (-o).clamp_(min=0)
    d = round_up(s.amax(-1, keepdim=True) / 15, torch.float16)  # (N, B, 1)
    dmin = round_up(mn.amax(-1, keepdim=True) / 15, torch.float16)
    if not (torch.isfinite(d).all() and torch.isfinite(dmin).all()):
        raise InferError("q2_k: weights too large for float16 scales")
    sc = torch.where(d == 0, 0.0, s / d).round_().clamp_(0, 15)
    m = torch.where(dmin == 0, 0.0, mn / dmin).round_().clamp_(0, 15)
    step = (d * sc).unsqueeze(-1)  # (N, B, 16, 1), as dequantize rounds them
    low = (dmin * m).unsqueeze(-1)
    c = nearest_codes(w.view(N, B, 16, 16), step, -low, 0, 3)
    return (
        c.view(N, K),
        sc.view(N, K // 16),
        m.view(N, K // 16),
        d.view(N, B).half(),
        dmin.view(N, B).half(),
    )


def _fit_blocks(w: torch.Tensor, search: bool) -> torch.Tensor:
    return pack_blocks(*fit(w, search))


@register
class Q2KLinear(SuperBlockLinear):
    format: ClassVar[str] = "q2_k"
    block_bytes: ClassVar[int] = BLOCK_BYTES
    kind: ClassVar[int] = KIND
    fit_blocks = staticmethod(_fit_blocks)
    dequantize_blocks = staticmethod(dequantize_q2k)
    matmul = staticmethod(kernels.q2k_matmul)
