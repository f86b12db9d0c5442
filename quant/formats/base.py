"""One interface for every quantized format.

A `QuantLinear` computes y = x W^T (+ b) from a weight stored in some format. Each
format subclass:
  - `from_float(weight, bias, **params)` quantizes a float (out, in) weight;
  - `forward(x)` runs it (the plain-torch reference until a kernel is wired in);
  - `dequantize(rows=None)` returns the float weight it stands for (the definition);
  - `tensors()` / `from_tensors(...)` give and take its packed buffers, which is all a
    checkpoint stores besides `params` (group size, bits, symmetry).

Formats register themselves by name in `FORMATS`; a checkpoint records the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

FORMATS: dict[str, type[QuantLinear]] = {}


def register(cls: type[QuantLinear]) -> type[QuantLinear]:
    FORMATS[cls.format] = cls
    return cls


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at dotted `name` in `model` (where a layer is swapped for another)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@dataclass(frozen=True)
class KernelWeights:
    """What the C kernels need to run a quantized linear (csrc/kernels.h)."""

    kind: int  # the kernels' format id: 8 int8, 6 int6, 5 int5, 4 int4, 10-13 q2_k-q5_k,
    # 23 iq4_xs, -b a b-bit LUT
    group_size: int  # values per scale; 0 for one scale per output row
    qweight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    qh: torch.Tensor | None = None  # int5's high bits


class QuantLinear(nn.Module):
    format: ClassVar[str]

    def __init__(self, in_features: int, out_features: int, params: dict, bias=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.params = dict(params)  # recorded in the checkpoint's metadata
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    # -- what each format provides -------------------------------------------------

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **params):
        raise NotImplementedError

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (out, in), or only `rows` of it (an embedding lookup)."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """Packed buffers by suffix (e.g. {"qweight": ..., "scales": ...})."""
        raise NotImplementedError

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], params: dict, bias=None):
        raise NotImplementedError

    def kernel_weights(self) -> KernelWeights | None:
        """The buffers and parameters the C kernels run this layer from (the fused decode
        step reads them); None for a format no kernel runs."""
        return None

    # -- shared ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reference path: dequantize and matmul. Formats override with faster paths.
        w = self.dequantize().to(x.dtype)
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    @property
    def nbytes(self) -> int:
        """Bytes of packed weight data (what one full pass reads)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.in_features * self.out_features)

    def extra_repr(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.format}, in={self.in_features}, out={self.out_features}, {params}"


class QuantEmbedding(nn.Module):
    """An embedding table kept in a quantized format: rows are dequantized on lookup.

    With tied embeddings the same QuantLinear is also the output layer, stored once.
    """

    def __init__(self, table: QuantLinear):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize(ids.reshape(-1)).view(*ids.shape, -1)
