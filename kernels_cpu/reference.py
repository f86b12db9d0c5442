"""The kernels' definitions in plain torch: what the C computes, up to summation order.

Each function dequantizes W exactly as its format defines it (quant/int8.py,
quant/int4.py: one float32 product, then a separate sum; quant/int6.py: exact products)
and computes y = x W^T in
float32. Kept free of imports from quant/, which routes its forwards through this
package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> codes (N, K) uint8: each 32-element run is 16 bytes, byte i holds
    element i in its low nibble and element 16 + i in its high nibble."""
    N, half = qweight.shape
    b = qweight.view(N, half // 16, 1, 16)
    return torch.cat((b & 0x0F, b >> 4), dim=2).view(N, 2 * half)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8 (N, K) with float16 (N, K/g) scales, or float32 (N, 1) when group_size is 0."""
    N, K = qweight.shape
    g = group_size or K
    w = qweight.view(N, K // g, g).float() * scales.float().unsqueeze(-1)  # q * d
    return w.view(N, K)


def dequantize_int4(qweight, scales, mins, group_size: int) -> torch.Tensor:
    """uint8 (N, K/2) with float16 (N, K/g) scales and mins (None: symmetric)."""
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    q = unpack_int4(qweight).view(N, K // group_size, group_size).float()
    d = scales.float().unsqueeze(-1)
    w = (q - 8) * d if mins is None else q * d + mins.float().unsqueeze(-1)
    return w.view(N, K)


def unpack_int6(qweight: torch.Tensor):
    """(N, K/256*210) uint8 blocks (GGUF Q6_K's) -> codes (N, K) uint8 in 0..63, sc
    (N, K/16) int8 and d (N, K/256) float16. Per half h of a block and i < 32: ql[i] and
    ql[32 + i] hold elements i and 32 + i (low nibbles), 64 + i and 96 + i (high); bits
    2j..2j+1 of qh[i] are the top bits of element 32 j + i."""
    N, B = qweight.shape[0], qweight.shape[1] // 210
    b = qweight.view(N, B, 210)
    ql = b[..., :128].reshape(N, B, 2, 2, 32)  # (half, ql[i] / ql[32 + i], i)
    qh = b[..., 128:192].reshape(N, B, 2, 1, 32)
    lo = torch.cat((ql & 15, ql >> 4), 3)  # (half, quarter j, i): element 128 h + 32 j + i
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    q = (lo | (hi << 4)).reshape(N, B * 256)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(N, B * 16)
    d = b[..., 208:].contiguous().view(torch.float16).reshape(N, B)
    return q, sc, d


def dequantize_int6(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/256*210) uint8 -> (N, K): d * sc * (q - 32), every product exact."""
    q, sc, d = unpack_int6(qweight)
    N = q.shape[0]
    step = d.float().repeat_interleave(16, 1) * sc.float()  # (N, K/16)
    return ((q.float() - 32).view(N, -1, 16) * step.unsqueeze(-1)).view(N, -1)


def q8_matmul(x, qweight, scales, group_size: int) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W int8."""
    return F.linear(x, dequantize_int8(qweight, scales, group_size))


def q4_matmul(x, qweight, scales, mins, group_size: int) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W int4 (mins None: symmetric)."""
    return F.linear(x, dequantize_int4(qweight, scales, mins, group_size))


def q6_matmul(x, qweight) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W int6."""
    return F.linear(x, dequantize_int6(qweight))
