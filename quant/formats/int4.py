"""int4: 4-bit group quantization, compatible with GGUF Q4_0 and Q4_1.

Format (what `dequantize` computes; `params` = {"group_size": g, "symmetric": bool}):

    symmetric=True  (Q4_0 when g = 32):  w[n, k] = (q[n, k] - 8) * d[n, k // g]
    symmetric=False (Q4_1 when g = 32):  w[n, k] =  q[n, k] * d[n, k // g] + m[n, k // g]

with q in 0..15 and d, m float16 (d may be negative, as in ggml's Q4_0), evaluated in
float32 as written: one product, then a separate sum (no FMA), the operation order ggml
uses, so imported GGUF blocks dequantize bit for bit as gguf does. g is 32, 64 or 128;
K must be a multiple of g.

Packed tensors (N = out_features, K = in_features):

    qweight  uint8   (N, K/2)  each run of 32 elements k0..k0+31 of a row is 16 bytes;
                               byte k0/2 + i holds element k0+i in its low nibble and
                               element k0+16+i in its high nibble (i = 0..15)
    scales   float16 (N, K/g)  d
    mins     float16 (N, K/g)  m (symmetric=False only)

The nibble order is ggml's block_q4_0/q4_1 `qs` order: a kernel gets 16 consecutive
elements from 16 bytes with one AND 0x0F and the next 16 with one shift right by 4,
and one 32-element run is exactly one GGUF block's `qs`, so GGUF import copies bytes.

Its codes are fitted by fit.py's `fit_groups`, as every group-quantized format's are.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import InferError
from ...kernels_cpu import ops as kernels
from .base import KernelWeights, QuantLinear, register
from .fit import check_group_size, check_params, check_weight, fit_groups

# ---------------------------------------------------------------------------------------
# Nibble packing
# ---------------------------------------------------------------------------------------


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in 0..15, K % 32 == 0 -> (N, K/2) uint8 in ggml's nibble order."""
    N, K = q.shape
    q = q.to(torch.uint8).view(N, K // 32, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).view(N, K // 2)


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> codes (N, K) uint8; inverse of pack_nibbles."""
    N, half = qweight.shape
    b = qweight.view(N, half // 16, 1, 16)
    return torch.cat((b & 0x0F, b >> 4), dim=2).view(N, 2 * half)


# ---------------------------------------------------------------------------------------
# The format
# ---------------------------------------------------------------------------------------


@register
class Int4Linear(QuantLinear):
    format: ClassVar[str] = "int4"
    defaults: ClassVar[dict] = {"group_size": 32, "symmetric": False}
    group_sizes: ClassVar[tuple[int, ...]] = (32, 64, 128)

    def __init__(self, qweight, scales, mins, params: dict, bias=None):
        super().__init__(2 * qweight.shape[1], qweight.shape[0], params, bias)
        self.group_size: int = params["group_size"]
        self.symmetric: bool = params["symmetric"]
        self.register_buffer("qweight", qweight)  # (N, K/2) uint8
        self.register_buffer("scales", scales)  # (N, K/g) float16
        self.register_buffer("mins", mins)  # (N, K/g) float16, or None when symmetric

    @classmethod
    def resolve_params(cls, params: dict) -> dict:
        p = check_params(cls.format, params, cls.defaults)
        g = check_group_size(cls.format, int(p["group_size"]), cls.group_sizes)
        return {"group_size": g, "symmetric": bool(p["symmetric"])}

    @classmethod
    def from_float(cls, weight, bias=None, *, search: bool = True, **params):
        p = cls.resolve_params(params)
        w = check_weight(cls.format, weight, p["group_size"])
        if p["symmetric"]:
            c, d, _ = fit_groups(w, p["group_size"], -8, 7, affine=False, search=search)
            q, m = c + 8, None
        else:
            q, d, m = fit_groups(w, p["group_size"], 0, 15, affine=True, search=search)
        return cls(pack_nibbles(q), d, m, p, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        t = {"qweight": self.qweight, "scales": self.scales}
        if self.mins is not None:
            t["mins"] = self.mins
        return t

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict, bias=None):
        p = cls.resolve_params(params)
        qweight, scales, mins = tensors.get("qweight"), tensors.get("scales"), tensors.get("mins")
        if qweight is None or qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise InferError("int4: qweight must be a 2-D uint8 tensor")
        N, K = qweight.shape[0], 2 * qweight.shape[1]
        groups = (N, K // p["group_size"])
        if K % p["group_size"]:
            raise InferError(f"int4: row length {K} is not a multiple of {p['group_size']}")
        if scales is None or scales.dtype != torch.float16 or tuple(scales.shape) != groups:
            raise InferError(f"int4: scales must be float16 of shape {groups}")
        if p["symmetric"] != (mins is None):
            raise InferError("int4: mins are present exactly when symmetric is false")
        if mins is not None and (mins.dtype != torch.float16 or tuple(mins.shape) != groups):
            raise InferError(f"int4: mins must be float16 of shape {groups}")
        return cls(qweight, scales, mins, p, bias)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        qweight, scales, mins = self.qweight, self.scales, self.mins
        if rows is not None:
            qweight, scales = qweight[rows], scales[rows]
            mins = None if mins is None else mins[rows]
        R, g = qweight.shape[0], self.group_size
        q = unpack_nibbles(qweight).view(R, -1, g).float()  # (R, K/g, g)
        if mins is None:
            w = (q - 8) * scales.float().unsqueeze(-1)  # ggml: (q - 8) * d
        else:
            w = q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)  # q * d + m
        return w.view(R, self.in_features)

    def kernel_weights(self) -> KernelWeights:
        return KernelWeights(4, self.group_size, self.qweight, self.scales, self.mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # The C kernels (GEMV for one row, tiled GEMM for more; the torch reference,
            # with one warning, when the extension is not built).
            y = kernels.q4_matmul(x, self.qweight, self.scales, self.mins, self.group_size)
            return y if self.bias is None else y + self.bias
        return super().forward(x)
