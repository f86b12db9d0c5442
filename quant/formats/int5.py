"""int5: 5-bit codes in groups of 32, GGUF Q5_0's and Q5_1's layout and arithmetic.

Format (what `dequantize` computes; `params` = {"group_size": 32, "symmetric": bool}):

    symmetric=True  (Q5_0):  w[n, k] = (q[n, k] - 16) * d[n, k // 32]
    symmetric=False (Q5_1):  w[n, k] =  q[n, k] * d[n, k // 32] + m[n, k // 32]

with q in 0..31 and d, m float16, evaluated in float32 as written: one product, then a
separate sum (no FMA), the operation order of ggml's dequantize_row_q5_0 / q5_1, so
imported GGUF blocks dequantize bit for bit as gguf does.

Packed tensors (N = out_features, K = in_features, K % 32 == 0):

    qweight  uint8   (N, K/2)  the low 4 bits of each code, int4's nibble order (a block
                               of 32 is 16 bytes: byte i holds element i in its low
                               nibble, element 16 + i in its high nibble): ggml's `qs`
    qh       uint8   (N, K/8)  each block's 4 bytes of ggml's `qh`: the little-endian
                               uint32 whose bit j is element j's bit 4
    scales   float16 (N, K/32) d
    mins     float16 (N, K/32) m (symmetric=False only)

So GGUF import splits each block's bytes into these columns and changes none, and a
kernel reads the nibbles exactly as int4's, ORing in 16 where a bit of qh is set.
5.5 bits a weight symmetric (Q5_0's 22 bytes per 32), 6.0 asymmetric (Q5_1's 24).

Its codes are fitted by fit.py's `fit_groups`, as every group-quantized format's are.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import InferError
from ...kernels_cpu import ops as kernels
from ...kernels_cpu.reference import dequantize_int5
from .base import KernelWeights, QuantLinear, register
from .fit import check_group_size, check_params, check_weight, fit_groups
from .int4 import pack_nibbles

QK = 32  # weights per block (and per scale)


def pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in 0..31 -> (N, K/8) uint8: per block of 32, the little-endian
    uint32 whose bit j is element j's bit 4 (ggml's qh)."""
    N, K = q.shape
    hi = (q.to(torch.uint8) >> 4).view(N, K // 8, 8)
    return (hi << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


@register
class Int5Linear(QuantLinear):
    format: ClassVar[str] = "int5"
    defaults: ClassVar[dict] = {"group_size": QK, "symmetric": False}
    group_sizes: ClassVar[tuple[int, ...]] = (QK,)

    def __init__(self, qweight, qh, scales, mins, params: dict, bias=None):
        super().__init__(2 * qweight.shape[1], qweight.shape[0], params, bias)
        self.group_size: int = params["group_size"]
        self.symmetric: bool = params["symmetric"]
        self.register_buffer("qweight", qweight)  # (N, K/2) uint8
        self.register_buffer("qh", qh)  # (N, K/8) uint8
        self.register_buffer("scales", scales)  # (N, K/32) float16
        self.register_buffer("mins", mins)  # (N, K/32) float16, or None when symmetric

    @classmethod
    def resolve_params(cls, params: dict) -> dict:
        p = check_params(cls.format, params, cls.defaults)
        g = check_group_size(cls.format, int(p["group_size"]), cls.group_sizes)
        return {"group_size": g, "symmetric": bool(p["symmetric"])}

    @classmethod
    def from_float(cls, weight, bias=None, *, search: bool = True, **params):
        p = cls.resolve_params(params)
        w = check_weight(cls.format, weight, QK)
        if p["symmetric"]:
            c, d, _ = fit_groups(w, QK, -16, 15, affine=False, search=search)
            q, m = c + 16, None
        else:
            q, d, m = fit_groups(w, QK, 0, 31, affine=True, search=search)
        return cls(pack_nibbles(q & 15), pack_high_bits(q), d, m, p, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        t = {"qweight": self.qweight, "qh": self.qh, "scales": self.scales}
        if self.mins is not None:
            t["mins"] = self.mins
        return t

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict, bias=None):
        p = cls.resolve_params(params)
        qweight, qh = tensors.get("qweight"), tensors.get("qh")
        scales, mins = tensors.get("scales"), tensors.get("mins")
        if qweight is None or qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise InferError("int5: qweight must be a 2-D uint8 tensor")
        N, K = qweight.shape[0], 2 * qweight.shape[1]
        if K % QK:
            raise InferError(f"int5: row length {K} is not a multiple of {QK}")
        if qh is None or qh.dtype != torch.uint8 or tuple(qh.shape) != (N, K // 8):
            raise InferError(f"int5: qh must be uint8 of shape {(N, K // 8)}")
        groups = (N, K // QK)
        if scales is None or scales.dtype != torch.float16 or tuple(scales.shape) != groups:
            raise InferError(f"int5: scales must be float16 of shape {groups}")
        if p["symmetric"] != (mins is None):
            raise InferError("int5: mins are present exactly when symmetric is false")
        if mins is not None and (mins.dtype != torch.float16 or tuple(mins.shape) != groups):
            raise InferError(f"int5: mins must be float16 of shape {groups}")
        return cls(qweight, qh, scales, mins, p, bias)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        t = (self.qweight, self.qh, self.scales, self.mins)
        if rows is not None:
            t = tuple(None if v is None else v[rows] for v in t)
        return dequantize_int5(*t)

    def kernel_weights(self) -> KernelWeights:
        return KernelWeights(5, QK, self.qweight, self.scales, self.mins, self.qh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            y = kernels.q5_matmul(x, self.qweight, self.qh, self.scales, self.mins)
            return y if self.bias is None else y + self.bias
        return super().forward(x)
