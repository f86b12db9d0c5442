"""C kernels (kernels_cpu) against their torch reference, on every path this CPU runs.

Shapes are awkward on purpose: M = 1 (the GEMV), 3 (a GEMV per row), 7 (a GEMV per row
when K >= 768, else the GEMM), 12 (the float GEMM) and 33 (the integer GEMM where the path
has one, else the float GEMM; partial tiles and blocks), N odd, K = 32 x odd
(not a multiple of 256), per-channel int8 with K odd. Results must match the reference
up to float summation order and what x's digits lose (15 significant bits per block of
32 in the integer GEMM, the int4 GEMV and plain AVX2's int6 GEMV, per block of 256 in
AVX-512 VNNI's int6 GEMV; 22 in the int8 GEMV and AVX-VNNI's int6), and be
bit-identical for 1 and 2 threads. Then the quantized layers' forwards, and greedy
decoding of the default model with kernels against the reference path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from gguf import GGMLQuantizationType as T
from tiny import random_blocks

from infer.kernels_cpu import ops, reference

# Without the extension the C tests skip, and test_extension_is_built fails.
needs_c = pytest.mark.skipif(not ops.available(), reason="C extension not built")
ISAS = ops.supported_isas() or ["none"]

# (bits, group size, symmetric)
INT8 = [(8, 0, True), (8, 32, True), (8, 64, True), (8, 128, True)]
INT4 = [(4, g, s) for g in (32, 64, 128) for s in (True, False)]
INT6 = [(6, 256, True)]  # GGUF Q6_K's blocks of 256
KINDS = INT8 + INT4 + INT6
# which rows of x run a GEMV each, and from how many the GEMM is the integer one, if any
SMALL_M, WIDE_M, WIDE_K, IGEMM_MIN_M = ops.matmul_paths()
IG_XMAX = ops.IG_XMAX  # the integer GEMM's digits of x, |X| <= IG_XMAX per block of 32
KIND_IDS = [f"int{b}-g{g}-{'sym' if s else 'asym'}" for b, g, s in KINDS]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The references are small torch matmuls; on a shared machine torch's own threads
    only slow them down (the kernels' threads are set per test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def packed(bits: int, g: int, sym: bool, N: int, K: int, seed: int = 0) -> dict:
    """Random packed weights: every code (int8 -128 included), scales of both signs."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 6:  # any bytes, float16 d sane
        return {"qweight": torch.from_numpy(random_blocks(T.Q6_K, N, K, seed))}
    if bits == 8:
        q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
        s = torch.randn(N, K // g if g else 1, generator=gen) * 0.02
        return {"qweight": q, "scales": s.half() if g else s, "mins": None}
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    s = (torch.randn(N, K // g, generator=gen) * 0.02).half()
    m = None if sym else (torch.randn(N, K // g, generator=gen) * 0.1).half()
    return {"qweight": q, "scales": s, "mins": m}


def run(bits, g, w, x, **kw):
    if bits == 6:
        return ops.q6_matmul(x, w["qweight"], **kw)
    if bits == 8:
        return ops.q8_matmul(x, w["qweight"], w["scales"], g, **kw)
    return ops.q4_matmul(x, w["qweight"], w["scales"], w["mins"], g, **kw)


def dequantized(bits, g, w):
    if bits == 6:
        return reference.dequantize_int6(w["qweight"])
    if bits == 8:
        return reference.dequantize_int8(w["qweight"], w["scales"], g)
    return reference.dequantize_int4(w["qweight"], w["scales"], w["mins"], g)


def runs_integer_gemm(M: int, isa: str, bits: int = 4) -> bool:
    """Whether matmul.c multiplies M rows of x by the integer GEMM (int8 and int6 only with
    vpdpbusd)."""
    return M >= IGEMM_MIN_M and ops.integer_gemm(isa, f"int{bits}")


def runs_gemv(M: int, K: int) -> bool:
    """Whether matmul.c multiplies M rows of x by a GEMV per row."""
    return M <= SMALL_M or (M <= WIDE_M and K >= WIDE_K)


def x_block(M: int, K: int, isa: str, bits: int) -> int:
    """The block of x per scale where the rows' x keeps 15 bits, else 0 (float32, or the
    int8 GEMV's 22 bits): 32 in the integer GEMM and in the int4 GEMV of the paths with
    integer dot products for it; int6's GEMV where it takes int16 x (32 on plain AVX2, 256
    on AVX-512 VNNI)."""
    if runs_integer_gemm(M, isa, bits):
        return 32
    if not runs_gemv(M, K):
        return 0
    if bits == 4:
        return 32 if ops.int4_gemv_fifteen_bits(isa) else 0
    return ops.int6_gemv_x_block(isa) if bits == 6 else 0


def takes_fifteen_bits(M: int, K: int, isa: str, bits: int) -> bool:
    return x_block(M, K, isa, bits) > 0


def digit_error(x, bits, g, w):
    """The most x's digits can lose in a GEMV of three digits (int8, int6): 22
    significant bits per block of 32 (kernels.h), so 2^-21 of the block's amax times sum
    |w| over it."""
    wf = dequantized(bits, g, w)
    amax = x.abs().unflatten(-1, (-1, 32)).amax(-1)  # (M, K/32)
    return 2.0**-21 * amax @ wf.abs().unflatten(-1, (-1, 32)).sum(-1).T


def expected(bits, g, w, x, isa=None):
    """The reference result, and a bound on its error: summation order (1e-5 of
    sum |x| |w|) and, where `isa` takes x as two digits, what they lose."""
    wf = dequantized(bits, g, w)
    tol = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
    if isa and takes_fifteen_bits(*x.shape, isa, bits):
        tol = tol + ops.integer_gemm_error(x, wf, x_block(*x.shape, isa, bits))
    return x @ wf.T, tol


def assert_matches(y, x, bits, g, w, isa=None):
    ref, tol = expected(bits, g, w, x, isa)
    assert y.shape == ref.shape and y.dtype == torch.float32
    bad = (y - ref).abs() > tol
    assert not bad.any(), (
        f"{bad.sum()} of {bad.numel()} outside tolerance; max {(y - ref).abs().max()}"
    )


# ---------------------------------------------------------------------------------------
# The build and its paths
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="the kernels build with gcc or clang")
def test_extension_is_built():
    assert ops.available(), "kernels_cpu._C is missing: reinstall with `pip install -e .`"
    assert "scalar" in ops.supported_isas()
    assert ops.isa() in ops.supported_isas()


@needs_c
@pytest.mark.slow  # a child process per case
def test_env_var_forces_a_path():
    # read once, at the first kernel call: so in a process of its own
    code = "from infer.kernels_cpu import ops; print(ops.isa())"
    for value, want in (("scalar", "scalar\n"), ("no-such-path", None)):
        env = {**os.environ, ops.ENV_ISA: value}
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        if want is None:
            assert r.returncode != 0 and "cannot run here" in r.stderr
        else:
            assert r.returncode == 0 and r.stdout == want, r.stderr


@needs_c
def test_unsupported_path_is_refused():
    missing = [i for i in ops.ISAS if i not in ops.supported_isas()]
    w = packed(8, 32, True, 4, 32)
    for isa in missing:
        with pytest.raises(ValueError, match="cannot run here"):
            run(8, 32, w, torch.randn(1, 32), isa=isa)


# ---------------------------------------------------------------------------------------
# C against the reference
# ---------------------------------------------------------------------------------------


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("M", [1, 3, 7, 12, 33])
def test_matches_reference(isa, kind, M):
    bits, g, sym = kind
    # K mod 128 = 96, 0, 32, 64: every tail of the 64- and 128-element chunks; int6 takes
    # whole blocks of 256
    for N, K in [(37, 32 * 7), (5, 128 * 3), (3, 32 * 5), (66, 32 * 38), (1, 64 * 3),
                 (7, 256 * 3), (2, 256)]:  # fmt: skip
        if g and K % g:
            continue
        w = packed(bits, g, sym, N, K, seed=N + K)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        assert_matches(run(bits, g, w, x, isa=isa, threads=2), x, bits, g, w, isa)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_long_rows(isa, kind):
    """Rows past 4096 weights, whose x digits the GEMV takes in slices of K (kernels.h):
    two whole slices and a short one, and for g = 32 a part chunk at the end; a few rows
    per task on 1 and 3 threads give the same bits."""
    bits, g, sym = kind
    K = 8448 + (32 if g == 32 else 0) - (1 if g == 0 else 0)
    w = packed(bits, g, sym, 11, K, seed=5)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    for M in (1, 3):
        y = run(bits, g, w, x[:M], isa=isa, threads=1)
        assert_matches(y, x[:M], bits, g, w, isa)
        assert torch.equal(run(bits, g, w, x[:M], isa=isa, threads=3), y)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K", [1, 5, 17, 33, 100])
@pytest.mark.parametrize("M", [1, 3, 6, 20])
def test_int8_per_channel_any_row_length(isa, K, M):
    w = packed(8, 0, True, 9, K, seed=K)
    x = torch.randn(M, K)
    assert_matches(run(8, 0, w, x, isa=isa), x, 8, 0, w, isa)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [2, SMALL_M + 1, IGEMM_MIN_M])
def test_special_values(isa, M):
    """Scales that are float16 subnormals, zero, negative; x with zeros and huge values.
    A few rows run one GEMV each, whose digits keep 22 bits of a block with 1e30 in it
    (int8; int4's 15); more run the GEMM, float32 or (16 rows or more, on paths that have
    it) integer, whose digits keep 15."""
    N, K = 6, 64
    w = packed(4, 32, False, N, K)
    w["scales"][0] = torch.tensor([6e-8, -6e-8]).half()  # subnormal
    w["scales"][1] = 0
    w["mins"][2] = torch.tensor([-65504.0, 1e-7]).half()
    x = torch.randn(M, K)
    x[0, :32] = 0  # a block of zeros
    x[1, 3] = 1e30
    w8 = packed(8, 32, True, N, K)
    w8["scales"][0] = torch.tensor([6e-8, -1e-7]).half()
    for bits, g, wt in ((4, 32, w), (8, 32, w8)):
        y = run(bits, g, wt, x, isa=isa)
        ref, tol = expected(bits, g, wt, x, isa)
        if M <= SMALL_M and not takes_fifteen_bits(M, K, isa, bits):
            tol = tol + digit_error(x, bits, g, wt)
        assert not ((y - ref).abs() > tol).any(), (bits, (y - ref).abs().max())


# prompts (the GEMM) of every kind, and decode (the GEMV) of int4 and int6: int8 decode
# (and int6's on AVX-VNNI) takes x as three digits (22 bits), which are neither x nor
# its 15 bits exactly
FIFTEEN_BITS_CASES = [(IGEMM_MIN_M + 1, k) for k in KINDS] + [(1, k) for k in INT4 + INT6]


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("M", "kind"),
    FIFTEEN_BITS_CASES,
    ids=[f"{M}-{KIND_IDS[KINDS.index(k)]}" for M, k in FIFTEEN_BITS_CASES],
)
def test_which_paths_keep_fifteen_bits_of_x(isa, M, kind):
    """x in the integer GEMM (prompts), and in the int4 GEMV (decode) of paths with two
    digits: each element becomes round(x / sx) with sx = amax / IG_XMAX per block of 32
    (int6's GEMV on AVX-512 VNNI: 256), so values under half a step vanish and the rest keep 15 bits; other paths keep
    float32. A block holding 1.0 and values of +-1.0e-5 to 1.4e-5 (under half a step,
    1.54e-5) shows which one ran."""
    bits, g, sym = kind
    K = max(128, g)
    w = packed(bits, g, sym, 7, K)
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(M, K)
    x[:, 32:64] = (1 + 0.4 * torch.rand(M, 32, generator=gen)) * 1e-5
    x[:, 32:64] *= torch.randint(0, 2, (M, 32), generator=gen) * 2 - 1
    x[torch.arange(M), 32 + torch.randint(0, 32, (M,), generator=gen)] = 1.0
    y = run(bits, g, w, x, isa=isa)
    xb = x.unflatten(-1, (-1, x_block(M, K, isa, bits) or 32))
    step = xb.amax(-1, keepdim=True) / IG_XMAX
    digits = torch.where(step > 0, (xb / step).round() * step, 0).flatten(-2)
    assert (digits[:, 32:64] == 0).sum() == M * 31  # the small ones are under half a step
    wf = dequantized(bits, g, w)
    integer = takes_fifteen_bits(M, K, isa, bits)
    xs = digits if integer else x  # what the path multiplies
    ref, tol = xs @ wf.T, 1e-5 * (xs.abs() @ wf.abs().T)
    if bits == 6 and not integer:  # int6 GEMV without 15 bits: three digits (22) or float
        tol = tol + digit_error(x, bits, g, w)
    assert ((y - ref).abs() <= tol).all()
    other = x @ wf.T if integer else digits @ wf.T
    assert ((y - other).abs() > tol).any()  # and not the other one


@needs_c
def test_integer_gemm_paths_and_formats():
    """vpdpbusd paths take int4, int5, int6 and q2_k (a scale per 16), int8, q5_k, q4_k,
    and q3_k and iq4_xs as int8's codes; plain AVX2 (vpmaddubsw's int16 pairs) int4, int5,
    int6, q2_k, q5_k and q4_k, not int8, q3_k or iq4_xs (their codes overflow a pair)."""
    vnni = {"int4", "int5", "int6", "int8", "q5_k", "q4_k", "q3_k", "q2_k", "iq4_xs"}
    formats = {
        "avx512vnni": vnni,
        "avx2vnni": vnni,
        "avx2": {"int4", "int5", "int6", "q5_k", "q4_k", "q2_k"},
    }
    for isa in ops.supported_isas():
        want = formats.get(isa, set())
        assert ops.integer_gemm(isa) == bool(want), isa
        for fmt in ("int4", "int5", "int6", "int8", "q5_k", "q4_k", "q3_k", "q2_k", "iq4_xs"):
            assert ops.integer_gemm(isa, fmt) == (fmt in want), (isa, fmt)


@needs_c
def test_decode_takes_fifteen_bits_where_integer_dots_are():
    on_digits = ("avx2", "avx2vnni", "avx512", "avx512vnni", "neondot")
    for isa in ops.supported_isas():
        assert ops.int4_gemv_fifteen_bits(isa) == (isa in on_digits), isa
        blocks = {"avx2": 32, "avx512vnni": 256, "neondot": 32}
        assert ops.int6_gemv_x_block(isa) == blocks.get(isa, 0), isa


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("M", [1, 9, 17])
def test_extreme_activations(isa, kind, M):
    """Decode (M = 1) and the GEMMs (M = 9 float, 17 integer where the path has it),
    where x becomes integer digits per block of 32 on VNNI paths: a block of zeros,
    blocks of tiny and of subnormal values, one huge value; then inf, which takes the
    float GEMV or GEMM (the outputs' finiteness as the reference's)."""
    bits, g, sym = kind
    K = 256
    w = packed(bits, g, sym, 9, K)
    x = torch.randn(M, K)
    x[:, :32] = 0
    x[:, 32:64] *= 1e-30
    x[:, 64:96] *= 1e-39
    x[0, 100] = 3e30
    assert_matches(run(bits, g, w, x, isa=isa), x, bits, g, w, isa)
    x[-1, 200] = float("inf")
    ref, _ = expected(bits, g, w, x)
    assert torch.equal(run(bits, g, w, x, isa=isa).isfinite(), ref.isfinite())


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [1, 4])
def test_int6_largest_integer_sums(isa, M):
    """int6 blocks whose products all take one sign and the largest size: codes 0 or 63
    (q - 32 = -32 or 31), every scale -128 or 127, x of one value, so that a GEMV summing
    a whole block in integers meets its largest sums (AVX-512 VNNI: 16 products of
    32 * 128 * IG_XMAX a lane). An overflow would flip a sign."""
    blocks = torch.from_numpy(random_blocks(T.Q6_K, 4, 512, 3)).view(4, 2, 210).clone()
    blocks[0, :, :192] = 0  # q = 0
    blocks[0, :, 192:208] = 128  # sc = -128
    blocks[1, :, :192] = 255  # q = 63
    blocks[1, :, 192:208] = 127
    blocks[2:, :, 192:208] = torch.tensor([128, 127], dtype=torch.uint8).repeat(8)
    w = {"qweight": blocks.view(4, -1)}
    x = torch.full((M, 512), 0.75)
    x[-1] = -x[-1]
    assert_matches(run(6, 256, w, x, isa=isa), x, 6, 256, w, isa)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("M", [1, 3, 5, 40])
def test_threads_give_identical_bits(isa, kind, M):
    bits, g, sym = kind
    N, K = 333, 128 * 5 if bits != 6 else 256 * 3  # several tasks a thread, partial tiles
    w = packed(bits, g, sym, N, K, seed=3)
    x = torch.randn(M, K)
    y1 = run(bits, g, w, x, isa=isa, threads=1)
    for threads in (2, 3):
        assert torch.equal(run(bits, g, w, x, isa=isa, threads=threads), y1)


# K >= 768: up to 8 rows take the GEMV; 1,024 + g ends in part of a chunk of 128 (groups
# of 32 and 64 only: 128 and int6's blocks of 256 make whole chunks)
ROWS_CASES = [
    (kind, K)
    for kind in KINDS
    for K in (1024, 4608, *((1024 + kind[1],) if kind[1] in (32, 64) else ()))
]


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("kind", "K"), ROWS_CASES, ids=[f"{KIND_IDS[KINDS.index(k)]}-K{K}" for k, K in ROWS_CASES]
)
def test_rows_together_equal_each_alone(isa, kind, K):
    """A GEMV of a few rows (sequences decoded together, guesses checked) unpacks each
    weight row once for all of them; each row's output is still its one-row output, bit
    for bit, for every count of rows that takes the GEMV, and beside a row holding inf.
    4,608 elements run in two slices where a GEMV takes x a slice at a time."""
    bits, g, sym = kind
    N = 67
    w = packed(bits, g, sym, N, K, seed=4)
    x = torch.randn(WIDE_M, K, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([run(bits, g, w, x[i : i + 1], isa=isa, threads=2) for i in range(WIDE_M)])
    for M in range(2, WIDE_M + 1):
        assert torch.equal(run(bits, g, w, x[:M], isa=isa, threads=2), alone[:M]), M
    x[2, 100] = float("inf")
    y = run(bits, g, w, x, isa=isa, threads=2)
    assert torch.equal(torch.cat([y[:2], y[3:]]), torch.cat([alone[:2], alone[3:]]))


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", INT8, ids=KIND_IDS[: len(INT8)])
def test_int8_rows_together_on_odd_lengths(isa, kind):
    """As above for int8 on rows whose groups do not fill a round of accumulators and, per
    channel, whose length is not a multiple of 8 (a masked tail); an odd count of rows
    leaves one row without a partner."""
    bits, g, sym = kind
    for K in (800, 1000 + 5) if g == 0 else (32 * 25, 128 * 7):
        if g and K % g:
            continue
        w = packed(bits, g, sym, 19, K, seed=K)
        x = torch.randn(5, K, generator=torch.Generator().manual_seed(K))
        alone = torch.cat([run(bits, g, w, x[i : i + 1], isa=isa, threads=2) for i in range(5)])
        for M in (2, 3, 5):
            assert torch.equal(run(bits, g, w, x[:M], isa=isa, threads=2), alone[:M]), (K, M)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", INT4, ids=KIND_IDS[len(INT8) : len(INT8) + len(INT4)])
def test_rows_together_on_partial_chunks(isa, kind):
    """As above for int4 on rows whose chunks of 64 do not fill rounds of 4 (chunks left
    over, a chunk's second block missing, fewer chunks than a round, half a chunk)."""
    bits, g, sym = kind
    for K in {32: (1120, 32 * 7, 96, 32), 64: (64 * 17, 64 * 3), 128: (128 * 9, 128)}[g]:
        w = packed(bits, g, sym, 19, K, seed=K)
        x = torch.randn(WIDE_M, K, generator=torch.Generator().manual_seed(K))
        alone = torch.cat(
            [run(bits, g, w, x[i : i + 1], isa=isa, threads=2) for i in range(WIDE_M)]
        )
        for M in range(2, (WIDE_M if K >= WIDE_K else SMALL_M) + 1):
            assert torch.equal(run(bits, g, w, x[:M], isa=isa, threads=2), alone[:M]), (K, M)


@needs_c
def test_leading_dims_empty_rows_and_non_contiguous_x():
    w = packed(4, 32, False, 10, 64)
    x = torch.randn(2, 3, 64)
    y = run(4, 32, w, x)
    assert y.shape == (2, 3, 10)
    assert_matches(y.view(6, 10), x.view(6, 64), 4, 32, w, ops.isa())
    assert run(4, 32, w, torch.randn(0, 64)).shape == (0, 10)
    xt = torch.randn(64, 3).T  # (3, 64), not contiguous
    assert_matches(run(4, 32, w, xt), xt.contiguous(), 4, 32, w, ops.isa())


@needs_c
def test_binding_checks_shapes_and_dtypes():
    w = packed(4, 32, False, 10, 64)
    with pytest.raises(TypeError, match="float32"):
        run(4, 32, w, torch.randn(1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 64\)"):
        run(4, 32, w, torch.randn(1, 32))
    with pytest.raises(ValueError, match="group size"):
        run(4, 48, w, torch.randn(1, 64))
    with pytest.raises(ValueError, match="scales"):
        ops.q4_matmul(torch.randn(1, 64), w["qweight"], w["scales"].float(), w["mins"], 32)
    with pytest.raises(ValueError, match="mins"):
        ops.q4_matmul(torch.randn(1, 64), w["qweight"], w["scales"], w["mins"][:, :1], 32)
    w8 = packed(8, 0, True, 10, 64)
    with pytest.raises(ValueError, match="scales"):
        ops.q8_matmul(torch.randn(1, 64), w8["qweight"], w8["scales"].half(), 0)
    with pytest.raises(ValueError, match="qweight"):
        ops.q8_matmul(torch.randn(1, 64), w8["qweight"].float(), w8["scales"], 0)


def test_missing_extension_warns_once_and_runs_the_reference(monkeypatch):
    monkeypatch.setattr(ops, "_C", None)
    monkeypatch.setattr(ops, "_IMPORT_ERROR", ImportError("simulated"), raising=False)
    ops._warn_missing.cache_clear()
    w4, w8 = packed(4, 64, True, 7, 128), packed(8, 32, True, 7, 128)
    x = torch.randn(3, 128)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y4 = run(4, 64, w4, x)
            y8 = run(8, 32, w8, x)
            run(4, 64, w4, x)
    finally:
        ops._warn_missing.cache_clear()
    assert len(caught) == 1 and "not built" in str(caught[0].message)
    assert torch.equal(y4, reference.q4_matmul(x, w4["qweight"], w4["scales"], None, 64))
    assert torch.equal(y8, reference.q8_matmul(x, w8["qweight"], w8["scales"], 32))


# ---------------------------------------------------------------------------------------
# The quantized layers route float32 through the kernels
# ---------------------------------------------------------------------------------------


@needs_c
@pytest.mark.parametrize(
    "fmt, params",
    [
        ("int8", {"group_size": 0}),
        ("int8", {"group_size": 32}),
        ("int4", {"group_size": 64}),
        ("int6", {}),
    ],
)
def test_quant_linear_forward(fmt, params):
    from infer.quant.formats.base import FORMATS, QuantLinear

    K = 256 if fmt == "int6" else 128  # int6: whole blocks of 256
    torch.manual_seed(0)
    weight, bias = torch.randn(24, K), torch.randn(24)
    q = FORMATS[fmt].from_float(weight, bias, search=False, **params)
    x = torch.randn(2, 5, K)
    ref = QuantLinear.forward(q, x)
    torch.testing.assert_close(q(x), ref, rtol=1e-4, atol=1e-4)
    xb = x.bfloat16()  # other dtypes keep their torch paths
    # bfloat16's rounding of x and of the products grows with sqrt(K)
    torch.testing.assert_close(q(xb).float(), ref, rtol=0.05, atol=0.1 * (K / 128) ** 0.5)


# ---------------------------------------------------------------------------------------
# The default model: greedy tokens with the kernels equal the reference path's
# ---------------------------------------------------------------------------------------

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def smollm2_float(smollm2_gguf, one_torch_thread):
    from infer.runtime.loader import load_model

    return load_model(smollm2_gguf, torch.float32, max_seq_len=64)


@pytest.mark.slow
@needs_c
@pytest.mark.parametrize("to", ["int4", "int8"])
def test_default_model_greedy_tokens_equal_reference(smollm2_float, smollm2_gguf, to, monkeypatch):
    import copy

    from infer.quant.formats.int8 import Int8Linear
    from infer.quant.formats.recipes import get_recipe
    from infer.quant.quantize import dequantize_model, quantize_model
    from infer.runtime.files.gguf import GGUFFile
    from infer.runtime.generate import generate, make_sampler
    from infer.runtime.session import Session

    model = copy.deepcopy(smollm2_float.model)
    # As `infer quantize --to int4 / int8`: Q4_1 and Q8_0 blocks import losslessly;
    # int8 requantizes the Q4_1 layers, here without the clipping search (speed).
    fit = Int8Linear.from_float.__func__
    monkeypatch.setattr(
        Int8Linear,
        "from_float",
        classmethod(lambda c, w, b=None, **p: fit(c, w, b, **p, search=False)),
    )
    quantize_model(model, get_recipe(to), gguf=GGUFFile(smollm2_gguf))
    prompt = smollm2_float.tokenizer.encode_chat(QUESTION)

    def greedy(n=10, threads=None):
        session = Session(model, threads=threads)
        return list(generate(session, prompt, make_sampler(temperature=0), max_tokens=n))

    one = greedy(threads=1)
    two = greedy(threads=2)
    # The reference path: each QuantLinear's forward is F.linear on its dequantized
    # weight, which is what a float model holding those weights computes.
    dequantize_model(model)
    assert one == two == greedy()
