"""int5's C kernels against their torch reference (reference.q5_matmul), on every path
this CPU runs, with test_kernels_q.py's shapes and tolerances for int4: summation order,
plus what x's two digits lose where the path's GEMV takes them (15 significant bits per
block of 32). Then bit-identical results for 1, 2 and 3 threads, x with inf, and int5
beside int4 in one q_gemv_many job (the fused decode step's case)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels_cpu import ops, reference

needs_c = pytest.mark.skipif(not ops.available(), reason="C extension not built")
ISAS = ops.supported_isas() or ["none"]
# which rows of x run a GEMV each, and from how many the GEMM is the integer one, if any
SMALL_M, WIDE_M, WIDE_K, IGEMM_MIN_M = ops.matmul_paths()


def packed(sym: bool, N: int, K: int, seed: int = 0) -> dict:
    """Random int5 weights: every code, scales of both signs."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "qweight": torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen),
        "qh": torch.randint(0, 256, (N, K // 8), dtype=torch.uint8, generator=gen),
        "scales": (torch.randn(N, K // 32, generator=gen) * 0.02).half(),
        "mins": None if sym else (torch.randn(N, K // 32, generator=gen) * 0.1).half(),
    }


def run(w, x, **kw):
    return ops.q5_matmul(x, w["qweight"], w["qh"], w["scales"], w["mins"], **kw)


def dequantized(w):
    return reference.dequantize_int5(w["qweight"], w["qh"], w["scales"], w["mins"])


def takes_digits(M: int, K: int, isa: str) -> bool:
    """Whether the rows' x becomes two int8 digits: in the GEMV of paths with them, and in
    the integer GEMM (prompts) of paths that take int5 there."""
    runs_gemv = M <= SMALL_M or (M <= WIDE_M and K >= WIDE_K)
    if runs_gemv:
        return ops.int5_gemv_fifteen_bits(isa)
    return M >= IGEMM_MIN_M and ops.integer_gemm(isa, "int5")


def assert_matches(y, x, w, isa):
    wf = dequantized(w)
    ref = x @ wf.T
    tol = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
    if takes_digits(*x.shape, isa):
        tol = tol + ops.integer_gemm_error(x, wf)
    assert y.shape == ref.shape and y.dtype == torch.float32
    bad = (y - ref).abs() > tol
    assert not bad.any(), f"{bad.sum()} of {bad.numel()} outside; max {(y - ref).abs().max()}"


@needs_c
def test_digit_paths():
    for isa in ops.supported_isas():
        on_digits = isa in ("avx2", "avx2vnni", "avx512", "avx512vnni", "neondot")
        assert ops.int5_gemv_fifteen_bits(isa) == on_digits, isa


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("M", [1, 3, 7, 12, 33])
def test_matches_reference(isa, sym, M):
    # K mod 64 = 32 and 0: a chunk's second block missing or not
    for N, K in [(37, 32 * 7), (5, 128 * 3), (3, 32), (66, 32 * 38), (1, 64 * 3)]:
        w = packed(sym, N, K, seed=N + K)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        assert_matches(run(w, x, isa=isa, threads=2), x, w, isa)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_long_rows_and_threads(isa, sym):
    K = 8448 + 32
    w = packed(sym, 333, K, seed=5)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(5))
    for M in (1, 3, 5, 40):
        y = run(w, x[:M], isa=isa, threads=1)
        assert_matches(y, x[:M], w, isa)
        for threads in (2, 3):
            assert torch.equal(run(w, x[:M], isa=isa, threads=threads), y)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("M", [1, 9, 17])
def test_extreme_activations(isa, sym, M):
    """Zeros, tiny and subnormal blocks, a huge value; then inf takes the float GEMV (or
    GEMM: 17 rows run the integer one where the path has it)."""
    w = packed(sym, 9, 256)
    x = torch.randn(M, 256)
    x[:, :32] = 0
    x[:, 32:64] *= 1e-30
    x[:, 64:96] *= 1e-39
    x[0, 100] = 3e30
    assert_matches(run(w, x, isa=isa), x, w, isa)
    x[-1, 200] = float("inf")
    ref = x @ dequantized(w).T
    assert torch.equal(run(w, x, isa=isa).isfinite(), ref.isfinite())


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_rows_together_equal_each_alone(isa, sym):
    """A GEMV of a few rows unpacks each weight row once for all of them; each row's
    output is still its one-row output, bit for bit, for every count of rows that takes
    the GEMV, and beside a row holding inf. K: whole rounds of 4 chunks of 64, a chunk's
    second block missing, chunks left over, fewer chunks than a round, and half a chunk."""
    for K in (1024, 1120, 32 * 7, 96, 32):
        w = packed(sym, 37, K, seed=K)
        x = torch.randn(WIDE_M, K, generator=torch.Generator().manual_seed(K))
        alone = torch.cat([run(w, x[i : i + 1], isa=isa, threads=2) for i in range(WIDE_M)])
        rows = WIDE_M if K >= WIDE_K else SMALL_M
        for M in range(2, rows + 1):
            assert torch.equal(run(w, x[:M], isa=isa, threads=2), alone[:M]), (K, M)
        x[1, K // 2] = float("inf")
        y = run(w, x[:rows], isa=isa, threads=2)
        assert torch.equal(torch.cat([y[:1], y[2:]]), torch.cat([alone[:1], alone[2:rows]])), K


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_which_prompts_keep_fifteen_bits_of_x(isa, sym):
    """The integer GEMM multiplies x's digits, round(x / sx) sx with sx = amax / IG_XMAX
    per block of 32, and the float GEMM x itself: a block holding 1.0 and values under
    half a step (1.54e-5) shows which one ran."""
    M, K = IGEMM_MIN_M + 3, 96
    w = packed(sym, 7, K, seed=2)
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(M, K)
    x[:, 32:64] = (1 + 0.4 * torch.rand(M, 32, generator=gen)) * 1e-5
    x[:, 40] = 1.0
    xb = x.unflatten(-1, (-1, 32))
    step = xb.abs().amax(-1, keepdim=True) / ops.IG_XMAX
    digits = torch.where(step > 0, (xb / step).round() * step, 0).flatten(-2)
    wf = dequantized(w)
    integer = ops.integer_gemm(isa, "int5")
    xs = digits if integer else x
    y = run(w, x, isa=isa)
    assert ((y - xs @ wf.T).abs() <= 1e-5 * (xs.abs() @ wf.abs().T)).all()
    other = x if integer else digits
    assert ((y - other @ wf.T).abs() > 1e-5 * (xs.abs() @ wf.abs().T)).any()


@needs_c
def test_binding_checks():
    w = packed(True, 10, 64)
    with pytest.raises(ValueError, match="qh"):
        ops.q5_matmul(torch.randn(1, 64), w["qweight"], w["qh"][:, :4], w["scales"], None)
    with pytest.raises(ValueError, match="scales"):
        ops.q5_matmul(torch.randn(1, 64), w["qweight"], w["qh"], w["scales"].float(), None)
    with pytest.raises(ValueError, match="mins"):
        ops.q5_matmul(torch.randn(1, 64), w["qweight"], w["qh"], w["scales"], w["scales"][:1])
    with pytest.raises(ValueError, match="qweight"):
        ops.q5_matmul(
            torch.randn(1, 48), torch.zeros(2, 24, dtype=torch.uint8), w["qh"], None, None
        )


@needs_c
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_quant_linear_forward(sym):
    from infer.quant.formats.base import FORMATS, QuantLinear

    torch.manual_seed(0)
    weight, bias = torch.randn(24, 128), torch.randn(24)
    q = FORMATS["int5"].from_float(weight, bias, search=False, symmetric=sym)
    for x in (torch.randn(2, 5, 128), torch.randn(1, 1, 128)):
        ref = QuantLinear.forward(q, x)
        bound = ops.integer_gemm_error(x.reshape(-1, 128), q.dequantize()).view(ref.shape)
        assert ((q(x) - ref).abs() <= bound + 1e-5 * ref.abs() + 1e-4).all()
