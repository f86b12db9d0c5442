"""Formats held as ggml super-blocks of 256 weights, exactly as in a GGUF file: one uint8
tensor (N, K / 256 * block_bytes) and nothing else (int6 is Q6_K's blocks; q5_k, q4_k,
q3_k, q2_k and iq4_xs Q5_K's, Q4_K's, Q3_K's, Q2_K's and IQ4_XS's).

A subclass gives its block size, the kernels' id for it, and three functions (as
staticmethods): fitting float rows into blocks, the torch reference that dequantizes
them, and the kernels' matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from ... import InferError
from .base import KernelWeights, QuantLinear
from .fit import GroupSizeError, check_params, check_weight

QK = 256  # weights per super-block
_FIT_ELEMENTS = 1 << 21  # rows fitted at once: the fit's temporaries stay a few MB


class SuperBlockLinear(QuantLinear):
    defaults: ClassVar[dict] = {}
    block_bytes: ClassVar[int]
    kind: ClassVar[int]  # the kernels' id (csrc/kernels.h)
    # (rows (n, K) float32, search) -> blocks (n, K / 256 * block_bytes) uint8
    fit_blocks: ClassVar[Callable[[torch.Tensor, bool], torch.Tensor]]
    dequantize_blocks: ClassVar[Callable[[torch.Tensor], torch.Tensor]]
    matmul: ClassVar[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]

    def __init__(self, qweight, params: dict, bias=None):
        super().__init__(qweight.shape[1] // self.block_bytes * QK, qweight.shape[0], params, bias)
        self.register_buffer("qweight", qweight)  # (N, K/256 * block_bytes) uint8

    @classmethod
    def resolve_params(cls, params: dict) -> dict:
        return check_params(cls.format, params, cls.defaults)

    @classmethod
    def from_float(cls, weight, bias=None, *, search: bool = True, **params):
        p = cls.resolve_params(params)
        if weight.dim() == 2 and weight.shape[1] % QK:
            raise GroupSizeError(
                f"{cls.format}: row length {weight.shape[1]} is not a multiple of its blocks of {QK}"
            )
        w = check_weight(cls.format, weight, QK)
        rows = max(1, _FIT_ELEMENTS // w.shape[1])
        parts = [cls.fit_blocks(w[r0 : r0 + rows], search) for r0 in range(0, w.shape[0], rows)]
        return cls(torch.cat(parts), p, bias)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict, bias=None):
        p = cls.resolve_params(params)
        qweight, name = tensors.get("qweight"), cls.format
        if qweight is None or qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise InferError(f"{name}: qweight must be a 2-D uint8 tensor")
        if qweight.shape[1] % cls.block_bytes or qweight.shape[1] == 0:
            raise InferError(
                f"{name}: qweight rows must be whole blocks of {cls.block_bytes} bytes"
            )
        if set(tensors) - {"qweight"}:
            raise InferError(f"{name}: unexpected tensors {sorted(set(tensors) - {'qweight'})}")
        return cls(qweight, p, bias)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.dequantize_blocks(self.qweight if rows is None else self.qweight[rows])

    def kernel_weights(self) -> KernelWeights:
        return KernelWeights(self.kind, QK, self.qweight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            y = self.matmul(x, self.qweight)
            return y if self.bias is None else y + self.bias
        return super().forward(x)
