"""int6: 6-bit codes in groups of 16, GGUF Q6_K's layout and arithmetic, byte for byte.

Format (what `dequantize` computes; no parameters):

    w[n, k] = d[n, k // 256] * sc[n, k // 16] * (q[n, k] - 32)

with q in 0..63, sc an int8 per group of 16, d a float16 per super-block of 256. Every
product is exact in float32 (11 + 8 + 6 bits), so any evaluation order gives the same
bits, gguf-py's among them. K must be a multiple of 256.

Packed tensor (N = out_features, K = in_features): qweight uint8 (N, K / 256 * 210),
each row K / 256 blocks of ggml's block_q6_K (ggml/src/ggml-common.h):

    block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }

where, for each half h = 0, 1 of the block (elements 128 h .. 128 h + 127, ql + 64 h,
qh + 32 h) and i < 32:
    ql[i], ql[32 + i]  low nibbles: the low 4 bits of elements i, 32 + i;
                       high nibbles: of elements 64 + i, 96 + i;
    qh[i]              bits 0-1, 2-3, 4-5, 6-7: the high 2 bits of elements i, 32 + i,
                       64 + i, 96 + i.
So 64 bytes of ql give elements 0..63 of the half in order (AND 0x0F) and 64..127 (shift
right 4), and 32 bytes of qh, seen twice, their top bits with one shift per half: a
kernel widens 128 weights to bytes with no shuffle (kernels_cpu/reference.py's
unpack_int6 reads them). GGUF import copies the blocks.

6.5625 bits per weight (llama.cpp keeps its output layers and the sensitive half of
v_proj and down_proj at Q6_K in Q4_K_M); int8 g32 is 8.5.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_int6
from ...kernels_cpu.reference import pack_int6 as pack_blocks
from .base import register
from .fit import fit_scaled_groups
from .superblock import SuperBlockLinear

BLOCK_BYTES = 210  # 128 ql + 64 qh + 16 scales + 2 d


def fit(w: torch.Tensor, search: bool = True):
    """Quantize w (N, K) float32, K % 256 == 0: codes (N, K) in -32..31, sc (N, K/16) int8,
    d (N, K/256) float16 (fit.fit_scaled_groups with 8-bit scales)."""
    return fit_scaled_groups(w, -32, 31, 127, "int6", search)


def _fit_blocks(w: torch.Tensor, search: bool) -> torch.Tensor:
    c, sc, d = fit(w, search)
    return pack_blocks(c + 32, sc, d)


@register
class Int6Linear(SuperBlockLinear):
    format: ClassVar[str] = "int6"
    block_bytes: ClassVar[int] = BLOCK_BYTES
    kind: ClassVar[int] = 6
    fit_blocks = staticmethod(_fit_blocks)
    dequantize_blocks = staticmethod(dequantize_int6)
    matmul = staticmethod(kernels.q6_matmul)
