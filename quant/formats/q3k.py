"""q3_k: 3-bit codes in groups of 16 with 6-bit scales, GGUF Q3_K's layout and arithmetic,
byte for byte.

Format (what `dequantize` computes; no parameters):

    w[n, k] = (d * sc[j]) * q[n, k]       j = the group of 16 of k

with q in -4..3, sc in -32..31 per group of 16, d a float16 per super-block of 256. Both
products are exact in float32 (11 + 6 + 3 bits), so any order gives gguf-py's bits. K must
be a multiple of 256.

Packed tensor (N = out_features, K = in_features): qweight uint8 (N, K / 256 * 110), each
row K / 256 blocks of ggml's block_q3_K (ggml/src/ggml-common.h):

    block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d; }

where element 128 h + 32 j + i (half h, quarter j, i < 32) is bits 2j of qs[32 h + i],
minus 4 unless bit 4h + j of hmask[i] is set, and scales holds sc + 32 in 6 bits a group
(kernels_cpu/reference.py's unpack_q3k reads them). GGUF import keeps the blocks where
they are: the tensor is a view of the file's map.

3.4375 bits per weight (llama.cpp's Q3_K_M keeps most linears at Q3_K).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_q3k
from ...kernels_cpu.reference import pack_q3k as pack_blocks
from .base import register
from .fit import fit_scaled_groups
from .superblock import SuperBlockLinear

BLOCK_BYTES = 110  # 32 hmask + 64 qs + 12 scales + 2 d
KIND = 11  # the kernels' id for it (csrc/kernels.h Q3K: ggml's type id of Q3_K)
SC_MAX = 31  # |sc|: the scales' 6 bits hold -32..31, used symmetrically


def fit(w: torch.Tensor, search: bool = True):
    """Quantize w (N, K) float32, K % 256 == 0: codes (N, K) in -4..3, sc (N, K/16) in
    -31..31, d (N, K/256) float16 (fit.fit_scaled_groups with 6-bit scales, used
    symmetrically)."""
    return fit_scaled_groups(w, -4, 3, SC_MAX, "q3_k", search)


def _fit_blocks(w: torch.Tensor, search: bool) -> torch.Tensor:
    return pack_blocks(*fit(w, search))


@register
class Q3KLinear(SuperBlockLinear):
    format: ClassVar[str] = "q3_k"
    block_bytes: ClassVar[int] = BLOCK_BYTES
    kind: ClassVar[int] = KIND
    fit_blocks = staticmethod(_fit_blocks)
    dequantize_blocks = staticmethod(dequantize_q3k)
    matmul = staticmethod(kernels.q3k_matmul)
