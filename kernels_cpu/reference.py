"""The kernels' definitions in plain torch: what the C computes, up to summation order.

Each function dequantizes W exactly as its format defines it (quant/formats/int8.py,
quant/formats/int4.py, int5.py: one float32 product, then a separate sum; q4k.py, q5k.py,
q2k.py: the sub-block's scale and min as products, then q times the scale minus the min;
quant/formats/int6.py: exact products) and computes y = x W^T in float32. The LUT kernel's reference (lut_matmul) is its
int8-table arithmetic instead; lut_matmul_exact is the format's product. Kept free of
imports from quant/, which routes its forwards through this package.
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


def unpack_int5(qweight: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """(N, K/2) nibbles (int4's order) and (N, K/8) high bits -> codes (N, K) uint8 in
    0..31: element j of a block of 32 takes bit j of its block's little-endian uint32."""
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    shifts = torch.arange(8, dtype=torch.uint8)
    hi = (qh.view(N, K // 32, 4, 1) >> shifts) & 1  # (N, K/32, byte, bit)
    return unpack_int4(qweight) | (hi.view(N, K) << 4)


def dequantize_int5(qweight, qh, scales, mins) -> torch.Tensor:
    """int5 g32: symmetric (q - 16) * d (Q5_0), asymmetric q * d + m (Q5_1)."""
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    q = unpack_int5(qweight, qh).view(N, K // 32, 32).float()
    d = scales.float().unsqueeze(-1)
    w = (q - 16) * d if mins is None else q * d + mins.float().unsqueeze(-1)
    return w.view(N, K)


def k_scales_mins(packed: torch.Tensor):
    """Q4_K / Q5_K's 12 bytes (..., 12) -> the 8 sub-blocks' 6-bit scales and mins, each
    (..., 8) int64 (ggml's get_scale_min_k4)."""
    packed = packed.long()
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), -1)
    m = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), -1)
    return sc, m


def k_low_bits(qs: torch.Tensor) -> torch.Tensor:
    """qs (N, B, 128): 4 runs of 32 bytes, the low nibbles sub-block 2r, the high ones
    sub-block 2r + 1 -> the codes' low 4 bits (N, B, 8, 32)."""
    qs = qs.reshape(*qs.shape[:2], 4, 1, 32)
    return torch.cat((qs & 15, qs >> 4), 3).view(*qs.shape[:2], 8, 32)


def dequantize_q4k(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/256*144) uint8 blocks (GGUF Q4_K's) -> (N, K): (d * sc) * q - (dmin * m) per
    sub-block of 32, in float32 as gguf-py evaluates it (three roundings)."""
    N, B = qweight.shape[0], qweight.shape[1] // 144
    b = qweight.view(N, B, 144)
    d, dmin = (b[..., at : at + 2].contiguous().view(torch.float16).float() for at in (0, 2))
    sc, m = k_scales_mins(b[..., 4:16])
    q = k_low_bits(b[..., 16:]).float()  # (N, B, 8, 32)
    w = (d * sc.float()).unsqueeze(-1) * q - (dmin * m.float()).unsqueeze(-1)
    return w.view(N, B * 256)


def dequantize_q5k(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/256*176) uint8 blocks (GGUF Q5_K's) -> (N, K): as dequantize_q4k, each code's
    bit 4 from qh (bit j of qh[i]: element i of sub-block j), gguf-py's order."""
    N, B = qweight.shape[0], qweight.shape[1] // 176
    b = qweight.view(N, B, 176)
    d, dmin = (b[..., at : at + 2].contiguous().view(torch.float16).float() for at in (0, 2))
    sc, m = k_scales_mins(b[..., 4:16])
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    high = (b[..., 16:48].reshape(N, B, 1, 32) >> shifts) & 1  # (N, B, 8, 32)
    q = (k_low_bits(b[..., 48:]) | (high << 4)).float()
    w = (d * sc.float()).unsqueeze(-1) * q - (dmin * m.float()).unsqueeze(-1)
    return w.view(N, B * 256)


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


def pack_int6(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """unpack_int6's inverse: codes q (N, K) in 0..63, sc (N, K/16) int8, d (N, K/256)
    float16 -> (N, K/256*210) uint8 blocks."""
    N, K = q.shape
    B = K // 256
    q = q.to(torch.uint8).view(N, B, 2, 4, 32)  # (block, half, quarter, i): 128 h + 32 j + i
    lo, hi = q & 15, q >> 4
    ql = (lo[:, :, :, 0:2] | (lo[:, :, :, 2:4] << 4)).reshape(N, B, 128)
    qh = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    blocks = torch.cat(
        (
            ql,
            qh.reshape(N, B, 64),
            sc.contiguous().view(torch.uint8).view(N, B, 16),
            d.contiguous().view(torch.uint8).view(N, B, 2),
        ),
        -1,
    )
    return blocks.reshape(N, B * 210)


def unpack_q3k(qweight: torch.Tensor):
    """(N, K/256*110) uint8 blocks (GGUF Q3_K's) -> codes (N, K) int8 in -4..3, sc
    (N, K/16) int8 in -32..31 and d (N, K/256) float16. ggml's dequantize_row_q3_K reads
    element 128 h + 32 j + i (half h, quarter j, i < 32) as bits 2j of qs[32 h + i], minus
    4 unless bit 4h + j of hmask[i] is set, in group (128 h + 32 j + i) // 16; the 16 6-bit
    scales take their low 4 bits from byte g % 8 (nibble g // 8) and their high 2 from
    byte 8 + g % 4 (bits 2 (g // 4)), minus 32."""
    N, B = qweight.shape[0], qweight.shape[1] // 110
    b = qweight.view(N, B, 110)
    hmask, qs, packed = b[..., :32], b[..., 32:96], b[..., 96:108]
    g = torch.arange(16)
    low = (packed[..., g % 8] >> (4 * (g // 8)).to(torch.uint8)) & 15
    high = (packed[..., 8 + g % 4] >> (2 * (g // 4)).to(torch.uint8)) & 3
    sc = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(N, B * 16)
    j = torch.arange(4, dtype=torch.uint8).view(4, 1)
    qs = qs.reshape(N, B, 2, 1, 32)  # (half, -, i)
    hj = (4 * torch.arange(2, dtype=torch.uint8).view(2, 1, 1) + j).view(2, 4, 1)
    low2 = (qs >> (2 * j)) & 3  # (N, B, half, quarter, i)
    set_ = (hmask.reshape(N, B, 1, 1, 32) >> hj) & 1
    q = (low2.to(torch.int8) - 4 * (1 - set_.to(torch.int8))).reshape(N, B * 256)
    d = b[..., 108:].contiguous().view(torch.float16).reshape(N, B)
    return q, sc, d


def pack_q3k(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """unpack_q3k's inverse: codes q (N, K) in -4..3, sc (N, K/16) in -32..31, d (N, K/256)
    float16 -> (N, K/256*110) uint8 blocks."""
    N, K = q.shape
    B = K // 256
    c = (q.to(torch.int16) + 4).to(torch.uint8).view(N, B, 2, 4, 32)  # 0..7: (half, j, i)
    low2, high = c & 3, c >> 2
    qs = (
        low2[:, :, :, 0]
        | (low2[:, :, :, 1] << 2)
        | (low2[:, :, :, 2] << 4)
        | (low2[:, :, :, 3] << 6)
    )
    bits = high.view(N, B, 8, 32) << torch.arange(8, dtype=torch.uint8).view(8, 1)  # bit 4h + j
    hmask = bits.sum(2, dtype=torch.uint8)  # disjoint bits: the sum is their OR
    s = (sc.to(torch.int16) + 32).to(torch.uint8).view(N, B, 16)
    packed = torch.cat(
        (
            (s[..., 0:8] & 15) | ((s[..., 8:16] & 15) << 4),
            ((s[..., 0:4] >> 4) | ((s[..., 4:8] >> 4) << 2) | ((s[..., 8:12] >> 4) << 4)
             | ((s[..., 12:16] >> 4) << 6)),
        ),
        -1,
    )  # fmt: skip
    halves = d.contiguous().view(torch.uint8).view(N, B, 2)
    return torch.cat((hmask, qs.reshape(N, B, 64), packed, halves), -1).reshape(N, B * 110)


def dequantize_q3k(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/256*110) uint8 -> (N, K): (d * sc) * q per group of 16, both products exact."""
    q, sc, d = unpack_q3k(qweight)
    N = q.shape[0]
    step = d.float().repeat_interleave(16, 1) * sc.float()  # (N, K/16)
    return (q.float().view(N, -1, 16) * step.unsqueeze(-1)).view(N, -1)


# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def unpack_iq4xs(qweight: torch.Tensor):
    """(N, K/256*136) uint8 blocks (GGUF IQ4_XS's) -> codes (N, K) uint8 in 0..15 (indices
    into IQ4_VALUES), sc (N, K/32) int8 in -32..31 and d (N, K/256) float16. A block is d,
    scales_h (uint16: sub-block j's high 2 bits at bits 2j), scales_l[4] (j's low 4 bits in
    byte j / 2, nibble j % 2), then per sub-block of 32 16 bytes: elements i (low nibble)
    and 16 + i (high)."""
    N, B = qweight.shape[0], qweight.shape[1] // 136
    b = qweight.view(N, B, 136)
    d = b[..., :2].contiguous().view(torch.float16).reshape(N, B)
    high = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # (N, B, 1)
    j = torch.arange(8)
    low = (b[..., 4 + j // 2].to(torch.int32) >> (4 * (j % 2))) & 15
    sc = (low | (((high >> (2 * j)) & 3) << 4)) - 32  # (N, B, 8)
    qs = b[..., 8:].reshape(N, B, 8, 1, 16)
    q = torch.cat((qs & 15, qs >> 4), 3).reshape(N, B * 256)
    return q, sc.to(torch.int8).reshape(N, B * 8), d


def pack_iq4xs(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """unpack_iq4xs's inverse: codes q (N, K) in 0..15, sc (N, K/32) in -32..31, d (N, K/256)
    float16 -> (N, K/256*136) uint8 blocks."""
    N, K = q.shape
    B = K // 256
    c = q.to(torch.uint8).view(N, B, 8, 2, 16)
    qs = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(N, B, 128)
    s = (sc.to(torch.int32) + 32).view(N, B, 8)
    high = ((s >> 4) << (2 * torch.arange(8))).sum(-1, keepdim=True)  # disjoint bits
    low = (s[..., 0::2] & 15) | ((s[..., 1::2] & 15) << 4)
    halves = torch.cat(
        (d.contiguous().view(torch.uint8).view(N, B, 2),
         high.to(torch.int16).view(torch.uint8).view(N, B, 2)), -1,
    )  # fmt: skip
    return torch.cat((halves, low.to(torch.uint8), qs), -1).reshape(N, B * 136)


def dequantize_iq4xs(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/256*136) uint8 -> (N, K): (d * sc) * value[q] per sub-block of 32, both
    products exact (11 + 6 + 8 bits)."""
    q, sc, d = unpack_iq4xs(qweight)
    N = q.shape[0]
    dl = d.float().repeat_interleave(8, 1) * sc.float()  # (N, K/32)
    v = torch.tensor(IQ4_VALUES, dtype=torch.float32)[q.long()]
    return (v.view(N, -1, 32) * dl.unsqueeze(-1)).view(N, -1)


def unpack_q2k(qweight: torch.Tensor):
    """(N, K/256*84) uint8 blocks (GGUF Q2_K's) -> codes (N, K) uint8 in 0..3, sc and m
    (N, K/16) uint8 in 0..15, d and dmin (N, K/256) float16. Element 128 h + 32 j + i
    (half h, quarter j, i < 32) is bits 2j of qs[32 h + i], in group (128 h + 32 j + i)
    // 16, whose byte of scales holds sc (low nibble) and m (high)."""
    N, B = qweight.shape[0], qweight.shape[1] // 84
    b = qweight.view(N, B, 84)
    scales, qs = b[..., :16], b[..., 16:80].reshape(N, B, 2, 1, 32)
    j = torch.arange(4, dtype=torch.uint8).view(4, 1)
    q = ((qs >> (2 * j)) & 3).reshape(N, B * 256)  # (half, quarter, i)
    d, dmin = (
        b[..., at : at + 2].contiguous().view(torch.float16).reshape(N, B) for at in (80, 82)
    )
    return q, (scales & 15).reshape(N, B * 16), (scales >> 4).reshape(N, B * 16), d, dmin


def pack_q2k(q, sc, m, d, dmin) -> torch.Tensor:
    """unpack_q2k's inverse: codes q (N, K) in 0..3, sc and m (N, K/16) in 0..15, d and
    dmin (N, K/256) float16 -> (N, K/256*84) uint8 blocks."""
    N, K = q.shape
    B = K // 256
    c = q.to(torch.uint8).view(N, B, 2, 4, 32)
    qs = c[:, :, :, 0] | (c[:, :, :, 1] << 2) | (c[:, :, :, 2] << 4) | (c[:, :, :, 3] << 6)
    scales = (sc.to(torch.uint8) | (m.to(torch.uint8) << 4)).view(N, B, 16)
    halves = torch.stack((d, dmin), -1).contiguous().view(torch.uint8).view(N, B, 4)
    return torch.cat((scales, qs.reshape(N, B, 64), halves), -1).reshape(N, B * 84)


def dequantize_q2k(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/256*84) uint8 -> (N, K): (d * sc) * q - (dmin * m) per group of 16, in
    float32 as gguf-py evaluates it (the products exact, then one rounding)."""
    q, sc, m, d, dmin = unpack_q2k(qweight)
    N = q.shape[0]
    dl = d.float().repeat_interleave(16, 1) * sc.float()  # (N, K/16)
    ml = dmin.float().repeat_interleave(16, 1) * m.float()
    return (q.float().view(N, -1, 16) * dl.unsqueeze(-1) - ml.unsqueeze(-1)).view(N, -1)


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


def q5_matmul(x, qweight, qh, scales, mins) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W int5 (mins None: symmetric)."""
    return F.linear(x, dequantize_int5(qweight, qh, scales, mins))


def iq4xs_matmul(x, qweight) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W iq4_xs."""
    return F.linear(x, dequantize_iq4xs(qweight))


def q2k_matmul(x, qweight) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W q2_k."""
    return F.linear(x, dequantize_q2k(qweight))


def q5k_matmul(x, qweight) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W q5_k."""
    return F.linear(x, dequantize_q5k(qweight))


def q3k_matmul(x, qweight) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W q3_k."""
    return F.linear(x, dequantize_q3k(qweight))


def q4k_matmul(x, qweight) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W q4_k."""
    return F.linear(x, dequantize_q4k(qweight))


def q6_matmul(x, qweight) -> torch.Tensor:
    """x (..., K) float32 -> (..., N): x W^T with W int6."""
    return F.linear(x, dequantize_int6(qweight))


# ---------------------------------------------------------------------------------------
# lut1..lut4 (quant/formats/lut.py): the T-MAC LUT GEMM (csrc/lut.c)
#
# The C builds, once per activation row, an int8 table for every 4 activations and looks
# weight nibbles up in it; no weight is ever multiplied:
#
#     S_j[idx] = sum_i (2 bit_i(idx) - 1) x[4j + i]     (S_j[15 - idx] = -S_j[idx]: 8 of
#                                                        16 computed, 8 mirrored)
#     t_j = rint(S_j * 127 / amax_G)                    one scale per weight group G:
#                                                       amax_G = max over G of sum_i |x[4j+i]|
#     I[n, G] = sum_p 2^p sum_{j in G} t_j[nibble of plane p, row n, j]        (exact int)
#     y[n] = sum_G s * (amax_G / 254 * I + (2^b - 1) / 2 * A_G) + m * A_G       A_G = sum x
#
# (with bits b_k in {0, 1} written as (s_k + 1) / 2, s_k = +-1: sum_k b_k x_k =
# (sum_k s_k x_k + A) / 2, hence the A terms).
#
# Two references: `lut_matmul` is that arithmetic (tables equal to the C's bit for bit,
# group integers exact, the final sum in float64 where the C sums in float32 with FMAs in
# a fixed order: equal to float rounding); `lut_matmul_exact` is the x W^T the format
# defines. The int8 tables err from it by at most half a table step per lookup
# (`lut_table_error_bound`).
# ---------------------------------------------------------------------------------------

# Groups whose amax (largest sum of 4 |x|) is below this get zero tables: keeps 127 / amax
# finite (csrc/lut.h's AMAX_MIN).
LUT_AMAX_MIN = 1e-30


def dequantize_lut(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(b, N, K/8) uint8 bit planes, (N, K/g) float16 scales and mins -> float32 (N, K):
    w = q * s + m (quant/formats/lut.py's definition: one product, then a separate sum)."""
    bits, N, nb = qweight.shape
    shifts = torch.arange(8, dtype=torch.uint8)
    bit = (qweight.unsqueeze(-1) >> shifts) & 1  # (b, N, K/8, 8): bit p of element 8t + i
    planes = torch.arange(bits, dtype=torch.uint8).view(bits, 1, 1, 1)
    q = (bit << planes).sum(0, dtype=torch.uint8).view(N, -1, group_size).float()
    return (q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)).view(N, 8 * nb)


def lut_matmul_exact(x, qweight, scales, mins, group_size: int) -> torch.Tensor:
    """x (..., K) -> (..., N): the exact x W^T the format defines."""
    return F.linear(x, dequantize_lut(qweight, scales, mins, group_size))


def lut_build_tables(x: torch.Tensor, bits: int, group_size: int):
    """x (M, K) float32 -> tables (M, K/4, 16) int8 and c1, c2, asum (M, K/g) float32,
    in the C's float operation order (so equal to it bit for bit)."""
    M, K = x.shape
    ng, tpg = K // group_size, group_size // 4
    a0, a1, a2, a3 = x.float().reshape(M, K // 4, 4).unbind(-1)
    amax = (((a0.abs() + a1.abs()) + a2.abs()) + a3.abs()).view(M, ng, tpg).amax(-1)
    s4 = (((a0 + a1) + a2) + a3).view(M, ng, tpg)
    asum = torch.zeros(M, ng)
    for j in range(tpg):  # a sequential sum, as the C
        asum = asum + s4[..., j]
    inv = torch.where(amax >= LUT_AMAX_MIN, 127.0 / amax, torch.zeros(()))
    c1 = (amax / 127.0) * 0.5
    c2 = (0.5 * (2**bits - 1)) * asum
    # entries idx = 0..7 (bit 3 clear: -a3); bit i of idx set -> +a_i
    p01 = torch.stack([-a0 - a1, a0 - a1, -a0 + a1, a0 + a1], -1)  # idx & 3
    a2, a3 = a2.unsqueeze(-1), a3.unsqueeze(-1)
    e = torch.cat([(p01 - a2) - a3, (p01 + a2) - a3], -1)  # (M, K/4, 8)
    r = torch.round(e * inv.repeat_interleave(tpg, 1).unsqueeze(-1)).clamp(-127, 127)
    return torch.cat([r, -r.flip(-1)], -1).to(torch.int8), c1, c2, asum


def _lut_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """(b, N, K/8) -> (b, N, K/4) int64: the 4-bit index of elements 4j..4j+3 (byte j/2,
    low nibble for even j)."""
    b, N, nb = qweight.shape
    return torch.stack([qweight & 15, qweight >> 4], -1).view(b, N, 2 * nb).long()


def lut_group_integers(x, qweight, group_size: int) -> torch.Tensor:
    """(M, N, K/g) int64: I = sum_p 2^p sum_{j in G} t_j[nibble] (exact)."""
    bits, N, nb = qweight.shape
    t = lut_build_tables(x.reshape(-1, 8 * nb), bits, group_size)[0].long()  # (M, K/4, 16)
    nib = _lut_nibbles(qweight).permute(1, 2, 0)  # (N, K/4, b)
    w = 2 ** torch.arange(bits)
    out = []
    for tm in t:  # one activation row at a time: (N, K/4, b) lookups
        look = torch.gather(tm.unsqueeze(0).expand(N, -1, -1), 2, nib)
        out.append((look * w).sum(-1).view(N, -1, group_size // 4).sum(-1))
    return torch.stack(out)


def lut_matmul(x, qweight, scales, mins, group_size: int) -> torch.Tensor:
    """x (..., K) -> (..., N) float32: the kernel's int8-table arithmetic in torch."""
    bits, N, nb = qweight.shape
    x2 = x.reshape(-1, 8 * nb).float()
    _, c1, c2, asum = lut_build_tables(x2, bits, group_size)
    I = lut_group_integers(x2, qweight, group_size).double()  # (M, N, G)
    u = c1.double().unsqueeze(1) * I + c2.double().unsqueeze(1)
    y = (scales.double() * u + mins.double() * asum.double().unsqueeze(1)).sum(-1)
    return y.float().view(*x.shape[:-1], N)


def lut_table_error_bound(x, scales, bits: int, group_size: int) -> torch.Tensor:
    """(..., N): the most the int8 tables can move y from the exact x W^T: half a table
    step (amax_G / 254) per lookup, (2^b - 1) g / 4 lookups' worth per group, times
    |s| / 2:  |y - x W^T| <= sum_G |s[n, G]| (2^b - 1) (g / 4) amax_G / 508."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    M, K = x2.shape
    amax = x2.abs().view(M, K // 4, 4).sum(-1).view(M, K // group_size, -1).amax(-1)
    step = amax.double() / 254 * (2**bits - 1) * (group_size / 4) / 2  # (M, G)
    return (step @ scales.double().abs().T).view(*x.shape[:-1], scales.shape[0])
