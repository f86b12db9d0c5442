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

from ... import InferError
from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_q3k
from ...kernels_cpu.reference import pack_q3k as pack_blocks
from .base import register
from .fit import fit_groups, nearest_codes, round_up
from .superblock import QK, SuperBlockLinear

BLOCK_BYTES = 110  # 32 hmask + 64 qs + 12 scales + 2 d
KIND = 11  # the kernels' id for it (csrc/kernels.h Q3K: ggml's type id of Q3_K)
SC_MAX = 31  # |sc|: the scales' 6 bits hold -32..31, used symmetrically


def fit(w: torch.Tensor, search: bool = True):
    """Quantize w (N, K) float32, K % 256 == 0: codes (N, K) in -4..3, sc (N, K/16) in
    -31..31, d (N, K/256) float16.

    As int6's fit: each group of 16 gets its own best scale s (fit.fit_groups on codes
    -4..3); each block's d is its largest |s| / 31 rounded up to float16; sc is |s / d|
    rounded up, with s's sign, so the step d sc covers the group. With search, sc one
    nearer zero is tried too, and each group keeps the one with the smaller error."""
    N, K = w.shape
    B = K // QK
    _, s16, _ = fit_groups(w, 16, -4, 3, affine=False, dtype=torch.float32, search=search)
    s = s16.view(N, B, 16)
    d = round_up(s.abs().amax(-1, keepdim=True) / SC_MAX, torch.float16)  # (N, B, 1)
    if not torch.isfinite(d).all():
        raise InferError("q3_k: weights too large for float16 scales")
    sc = torch.where(d == 0, 0.0, (s / d).abs().ceil_().clamp_(max=SC_MAX) * s.sign())
    wg = w.view(N, B, 16, 16)
    best = None
    for t in (sc, sc - sc.sign()) if search else (sc,):
        step = (d * t).unsqueeze(-1)  # (N, B, 16, 1): exact products
        c = nearest_codes(wg, step, None, -4, 3)
        err = (c * step - wg).square_().sum(-1)
        if best is None:
            best = [t, c, err]
        else:
            better = err < best[2]
            best = [
                torch.where(better, t, best[0]),
                torch.where(better.unsqueeze(-1), c, best[1]),
                torch.where(better, err, best[2]),
            ]
    return (
        best[1].view(N, K).to(torch.int8),
        best[0].view(N, B * 16).to(torch.int8),
        d.view(N, B).half(),
    )


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
