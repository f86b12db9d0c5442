"""int8: symmetric 8-bit quantization, per output channel or in GGUF Q8_0-compatible groups.

Format (what `dequantize` computes; `params` = {"group_size": g}):

    w[n, k] = q[n, k] * d[n, k // g]        q int8; d may be negative

evaluated in float32 as one product, as ggml does, so imported Q8_0 blocks dequantize
bit for bit as gguf does. Our quantizer writes q in -127..127, as ggml's does; a kernel
must still give -128 (possible in any Q8_0 file) its value, e.g. when it uses a sign
trick such as _mm256_sign_epi8.

Packed tensors (N = out_features, K = in_features):

    qweight  int8     (N, K)     row-major
    scales   float32  (N, 1)     g = 0: one scale per output channel (g = K in effect)
             float16  (N, K/g)   g = 32 (Q8_0), 64 or 128; K must be a multiple of g

Per-channel scales are float32 because they cost nothing at one per row and it is what
torch's `_weight_int8pack_mm` takes; group scales are float16 as in Q8_0, so one
32-element run of a row plus its scale is exactly one ggml block_q8_0.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ... import InferError
from ...kernels_cpu import ops as kernels
from .base import KernelWeights, QuantLinear, register
from .fit import check_group_size, check_params, check_weight, fit_groups

# Activation dtypes for which torch's int8 weight-only matmul (per-channel scales only) is
# correct and faster than dequantize + matmul at M = 1. For float32 and float16 it is a
# scalar fallback, slower than dequantize + matmul: float32 takes our C kernels instead,
# float16 the reference path.
_INT8PACK_DTYPES = (torch.bfloat16,)


@register
class Int8Linear(QuantLinear):
    format: ClassVar[str] = "int8"
    defaults: ClassVar[dict] = {"group_size": 32}
    group_sizes: ClassVar[tuple[int, ...]] = (0, 32, 64, 128)

    def __init__(self, qweight, scales, params: dict, bias=None):
        super().__init__(qweight.shape[1], qweight.shape[0], params, bias)
        self.group_size: int = params["group_size"]
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N, 1) float32 or (N, K/g) float16

    @classmethod
    def resolve_params(cls, params: dict) -> dict:
        p = check_params(cls.format, params, cls.defaults)
        note = "; 0 = per output channel"
        return {
            "group_size": check_group_size(cls.format, int(p["group_size"]), cls.group_sizes, note)
        }

    @classmethod
    def from_float(cls, weight, bias=None, *, search: bool = True, **params):
        p = cls.resolve_params(params)
        g = p["group_size"]
        w = check_weight(cls.format, weight, g or weight.shape[-1])
        dtype = torch.float32 if g == 0 else torch.float16
        q, d, _ = fit_groups(
            w, g or w.shape[1], -127, 127, affine=False, dtype=dtype, search=search
        )
        return cls(q.to(torch.int8), d, p, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict, bias=None):
        p = cls.resolve_params(params)
        qweight, scales = tensors.get("qweight"), tensors.get("scales")
        if qweight is None or qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise InferError("int8: qweight must be a 2-D int8 tensor")
        N, K = qweight.shape
        g = p["group_size"]
        if g and K % g:
            raise InferError(f"int8: row length {K} is not a multiple of {g}")
        dtype, shape = (torch.float32, (N, 1)) if g == 0 else (torch.float16, (N, K // g))
        if scales is None or scales.dtype != dtype or tuple(scales.shape) != shape:
            raise InferError(f"int8: scales must be {dtype} of shape {shape}")
        return cls(qweight, scales, p, bias)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        qweight, scales = self.qweight, self.scales
        if rows is not None:
            qweight, scales = qweight[rows], scales[rows]
        R, G = scales.shape
        q = qweight.view(R, G, -1).float()  # (R, groups, group_size)
        return (q * scales.float().unsqueeze(-1)).view(R, self.in_features)  # ggml: q * d

    def kernel_weights(self) -> KernelWeights:
        return KernelWeights(8, self.group_size, self.qweight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # The C kernels (GEMV for one row, tiled GEMM for more; the torch reference,
            # with one warning, when the extension is not built).
            y = kernels.q8_matmul(x, self.qweight, self.scales, self.group_size)
            return y if self.bias is None else y + self.bias
        if self.group_size == 0 and x.dtype in _INT8PACK_DTYPES:
            # (..., K) -> (M, K); scales (N,) in the activation dtype, as the op requires.
            y = torch.ops.aten._weight_int8pack_mm(
                x.reshape(-1, self.in_features), self.qweight, self.scales.view(-1).to(x.dtype)
            ).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        return super().forward(x)
