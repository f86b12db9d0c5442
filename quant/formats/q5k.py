"""q5_k: 5-bit codes in sub-blocks of 32 with 6-bit scales and mins, GGUF Q5_K's layout and
arithmetic, byte for byte.

Format (what `dequantize` computes; no parameters): q4_k's (quant/formats/q4k.py) with
codes q in 0..31,

    w[n, k] = (d * sc[j]) * q[n, k] - (dmin * m[j])      j = the sub-block of 32 of k

evaluated in float32 as written (gguf-py's order). K must be a multiple of 256.

Packed tensor (N = out_features, K = in_features): qweight uint8 (N, K / 256 * 176), each
row K / 256 blocks of ggml's block_q5_K (ggml/src/ggml-common.h):

    block_q5_K { ggml_half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }

where scales and qs are Q4_K's (the codes' low 4 bits) and bit j of qh[i] is bit 4 of
element i of sub-block j. GGUF import keeps the blocks where they are: the tensor is a view
of the file's map.

5.5 bits per weight (llama.cpp's Q5_K_M keeps most linears at Q5_K).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_q5k
from . import q4k
from .base import register
from .superblock import QK, SuperBlockLinear

BLOCK_BYTES = 176  # 2 d + 2 dmin + 12 scales + 32 qh + 128 qs
KIND = 13  # the kernels' id for it (csrc/kernels.h Q5K: ggml's type id of Q5_K)


def pack_blocks(q, sc, m, d, dmin) -> torch.Tensor:
    """Codes q (N, K) in 0..31, sc and m (N, K/32) in 0..63, d and dmin (N, K/256)
    float16 -> (N, K/256*176): q4_k's block of the low 4 bits, with qh after its scales."""
    N, K = q.shape
    B = K // QK
    q = q.to(torch.uint8)
    low = q4k.pack_blocks(q & 15, sc, m, d, dmin).view(N, B, 144)
    bits = (q >> 4).view(N, B, 8, 32) << torch.arange(8, dtype=torch.uint8).view(8, 1)
    qh = bits.sum(2, dtype=torch.uint8)  # disjoint bits: the sum is their OR
    return torch.cat((low[..., :16], qh, low[..., 16:]), -1).reshape(N, B * BLOCK_BYTES)


def _fit_blocks(w: torch.Tensor, search: bool) -> torch.Tensor:
    return pack_blocks(*q4k.fit(w, search, top=31))


@register
class Q5KLinear(SuperBlockLinear):
    format: ClassVar[str] = "q5_k"
    block_bytes: ClassVar[int] = BLOCK_BYTES
    kind: ClassVar[int] = KIND
    fit_blocks = staticmethod(_fit_blocks)
    dequantize_blocks = staticmethod(dequantize_q5k)
    matmul = staticmethod(kernels.q5k_matmul)
