"""The kernels' definitions in plain torch: what the C computes, up to summation order.

Each function dequantizes W exactly as its format defines it (quant/int8.py,
quant/int4.py: one float32 product, then a separate sum) and computes y = x W^T in
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


def q8_matmul(x, qweight, scales, group_size: int) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W int8."""
    return F.linear(x, dequantize_int8(qweight, scales, group_size))


def q4_matmul(x, qweight, scales, mins, group_size: int) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W int4 (mins None: symmetric)."""
    return F.linear(x, dequantize_int4(qweight, scales, mins, group_size))
