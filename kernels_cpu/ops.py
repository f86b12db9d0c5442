"""The binding: check shapes and dtypes, choose the instruction-set path and the thread
count, call the C kernels (csrc/, built as `_C`). Without the extension the torch
reference (reference.py) runs, and one warning says so.

Paths (csrc/kernels.h): "avx512vnni", "avx512", "avx2vnni", "avx2" (x86-64), "neondot",
"neon" (AArch64) and the portable "scalar"; the best this CPU runs is chosen at run time,
INFER_KERNEL_ISA=<path> forces one for the whole process, and every op takes isa= for
one call (tests). Threads: every op takes threads= for one call; by default the count
of the pass in progress (threads.py ThreadPolicy), else torch.get_num_threads().

    y = q4_matmul(x, qweight, scales, mins, group_size)     # x (..., K) float32
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from . import reference
from .threads import kernel_threads

try:
    from . import _C
except ImportError as e:  # not built: reference path, one warning at first use
    _C = None
    _IMPORT_ERROR = e

# The C's path ids, in order.
ISAS = (
    _C.isa_names()
    if _C
    else ("scalar", "avx2", "avx2vnni", "avx512", "avx512vnni", "neon", "neondot")
)
ENV_ISA = "INFER_KERNEL_ISA"


def available() -> bool:
    """Whether the C extension is built and loaded."""
    return _C is not None


def supported_isas() -> list[str]:
    """The paths this CPU can run, fastest first (empty without the extension)."""
    if _C is None:
        return []
    return [name for i, name in sorted(enumerate(ISAS), reverse=True) if _C.isa_supported(i)]


@functools.cache
def _default_isa() -> int:
    name = os.environ.get(ENV_ISA, "").strip().lower()
    return _C.isa_best() if not name else _isa_id(name)


def _isa_id(name: str) -> int:
    if name not in ISAS or not _C.isa_supported(ISAS.index(name)):
        raise ValueError(
            f"kernel path {name!r} cannot run here; this CPU runs: {', '.join(supported_isas())}"
        )
    return ISAS.index(name)


def isa() -> str | None:
    """The path the kernels take by default (None without the extension)."""
    return None if _C is None else ISAS[_default_isa()]


# csrc/kernels.h: the integer GEMM's x per block of 32, |round(x / sx)| <= IG_XMAX
IG_XMAX = 32512


def integer_gemm_error(x: torch.Tensor, w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """A bound on what the integer GEMM's digits of x move y = x w^T, per element of y
    (M, N) for x (M, K) and dequantized w (N, K): half a step (amax / IG_XMAX per block of
    32 of x) per element, plus float32's rounding of the step, times sum |w| over the
    block. Callers add it where integer_gemm() holds and the rows run the GEMM, and where
    int4 rows run the GEMV and int4_gemv_fifteen_bits() holds; q4_k's GEMV takes a step
    per block of 256 (q4k_gemv_fifteen_bits), int6's per int6_gemv_x_block()."""
    pad = -x.shape[-1] % block
    xb = torch.nn.functional.pad(x.abs(), (0, pad)).unflatten(-1, (-1, block)).amax(-1)
    wb = torch.nn.functional.pad(w.abs(), (0, pad)).unflatten(-1, (-1, block)).sum(-1)
    return (0.5 / IG_XMAX + 2.0**-21) * xb @ wb.T


# the formats the integer GEMM may take, by their kernels' `bits` (csrc/kernels.h IG_KIND)
_IG_KINDS = {
    "int4": 4, "int5": 5, "int6": 6, "int8": 8, "q5_k": 13, "q4_k": 12, "q3_k": 11, "q2_k": 10,
    "iq4_xs": 23,
}  # fmt: skip


def integer_gemm(isa: str | None = None, fmt: str | None = None) -> bool:
    """Whether a path (default: the default one) multiplies several rows of x (a prompt)
    by integer dot products, with x as two int8 digits: 15 significant bits per block of
    32 (csrc/kernels.h, "The integer GEMM"), for weights in `fmt` ("int4", "int5", "int6",
    "int8", "q5_k", "q4_k", "q3_k", "q2_k", "iq4_xs"; default: any of them). Other paths and
    formats dequantize W to float32."""
    if _C is None:
        return False
    kinds = _C.isa_integer_gemm(_default_isa() if isa is None else _isa_id(isa))
    return bool(kinds) if fmt is None else bool(kinds >> _IG_KINDS[fmt] & 1)


def matmul_paths() -> tuple[int, int, int, int]:
    """(SMALL_M, WIDE_M, WIDE_K, IGEMM_MIN_M), csrc/kernels.h: at most SMALL_M rows of x,
    or WIDE_M rows of at least WIDE_K, run the GEMVs a row each; from IGEMM_MIN_M rows the
    integer GEMM runs where the path has one; else the float GEMM. Zeros without C."""
    return _C.matmul_paths() if _C is not None else (0, 0, 0, 0)


def int4_gemv_fifteen_bits(isa: str | None = None) -> bool:
    """Whether a path (default: the default one) multiplies decode's x by int4 weights
    as the integer GEMM's two int8 digits: 15 significant bits per block of 32, x exactly
    as prompts take it, so integer_gemm_error bounds it too. The paths with integer dot
    products for it do (x86, neondot); scalar and plain NEON multiply in float32."""
    if _C is None:
        return False
    return _C.isa_int4_digits(_default_isa() if isa is None else _isa_id(isa))


def int5_gemv_fifteen_bits(isa: str | None = None) -> bool:
    """As int4_gemv_fifteen_bits, for int5 weights: the x86 and NEON paths (plain NEON
    with its sdot emulated); scalar multiplies in float32."""
    if _C is None:
        return False
    return _C.isa_int5_digits(_default_isa() if isa is None else _isa_id(isa))


def int6_gemv_x_block(isa: str | None = None) -> int:
    """The block of x per scale where a path's int6 GEMV takes x as int16, 15 significant
    bits per block: 32 on plain AVX2 and NEON (two int8 digits), 256 on AVX-512 VNNI;
    0 where it takes the int8 GEMV's three digits (22 bits, AVX-VNNI) or float32."""
    if _C is None:
        return 0
    return _C.isa_int6_x16(_default_isa() if isa is None else _isa_id(isa))


def q4k_gemv_fifteen_bits(isa: str | None = None) -> bool:
    """Whether a path's q4_k GEMV takes x as two int8 digits, 15 significant bits per
    block of 256 (csrc/q4k_q5k.c): the x86 paths, and NEON (per block of 32, within
    that bound; plain NEON with its sdot emulated); scalar multiplies in float32."""
    if _C is None:
        return False
    return _C.isa_q4k_digits(_default_isa() if isa is None else _isa_id(isa))


def get_num_threads() -> int:
    """The kernels' thread count now (threads.ThreadPolicy sets it for a pass)."""
    return kernel_threads()


@functools.cache
def _warn_missing() -> None:
    warnings.warn(
        f"infer.kernels_cpu: the C extension is not built ({_IMPORT_ERROR}); quantized "
        "matmuls run the slower torch reference. Reinstall infer (pip install -e .) "
        "with a C compiler to build it.",
        RuntimeWarning,
        stacklevel=3,
    )


# ---------------------------------------------------------------------------------------
# Ops. Decode calls them once per linear layer per token, so the checks are one
# expression each and the messages are built only on failure.
# ---------------------------------------------------------------------------------------


def _fail(name: str, what: str, t, want: str) -> None:
    got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
    if t is not None and not t.is_contiguous():
        got += ", not contiguous"
    raise ValueError(f"{name}: {what} must be a contiguous CPU tensor, {want}; got {got}")


def _x_ok(x, K: int) -> bool:
    return x.dtype is torch.float32 and x.is_cpu and x.dim() > 0 and x.shape[-1] == K


def _x_fail(name: str, x, K: int) -> None:
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise TypeError(f"{name}: x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    raise ValueError(f"{name}: x has shape {tuple(x.shape)}, expected (..., {K})")


def _launch(fn, x, K: int, N: int, weights: tuple, g: int, isa, threads):
    """y (..., N) from the C op `fn` on x (..., K) and the weights' data pointers."""
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], N))
    fn(
        x.data_ptr(), *weights, y.data_ptr(), x.numel() // K, N, K, g,
        _default_isa() if isa is None else _isa_id(isa),
        threads or kernel_threads(),
    )  # fmt: skip
    return y


def q8_matmul(x, qweight, scales, group_size: int, *, isa: str | None = None, threads=None):
    """y (..., N) = x (..., K) W^T for int8 W (quant/formats/int8.py): qweight int8 (N, K); scales
    float16 (N, K/g) for group_size g in 32/64/128, float32 (N, 1) for 0 (per channel).
    x float32. isa: a path by name (default: the best, or INFER_KERNEL_ISA); threads:
    default get_num_threads()."""
    g = group_size
    if not (qweight.dtype is torch.int8 and qweight.dim() == 2 and qweight.is_cpu
            and qweight.is_contiguous()):  # fmt: skip
        _fail("q8_matmul", "qweight", qweight, "int8 (N, K)")
    N, K = qweight.shape
    if g not in (0, 32, 64, 128) or (g and K % g):
        raise ValueError(f"q8_matmul: group size {g} does not fit K = {K} (0, 32, 64, 128)")
    sdtype, sshape = (torch.float16, (N, K // g)) if g else (torch.float32, (N, 1))
    if not (scales.dtype is sdtype and scales.shape == sshape and scales.is_cpu
            and scales.is_contiguous()):  # fmt: skip
        _fail("q8_matmul", "scales", scales, f"{sdtype} {sshape}")
    if not _x_ok(x, K):
        _x_fail("q8_matmul", x, K)
    if _C is None:
        _warn_missing()
        return reference.q8_matmul(x, qweight, scales, g)
    return _launch(_C.q8_matmul, x, K, N, (qweight.data_ptr(), scales.data_ptr()), g, isa, threads)


def q4_matmul(x, qweight, scales, mins, group_size: int, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for int4 W (quant/formats/int4.py): qweight uint8 (N, K/2);
    scales and mins float16 (N, K/g), g in 32/64/128; mins None when symmetric.
    x float32. isa, threads: as q8_matmul."""
    g = group_size
    if not (qweight.dtype is torch.uint8 and qweight.dim() == 2 and qweight.is_cpu
            and qweight.is_contiguous()):  # fmt: skip
        _fail("q4_matmul", "qweight", qweight, "uint8 (N, K/2)")
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    if g not in (32, 64, 128) or K % g:
        raise ValueError(f"q4_matmul: group size {g} does not fit K = {K} (32, 64, 128)")
    shape = (N, K // g)
    if not (scales.dtype is torch.float16 and scales.shape == shape and scales.is_cpu
            and scales.is_contiguous()):  # fmt: skip
        _fail("q4_matmul", "scales", scales, f"float16 {shape}")
    if mins is not None and not (mins.dtype is torch.float16 and mins.shape == shape
                                 and mins.is_cpu and mins.is_contiguous()):  # fmt: skip
        _fail("q4_matmul", "mins", mins, f"float16 {shape}")
    if not _x_ok(x, K):
        _x_fail("q4_matmul", x, K)
    if _C is None:
        _warn_missing()
        return reference.q4_matmul(x, qweight, scales, mins, g)
    ptrs = (qweight.data_ptr(), scales.data_ptr(), 0 if mins is None else mins.data_ptr())
    return _launch(_C.q4_matmul, x, K, N, ptrs, g, isa, threads)


def q5_matmul(x, qweight, qh, scales, mins, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for int5 W (quant/formats/int5.py): qweight uint8 (N, K/2),
    qh uint8 (N, K/8), scales and mins float16 (N, K/32); mins None when symmetric.
    x float32. isa, threads: as q8_matmul."""
    if not (qweight.dtype is torch.uint8 and qweight.dim() == 2 and qweight.is_cpu
            and qweight.is_contiguous() and qweight.shape[1] % 16 == 0):  # fmt: skip
        _fail("q5_matmul", "qweight", qweight, "uint8 (N, K/2), K a multiple of 32")
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    if not (qh.dtype is torch.uint8 and qh.shape == (N, K // 8) and qh.is_cpu
            and qh.is_contiguous()):  # fmt: skip
        _fail("q5_matmul", "qh", qh, f"uint8 {(N, K // 8)}")
    shape = (N, K // 32)
    for name, t in (("scales", scales), ("mins", mins)):
        if (t is not None or name == "scales") and not (
            t is not None and t.dtype is torch.float16 and t.shape == shape and t.is_cpu
            and t.is_contiguous()
        ):  # fmt: skip
            _fail("q5_matmul", name, t, f"float16 {shape}")
    if not _x_ok(x, K):
        _x_fail("q5_matmul", x, K)
    if _C is None:
        _warn_missing()
        return reference.q5_matmul(x, qweight, qh, scales, mins)
    ptrs = (
        qweight.data_ptr(), qh.data_ptr(), scales.data_ptr(),
        0 if mins is None else mins.data_ptr(),
    )  # fmt: skip
    return _launch(_C.q5_matmul, x, K, N, ptrs, 32, isa, threads)


def q6_matmul(x, qweight, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for int6 W (quant/formats/int6.py): qweight uint8
    (N, K/256*210), GGUF Q6_K's blocks. x float32. isa, threads: as q8_matmul."""
    return _superblock_matmul("q6_matmul", 210, x, qweight, isa, threads)


def q4k_matmul(x, qweight, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for q4_k W (quant/formats/q4k.py): qweight uint8
    (N, K/256*144), GGUF Q4_K's blocks. x float32. isa, threads: as q8_matmul."""
    return _superblock_matmul("q4k_matmul", 144, x, qweight, isa, threads)


def q5k_matmul(x, qweight, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for q5_k W (quant/formats/q5k.py): qweight uint8
    (N, K/256*176), GGUF Q5_K's blocks. x float32. isa, threads: as q8_matmul."""
    return _superblock_matmul("q5k_matmul", 176, x, qweight, isa, threads)


def q3k_matmul(x, qweight, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for q3_k W (quant/formats/q3k.py): qweight uint8
    (N, K/256*110), GGUF Q3_K's blocks. x float32. isa, threads: as q8_matmul."""
    return _superblock_matmul("q3k_matmul", 110, x, qweight, isa, threads)


def iq4xs_matmul(x, qweight, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for iq4_xs W (quant/formats/iq4xs.py): qweight uint8
    (N, K/256*136), GGUF IQ4_XS's blocks. x float32. isa, threads: as q8_matmul."""
    return _superblock_matmul("iq4xs_matmul", 136, x, qweight, isa, threads)


def q2k_matmul(x, qweight, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for q2_k W (quant/formats/q2k.py): qweight uint8
    (N, K/256*84), GGUF Q2_K's blocks. x float32. isa, threads: as q8_matmul."""
    return _superblock_matmul("q2k_matmul", 84, x, qweight, isa, threads)


def _superblock_matmul(name: str, block_bytes: int, x, qweight, isa, threads):
    """The op `name` (in _C and reference) over W held as whole super-blocks of 256
    weights, `block_bytes` each: one uint8 tensor and nothing else."""
    if not (qweight.dtype is torch.uint8 and qweight.dim() == 2 and qweight.is_cpu
            and qweight.is_contiguous() and qweight.shape[1] % block_bytes == 0
            and qweight.shape[1]):  # fmt: skip
        _fail(name, "qweight", qweight, f"uint8 (N, K/256*{block_bytes})")
    N, K = qweight.shape[0], qweight.shape[1] // block_bytes * 256
    if not _x_ok(x, K):
        _x_fail(name, x, K)
    if _C is None:
        _warn_missing()
        return getattr(reference, name)(x, qweight)
    return _launch(getattr(_C, name), x, K, N, (qweight.data_ptr(),), 256, isa, threads)


# ---------------------------------------------------------------------------------------
# LUT ops (lut1..lut4, csrc/lut.c; reference.lut_matmul is their definition)
# ---------------------------------------------------------------------------------------


def lut_matmul(x, qweight, scales, mins, group_size: int, *, isa=None, threads=None):
    """y (..., N) = x (..., K) W^T for W in lut1..lut4 (quant/formats/lut.py): qweight uint8
    (b, N, K/8) bit planes, scales and mins float16 (N, K/g), g a multiple of 8; x float32.
    isa, threads: as q8_matmul. The activations go through int8 tables, so y is
    reference.lut_matmul's, within reference.lut_table_error_bound of the exact x W^T."""
    g = group_size
    if not (qweight.dtype is torch.uint8 and qweight.dim() == 3 and 1 <= qweight.shape[0] <= 4
            and qweight.is_cpu and qweight.is_contiguous()):  # fmt: skip
        _fail("lut_matmul", "qweight", qweight, "uint8 (bits, N, K/8), bits 1..4")
    bits, N, nb = qweight.shape
    K = 8 * nb
    if g <= 0 or g % 8 or K % g:
        raise ValueError(f"lut_matmul: group size {g} does not fit K = {K}")
    shape = (N, K // g)
    for name, t in (("scales", scales), ("mins", mins)):
        if not (t.dtype is torch.float16 and t.shape == shape and t.is_cpu
                and t.is_contiguous()):  # fmt: skip
            _fail("lut_matmul", name, t, f"float16 {shape}")
    if not _x_ok(x, K):
        _x_fail("lut_matmul", x, K)
    if _C is None:
        _warn_missing()
        return reference.lut_matmul(x, qweight, scales, mins, g)
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], N))
    _C.lut_matmul(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), y.data_ptr(),
        x.numel() // K, N, K, bits, g,
        _default_isa() if isa is None else _isa_id(isa),
        threads or kernel_threads(),
    )  # fmt: skip
    return y


def lut_tables(x: torch.Tensor, bits: int, group_size: int, *, isa: str | None = None):
    """The C's tables for x (M, K), as reference.lut_build_tables returns them (tests)."""
    M, K = x.shape
    x = x.float().contiguous()
    g = group_size
    raw = torch.empty(M, _C.lut_tables_bytes(K), dtype=torch.int8)
    c = torch.empty(3, M, K // g)
    _C.lut_tables(
        x.data_ptr(), raw.data_ptr(), c[0].data_ptr(), c[1].data_ptr(), c[2].data_ptr(),
        M, K, bits, g, _default_isa() if isa is None else _isa_id(isa),
    )  # fmt: skip
    # per 64 elements 256 bytes: the table of element group j at 16 * (j % 16 // 2), plus
    # 128 if j is odd
    j = torch.arange(K // 4)
    off = (j // 16) * 256 + (j % 2) * 128 + (j % 16 // 2) * 16
    return raw[:, off.unsqueeze(1) + torch.arange(16)], c[0], c[1], c[2]


def lut_kernel_isa(isa: str | None = None) -> str | None:
    """The path lut_matmul runs for `isa` (default: the process's): its AVX-512 path needs
    VNNI and VBMI (avx512vnni on Ice Lake, Zen 4 and later); avx2, avx2vnni and avx512
    run its AVX2 path, neon and neondot its NEON path. None without the extension."""
    if _C is None:
        return None
    return ISAS[_C.lut_isa(_default_isa() if isa is None else _isa_id(isa))]


# ---------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------


def read_bandwidth(nbytes: int = 1 << 30, *, isa=None, threads=None, repeats: int = 5) -> float:
    """The machine's read bandwidth in GB/s: best of `repeats` streaming sums over a
    buffer of `nbytes` (a multiple of 256), on the kernels' pool."""
    import time

    if _C is None:
        raise RuntimeError("read_bandwidth needs the C extension")
    buf = torch.ones(nbytes, dtype=torch.uint8)  # written once, so every page is mapped
    isa_id = _default_isa() if isa is None else _isa_id(isa)
    n = threads or get_num_threads()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _C.stream_read(buf.data_ptr(), nbytes, isa_id, n)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
