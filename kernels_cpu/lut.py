"""lut1..lut4 matmul (T-MAC LUT GEMM): the binding, and the two references it answers to.

The C (csrc/lut.c) builds, once per activation row, an int8 table for every 4
activations and looks weight nibbles up in it; no weight is ever multiplied:

    S_j[idx] = sum_i (2 bit_i(idx) - 1) x[4j + i]     (S_j[15 - idx] = -S_j[idx]: 8 of 16
                                                       computed, 8 mirrored)
    t_j = rint(S_j * 127 / amax_G)                    one scale per weight group G:
                                                      amax_G = max over G of sum_i |x[4j+i]|
    I[n, G] = sum_p 2^p sum_{j in G} t_j[nibble of plane p, row n, j]        (exact int)
    y[n] = sum_G s * (amax_G / 254 * I + (2^b - 1) / 2 * A_G) + m * A_G       A_G = sum x

(with bits b_k in {0, 1} written as (s_k + 1) / 2, s_k = +-1: sum_k b_k x_k =
(sum_k s_k x_k + A) / 2, hence the A terms).

References:
  - `lut_matmul_reference` computes that arithmetic in torch: tables equal to the C's
    bit for bit (`build_tables`), group integers exact, the final float sum in float64
    (the C sums in float32 with FMAs in a fixed order: equal to float rounding).
  - `dequantize` then x W^T is the exact product the format defines. The int8 tables
    err from it by at most half a table step per lookup:
        |y - x W^T| <= sum_G |s[n, G]| * (2^b - 1) * (g / 4) * amax_G / 508   (+ rounding)
    (`table_error_bound`); typically ~1% of |y| for random x (measured in the tests and
    benchmarks/bench_lut.py). On a model: SmolLM2-135M in lut4, wikitext-2 (4 x 512
    tokens), mean KL divergence from the reference 0.1596 with the kernel and 0.1569
    dequantizing, PPL 21.07 and 21.01: the tables add ~2% to lut4's own error.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from . import ops

# The extension with the LUT functions (setup.py builds every csrc/*.c into it; a partial
# development build may leave lut.c out).
_C = ops._C if ops._C is not None and hasattr(ops._C, "lut_matmul") else None


def available() -> bool:
    """Whether the C LUT kernel is built and loaded."""
    return _C is not None


@functools.cache
def _warn_missing() -> None:
    warnings.warn(
        "infer.kernels_cpu: the C LUT kernel is not built; lut matmuls run the slower torch "
        "reference. Reinstall infer (pip install -e .) with a C compiler to build it.",
        RuntimeWarning,
        stacklevel=3,
    )


# Groups whose amax (largest sum of 4 |x|) is below this get zero tables: keeps 127 / amax
# finite (csrc/lut.c's AMAX_MIN).
AMAX_MIN = 1e-30

# ---------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int):
    """(b, N, K/8) uint8 bit planes, (N, K/g) float16 scales and mins -> float32 (N, K):
    w = q * s + m (quant/lut.py's definition: one product, then a separate sum)."""
    bits, N, nb = qweight.shape
    shifts = torch.arange(8, dtype=torch.uint8)
    bit = (qweight.unsqueeze(-1) >> shifts) & 1  # (b, N, K/8, 8): bit p of element 8t + i
    planes = torch.arange(bits, dtype=torch.uint8).view(bits, 1, 1, 1)
    q = (bit << planes).sum(0, dtype=torch.uint8).view(N, -1, group_size).float()
    return (q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)).view(N, 8 * nb)


def matmul_exact(x, qweight, scales, mins, group_size: int) -> torch.Tensor:
    """x (..., K) -> (..., N): the exact x W^T the format defines."""
    return F.linear(x, dequantize(qweight, scales, mins, group_size))


def build_tables(x: torch.Tensor, bits: int, group_size: int):
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
    inv = torch.where(amax >= AMAX_MIN, 127.0 / amax, torch.zeros(()))
    c1 = (amax / 127.0) * 0.5
    c2 = (0.5 * (2**bits - 1)) * asum
    # entries idx = 0..7 (bit 3 clear: -a3); bit i of idx set -> +a_i
    p01 = torch.stack([-a0 - a1, a0 - a1, -a0 + a1, a0 + a1], -1)  # idx & 3
    a2, a3 = a2.unsqueeze(-1), a3.unsqueeze(-1)
    e = torch.cat([(p01 - a2) - a3, (p01 + a2) - a3], -1)  # (M, K/4, 8)
    r = torch.round(e * inv.repeat_interleave(tpg, 1).unsqueeze(-1)).clamp(-127, 127)
    return torch.cat([r, -r.flip(-1)], -1).to(torch.int8), c1, c2, asum


def _nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """(b, N, K/8) -> (b, N, K/4) int64: the 4-bit index of elements 4j..4j+3 (byte j/2,
    low nibble for even j)."""
    b, N, nb = qweight.shape
    return torch.stack([qweight & 15, qweight >> 4], -1).view(b, N, 2 * nb).long()


def group_integers(x, qweight, group_size: int) -> torch.Tensor:
    """(M, N, K/g) int64: I = sum_p 2^p sum_{j in G} t_j[nibble] (exact)."""
    bits, N, nb = qweight.shape
    t = build_tables(x.reshape(-1, 8 * nb), bits, group_size)[0].long()  # (M, K/4, 16)
    nib = _nibbles(qweight).permute(1, 2, 0)  # (N, K/4, b)
    w = 2 ** torch.arange(bits)
    out = []
    for tm in t:  # one activation row at a time: (N, K/4, b) lookups
        look = torch.gather(tm.unsqueeze(0).expand(N, -1, -1), 2, nib)
        out.append((look * w).sum(-1).view(N, -1, group_size // 4).sum(-1))
    return torch.stack(out)


def lut_matmul_reference(x, qweight, scales, mins, group_size: int) -> torch.Tensor:
    """x (..., K) -> (..., N) float32: the kernel's int8-table arithmetic in torch."""
    bits, N, nb = qweight.shape
    x2 = x.reshape(-1, 8 * nb).float()
    _, c1, c2, asum = build_tables(x2, bits, group_size)
    I = group_integers(x2, qweight, group_size).double()  # (M, N, G)
    u = c1.double().unsqueeze(1) * I + c2.double().unsqueeze(1)
    y = (scales.double() * u + mins.double() * asum.double().unsqueeze(1)).sum(-1)
    return y.float().view(*x.shape[:-1], N)


def table_error_bound(x, scales, bits: int, group_size: int) -> torch.Tensor:
    """(..., N): the most the int8 tables can move y from the exact x W^T: half a table
    step (amax_G / 254) per lookup, (2^b - 1) g / 4 lookups' worth per group, times
    |s| / 2."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    M, K = x2.shape
    amax = x2.abs().view(M, K // 4, 4).sum(-1).view(M, K // group_size, -1).amax(-1)
    step = amax.double() / 254 * (2**bits - 1) * (group_size / 4) / 2  # (M, G)
    return (step @ scales.double().abs().T).view(*x.shape[:-1], scales.shape[0])


# ---------------------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------------------


def tables(x: torch.Tensor, bits: int, group_size: int, *, isa: str | None = None):
    """The C's tables for x (M, K), as `build_tables` returns them (for tests)."""
    M, K = x.shape
    x = x.float().contiguous()
    g = group_size
    stride = _C.lut_tables_bytes(K)
    raw = torch.empty(M, stride, dtype=torch.int8)
    c = torch.empty(3, M, K // g)
    _C.lut_tables(
        x.data_ptr(), raw.data_ptr(), c[0].data_ptr(), c[1].data_ptr(), c[2].data_ptr(),
        M, K, bits, g, ops._default_isa() if isa is None else ops._isa_id(isa),
    )  # fmt: skip
    # per 64 elements 256 bytes: table of element group j at 16 * (j % 16 // 2) plus 128
    # if j is odd
    j = torch.arange(K // 4)
    off = (j // 16) * 256 + (j % 2) * 128 + (j % 16 // 2) * 16
    return raw[:, off.unsqueeze(1) + torch.arange(16)], c[0], c[1], c[2]


def kernel_isa(isa: str | None = None) -> str | None:
    """The path lut_matmul runs for `isa` (default: the process's): its AVX-512 path needs
    VNNI and VBMI (avx512vnni on Ice Lake, Zen 4 and later); avx2, avx2vnni and avx512
    run its AVX2 path, NEON its scalar one."""
    if _C is None:
        return None
    i = ops._default_isa() if isa is None else ops._isa_id(isa)
    return ops.ISAS[_C.lut_isa(i)]


def _fail(what: str, t, want: str):
    got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
    if t is not None and not t.is_contiguous():
        got += ", not contiguous"
    raise ValueError(f"lut_matmul: {what} must be a contiguous CPU tensor, {want}; got {got}")


def lut_matmul(x, qweight, scales, mins, group_size: int, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for W in lut1..lut4 (quant/lut.py): qweight uint8
    (b, N, K/8) bit planes, scales and mins float16 (N, K/g), g a multiple of 8; x float32.
    isa: a path by name (default: the best, or INFER_KERNEL_ISA); threads: default
    ops.get_num_threads(). Decode calls it ~200 times a token: each check is one
    expression, messages are built only on failure."""
    g = group_size
    if not (qweight.dtype is torch.uint8 and qweight.dim() == 3 and 1 <= qweight.shape[0] <= 4
            and qweight.is_cpu and qweight.is_contiguous()):  # fmt: skip
        _fail("qweight", qweight, "uint8 (bits, N, K/8), bits 1..4")
    bits, N, nb = qweight.shape
    K = 8 * nb
    if g <= 0 or g % 8 or K % g:
        raise ValueError(f"lut_matmul: group size {g} does not fit K = {K}")
    shape = (N, K // g)
    for name, t in (("scales", scales), ("mins", mins)):
        if not (t.dtype is torch.float16 and t.shape == shape and t.is_cpu
                and t.is_contiguous()):  # fmt: skip
            _fail(name, t, f"float16 {shape}")
    if not (x.dtype is torch.float32 and x.is_cpu and x.dim() > 0 and x.shape[-1] == K):
        if x.dtype is not torch.float32 or not x.is_cpu:
            raise TypeError(f"lut_matmul: x must be a float32 CPU tensor, got {x.dtype}")
        raise ValueError(f"lut_matmul: x has shape {tuple(x.shape)}, expected (..., {K})")
    if _C is None:
        _warn_missing()
        return lut_matmul_reference(x, qweight, scales, mins, g)
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], N))
    _C.lut_matmul(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), y.data_ptr(),
        x.numel() // K, N, K, bits, g,
        ops._default_isa() if isa is None else ops._isa_id(isa),
        threads or ops.get_num_threads(),
    )  # fmt: skip
    return y
