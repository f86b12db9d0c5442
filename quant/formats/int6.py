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

from ... import InferError
from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_int6
from ...kernels_cpu.reference import pack_int6 as pack_blocks
from .base import register
from .fit import fit_groups, nearest_codes, round_up
from .superblock import QK, SuperBlockLinear

BLOCK_BYTES = 210  # 128 ql + 64 qh + 16 scales + 2 d


def fit(w: torch.Tensor, search: bool = True):
    """Quantize w (N, K) float32, K % 256 == 0: codes (N, K) in -32..31, sc (N, K/16) int8,
    d (N, K/256) float16.

    Each group of 16 gets its own best scale s (fit.fit_groups on codes -32..31: the
    clipping search, or with search=False the step covering the group's range); each
    block's d is its largest |s| / 127 rounded up to float16, so no |s / d| passes 127
    and no block's d is zero unless all its weights are; sc is |s / d| rounded up, with
    s's sign, so the step d sc covers the group and the codes chosen again for it are
    each within half a step. With search, sc one nearer zero is tried too (a finer step
    that may clip), and each group keeps the one with the smaller error."""
    N, K = w.shape
    B = K // QK
    _, s16, _ = fit_groups(w, 16, -32, 31, affine=False, dtype=torch.float32, search=search)
    s = s16.view(N, B, 16)
    d = round_up(s.abs().amax(-1, keepdim=True) / 127, torch.float16)  # (N, B, 1)
    if not torch.isfinite(d).all():
        raise InferError("int6: weights too large for float16 scales")
    sc = torch.where(d == 0, 0.0, (s / d).abs().ceil_().clamp_(max=127) * s.sign())
    wg = w.view(N, B, 16, 16)
    best = None
    for t in (sc, sc - sc.sign()) if search else (sc,):
        step = (d * t).unsqueeze(-1)  # (N, B, 16, 1): exact products
        c = nearest_codes(wg, step, None, -32, 31)
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
        best[1].view(N, K).to(torch.int16),
        best[0].view(N, B * 16).to(torch.int8),
        d.view(N, B).half(),
    )


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
