"""lut1..lut4: b-bit affine group quantization stored as bit planes for T-MAC LUT-GEMV.

Format (what `dequantize` computes; `params` = {"group_size": g}; b = 1..4 is in the
format name):

    w[n, k] = q[n, k] * s[n, k // g] + m[n, k // g]      q in 0 .. 2^b - 1

with s, m float16, evaluated in float32 as one product then a separate sum (as int4).
g is a multiple of 8 (default 64); K must be a multiple of g.

Packed tensors (N = out_features, K = in_features):

    qweight  uint8    (b, N, K/8)  bit planes: bit i of byte t of plane p, row n is
                                   bit p of q[n, 8t + i] (i = 0..7, LSB first)
    scales   float16  (N, K/g)     s
    mins     float16  (N, K/g)     m

Read as nibbles, as the kernel does: the low nibble of byte t is the 4-bit index of
elements 8t..8t+3 (bit i = bit p of element 8t+i) and the high nibble that of elements
8t+4..8t+7; so the nibble of 4-element group j (elements 4j..4j+3) is byte j // 2, low
nibble if j is even, high if odd.

The kernel (T-MAC, Wei et al. 2024): for each 4 activations a[4j..4j+3] build once per
token a 16-entry table T_j[idx] = sum of a[4j+i] over the set bits i of idx; shared by
every row and plane. Then for the elements of one group of row n

    sum_k q[n,k] a[k] = sum_p 2^p sum_j T_j[nibble(p, n, j)]
    sum_k w[n,k] a[k] = s * (that) + m * sum_k a[k]

so a row costs b table lookups per 4 elements and no multiplications by weights.

Group size 64 by default. The f16 scale and min cost 32 / g bits per weight (1.0 at
g = 32, 0.5 at 64, 0.25 at 128). A bit more per weight buys more accuracy than
smaller groups, so take the largest group that still divides common widths (128 does
not divide SmolLM2's 576).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import InferError
from ...kernels_cpu import ops
from .base import KernelWeights, QuantLinear, register
from .fit import check_params, check_weight, fit_groups

_SHIFTS = torch.arange(8, dtype=torch.uint8)  # bit i of a plane byte is element 8t + i


def pack_planes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (N, K) in 0..2^bits-1, K % 8 == 0 -> (bits, N, K/8) uint8 bit planes."""
    N, K = q.shape
    q = q.to(torch.uint8).view(1, N, K // 8, 8)
    planes = torch.arange(bits, dtype=torch.uint8).view(bits, 1, 1, 1)
    bit = (q >> planes) & 1  # (bits, N, K/8, 8): bit p of element 8t + i
    return (bit << _SHIFTS).sum(-1, dtype=torch.uint8)


def unpack_planes(qweight: torch.Tensor) -> torch.Tensor:
    """(bits, N, K/8) uint8 -> codes (N, K) uint8; inverse of pack_planes."""
    bits, N, nbytes = qweight.shape
    bit = (qweight.unsqueeze(-1) >> _SHIFTS) & 1  # (bits, N, K/8, 8)
    planes = torch.arange(bits, dtype=torch.uint8).view(bits, 1, 1, 1)
    return (bit << planes).sum(0, dtype=torch.uint8).view(N, 8 * nbytes)


class LutLinear(QuantLinear):
    """b-bit bit-plane format; registered as lut1..lut4 by the subclasses below."""

    bits: ClassVar[int]
    defaults: ClassVar[dict] = {"group_size": 64}

    def __init__(self, qweight, scales, mins, params: dict, bias=None):
        super().__init__(8 * qweight.shape[2], qweight.shape[1], params, bias)
        self.group_size: int = params["group_size"]
        self.register_buffer("qweight", qweight)  # (bits, N, K/8) uint8
        self.register_buffer("scales", scales)  # (N, K/g) float16
        self.register_buffer("mins", mins)  # (N, K/g) float16

    @classmethod
    def resolve_params(cls, params: dict) -> dict:
        p = check_params(cls.format, params, cls.defaults)
        p = {"group_size": int(p["group_size"])}
        if p["group_size"] <= 0 or p["group_size"] % 8:
            raise InferError(f"{cls.format}: group_size must be a positive multiple of 8")
        return p

    @classmethod
    def from_float(cls, weight, bias=None, *, search: bool = True, **params):
        p = cls.resolve_params(params)
        w = check_weight(cls.format, weight, p["group_size"])
        q, s, m = fit_groups(w, p["group_size"], 0, 2**cls.bits - 1, affine=True, search=search)
        return cls(pack_planes(q, cls.bits), s, m, p, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "mins": self.mins}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict, bias=None):
        p = cls.resolve_params(params)
        qweight, scales, mins = tensors.get("qweight"), tensors.get("scales"), tensors.get("mins")
        if qweight is None or qweight.dtype != torch.uint8 or qweight.dim() != 3:
            raise InferError(f"{cls.format}: qweight must be a 3-D uint8 tensor")
        if qweight.shape[0] != cls.bits:
            raise InferError(f"{cls.format}: qweight has {qweight.shape[0]} planes, not {cls.bits}")
        N, K = qweight.shape[1], 8 * qweight.shape[2]
        if K % p["group_size"]:
            raise InferError(f"{cls.format}: row length {K} is not a multiple of {p['group_size']}")
        groups = (N, K // p["group_size"])
        for name, t in (("scales", scales), ("mins", mins)):
            if t is None or t.dtype != torch.float16 or tuple(t.shape) != groups:
                raise InferError(f"{cls.format}: {name} must be float16 of shape {groups}")
        return cls(qweight, scales, mins, p, bias)

    def kernel_weights(self) -> KernelWeights:
        return KernelWeights(-self.bits, self.group_size, self.qweight, self.scales, self.mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32: the LUT kernel (int8 activation tables; kernels_cpu/reference.py bounds its
        # error); other dtypes, or no C extension: dequantize and matmul.
        if x.dtype == torch.float32 and x.is_cpu and ops.available():
            y = ops.lut_matmul(x, self.qweight, self.scales, self.mins, self.group_size)
            return y if self.bias is None else y + self.bias
        return super().forward(x)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        qweight, scales, mins = self.qweight, self.scales, self.mins
        if rows is not None:
            qweight, scales, mins = qweight[:, rows], scales[rows], mins[rows]
        R = scales.shape[0]
        q = unpack_planes(qweight).view(R, scales.shape[1], -1).float()  # (R, groups, g)
        w = q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)  # q * s + m
        return w.view(R, self.in_features)


@register
class Lut1Linear(LutLinear):
    format = "lut1"
    bits = 1


@register
class Lut2Linear(LutLinear):
    format = "lut2"
    bits = 2


@register
class Lut3Linear(LutLinear):
    format = "lut3"
    bits = 3


@register
class Lut4Linear(LutLinear):
    format = "lut4"
    bits = 4
