"""One tensor of a GGUF file, and its dequantization to a torch tensor.

Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and Q6_K are dequantized here, bit-exact with
gguf.quants.dequantize; other types through that function.
"""

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from ... import InferError

PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.BF16: np.dtype("<u2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file, its data a view of the file's map (or a reordered copy)."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows, cols) = reversed GGUF dims
    # Plain types: the typed array in `shape` (BF16 as uint16 bits). Block-quantized types:
    # uint8 of shape (*shape[:-1], bytes_per_row), the raw ggml blocks of each row.
    data: np.ndarray
    offset: int = -1  # absolute byte offset in the file; -1 for a copy (un-permuted rows)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, start: int, stop: int) -> "GGUFTensor":
        """Rows [start, stop) of a 2-D tensor: a view, at its place in the file."""
        data = self.data[start:stop]
        offset = self.offset + start * self.data.strides[0] if self.offset >= 0 else -1
        return replace(self, shape=(len(data), *self.shape[1:]), data=data, offset=offset)


def block_bytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Byte shape of a block-quantized tensor: each row of `cols` values is cols/block blocks."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return (*shape[:-1], shape[-1] // block_size * type_size)


# ---------------------------------------------------------------------------------------
# Dequantization
# ---------------------------------------------------------------------------------------
# Block layouts from ggml-common.h (QK = 32 values per block; d, m are fp16):
#   Q8_0: d, int8 qs[32]                        value = qs[i] * d
#   Q4_0: d, uint8 qs[16]                       value = (q - 8) * d
#   Q4_1: d, m, uint8 qs[16]                    value = q * d + m
#   Q5_0: d, uint32 qh, uint8 qs[16]            value = (q - 16) * d
#   Q5_1: d, m, uint32 qh, uint8 qs[16]         value = q * d + m
#   Q6_K: 256 values: uint8 ql[128], qh[64], int8 scales[16], d
#                                               value = (d * scales[i / 16]) * (q - 32)
# In the 4-bit nibbles, the low nibble of byte j is element j and the high nibble element
# j + 16; Q5 adds bit i of qh as bit 4 of element i. Q6_K's 6-bit q is a nibble of ql and
# 2 bits of qh, per half of the block (see _dequant_q6_k).
# Bit-exact with gguf.quants.dequantize (tests/test_gguf.py checks): the same float32
# operations in the same order -- a product, then for Q4_1/Q5_1 a separate sum (no FMA).


def _nibbles(qs: torch.Tensor, out: torch.Tensor) -> None:
    """Unpack (n, 16) uint8 into (n, 32) float32 `out`: low nibbles 0..15, high 16..31."""
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 scalar at byte `at` of each block as a (n, 1) float32 column."""
    return blocks[:, at : at + 2].view(torch.float16).float()


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8 little-endian qh -> (n, 32) float32 holding bit i of qh times 16."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh.unsqueeze(-1) >> shifts) & 1  # (n, 4, 8): byte b, bit k is element 8b + k
    return bits.reshape(-1, 32).float() * 16


def _dequant_q8_0(b: torch.Tensor) -> torch.Tensor:
    out = b[:, 2:].view(torch.int8).float()
    return out.mul_(_fp16(b, 0))


def _dequant_q4_0(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32)
    _nibbles(b[:, 2:], out)
    return out.sub_(8).mul_(_fp16(b, 0))


def _dequant_q4_1(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32)
    _nibbles(b[:, 4:], out)
    return out.mul_(_fp16(b, 0)).add_(_fp16(b, 2))


def _dequant_q5_0(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32)
    _nibbles(b[:, 6:], out)
    return out.add_(_high_bits(b[:, 2:6])).sub_(16).mul_(_fp16(b, 0))


def _dequant_q5_1(b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(b.shape[0], 32)
    _nibbles(b[:, 8:], out)
    return out.add_(_high_bits(b[:, 4:8])).mul_(_fp16(b, 0)).add_(_fp16(b, 2))


_SHIFTS_2BIT = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]  # 4 runs of 2 bits


def _dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    # Each half of the block: ql's 64 bytes low nibbles then high nibbles, 32 values a run
    # (n, 2 halves, 2 nibbles, 64) -> (n, 8 runs, 32); qh's 32 bytes give those runs'
    # bits 4-5 as their bits 0-1, 2-3, 4-5, 6-7.
    ql = b[:, :128].reshape(n, 2, 1, 64)
    ql = torch.cat((ql & 0x0F, ql >> 4), 2).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFTS_2BIT
    q = (ql | ((qh & 3).reshape(n, 8, 32) << 4)).float().sub_(32).reshape(n, 16, 16)
    d = _fp16(b, 208) * b[:, 192:208].view(torch.int8).float()  # (n, 16): d * scales
    return (d.unsqueeze(-1) * q).reshape(n, 256)


_BLOCK_DEQUANT = {
    GGMLQuantizationType.Q6_K: _dequant_q6_k,
    GGMLQuantizationType.Q8_0: _dequant_q8_0,
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: _dequant_q4_1,
    GGMLQuantizationType.Q5_0: _dequant_q5_0,
    GGMLQuantizationType.Q5_1: _dequant_q5_1,
}


def dequantize(t: GGUFTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`t` as a torch tensor of `dtype` in `t.shape`; zero-copy when stored in `dtype` already."""
    if t.ggml_type in PLAIN_DTYPES:
        x = torch.from_numpy(t.data)
        if t.ggml_type == GGMLQuantizationType.BF16:
            x = x.view(torch.bfloat16)  # uint16 bits -> bfloat16, no copy
        return x.to(dtype)
    if t.ggml_type in _BLOCK_DEQUANT:
        _, type_size = GGML_QUANT_SIZES[t.ggml_type]
        blocks = torch.from_numpy(t.data).reshape(-1, type_size)  # (n_blocks, type_size)
        return _BLOCK_DEQUANT[t.ggml_type](blocks).reshape(t.shape).to(dtype)
    try:
        values = gguf_quants.dequantize(t.data, t.ggml_type)
    except NotImplementedError:
        raise InferError(
            f"tensor {t.name!r}: cannot dequantize ggml type {t.ggml_type.name}"
        ) from None
    return torch.from_numpy(values).reshape(t.shape).to(dtype)
