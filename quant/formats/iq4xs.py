"""iq4_xs: 4-bit codes into 16 non-uniform levels, in sub-blocks of 32 with 6-bit scales,
GGUF IQ4_XS's layout and arithmetic, byte for byte.

Format (what `dequantize` computes; no parameters):

    w[n, k] = (d * sc[j]) * v[q[n, k]]      j = the sub-block of 32 of k

with q in 0..15, v IQ4_NL's levels (-127 .. 113, kernels_cpu/reference.py IQ4_VALUES),
sc in -32..31 per sub-block, d a float16 per super-block of 256. Both products are exact
in float32. K must be a multiple of 256.

Packed tensor (N = out_features, K = in_features): qweight uint8 (N, K / 256 * 136), each
row K / 256 blocks of ggml's block_iq4_xs (ggml/src/ggml-common.h):

    block_iq4_xs { ggml_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; }

(reference.unpack_iq4xs reads them). GGUF import keeps the blocks where they are: the
tensor is a view of the file's map.

4.25 bits per weight.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import InferError
from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import IQ4_VALUES, dequantize_iq4xs
from ...kernels_cpu.reference import pack_iq4xs as pack_blocks
from .base import register
from .fit import STEPS, importance, round_up
from .superblock import QK, SuperBlockLinear

BLOCK_BYTES = 136  # 2 d + 2 scales_h + 4 scales_l + 128 qs
KIND = 23  # the kernels' id for it (csrc/kernels.h IQ4XS: ggml's type id of IQ4_XS)
SC_MAX = 31  # |sc|: the scales' 6 bits hold -32..31, used symmetrically
_LEVELS = torch.tensor(IQ4_VALUES, dtype=torch.float32)
_MIDPOINTS = (_LEVELS[1:] + _LEVELS[:-1]) / 2


def _codes(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The nearest level's index for each w / s (s = 0: the level nearest 0)."""
    return torch.bucketize(torch.where(s == 0, 0.0, w / s), _MIDPOINTS)


def fit(w: torch.Tensor, search: bool = True):
    """Quantize w (N, K) float32, K % 256 == 0: codes (N, K) in 0..15, sc (N, K/32) in
    -31..31, d (N, K/256) float16.

    Each sub-block of 32 gets its own step s: its largest-magnitude weight on the level
    -127 or 113 (either sign of s), and with search each of fit.STEPS' factors of those,
    keeping the one with the least importance-weighted squared error. Each block's d is
    its largest |s| / 31 rounded up to float16; sc is s / d rounded to nearest, and the
    codes chosen again for the rounded step."""
    N, K = w.shape
    B = K // QK
    g = w.view(N, B * 8, 32)
    imp = importance(g)
    top = g.gather(-1, g.abs().argmax(-1, keepdim=True))  # (N, B*8, 1), signed
    bases = (top / -127, top / 113)
    factors = STEPS if search else (1.0,)
    best_s, best_err = None, None
    for base in bases:
        for f in factors:
            s = base / f
            err = ((s * _LEVELS[_codes(g, s)] - g).square() * imp).sum(-1, keepdim=True)
            if best_s is None:
                best_s, best_err = s, err
            else:
                better = err < best_err
                best_s, best_err = (
                    torch.where(better, s, best_s),
                    torch.where(better, err, best_err),
                )
    s = best_s.view(N, B, 8)
    d = round_up(s.abs().amax(-1, keepdim=True) / SC_MAX, torch.float16)  # (N, B, 1)
    if not torch.isfinite(d).all():
        raise InferError("iq4_xs: weights too large for float16 scales")
    sc = torch.where(d == 0, 0.0, s / d).round_().clamp_(-SC_MAX, SC_MAX)
    step = (d * sc).view(N, B * 8, 1)  # as dequantize rounds it: exact
    return _codes(g, step).view(N, K), sc.view(N, B * 8).to(torch.int8), d.view(N, B).half()


def _fit_blocks(w: torch.Tensor, search: bool) -> torch.Tensor:
    return pack_blocks(*fit(w, search))


@register
class IQ4XSLinear(SuperBlockLinear):
    format: ClassVar[str] = "iq4_xs"
    block_bytes: ClassVar[int] = BLOCK_BYTES
    kind: ClassVar[int] = KIND
    fit_blocks = staticmethod(_fit_blocks)
    dequantize_blocks = staticmethod(dequantize_iq4xs)
    matmul = staticmethod(kernels.iq4xs_matmul)
