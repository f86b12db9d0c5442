"""The K-quants and IQ4_XS on the kernels as GGUF's blocks lie (q5_k, q4_k, q3_k, q2_k,
iq4_xs) against gguf-py and their torch references.

The references dequantize bit for bit as gguf.quants does, and so does each path's C
dequantization (x = the identity picks W's elements out of the GEMM exactly). The GEMV on
the x86 paths takes x as int16 (15 significant bits per block of 256), and prompts on the
paths with an integer GEMM for the kind x's two int8 digits (per block of 32): each within
ops.integer_gemm_error at its block size of the float product; the others within float32
summation. Then rows together against each alone, thread counts, inf in x, and the
formats' modules (their fitting: test_kquant_formats.py)."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import pytest
import torch

from infer.kernels_cpu import ops, reference
from infer.quant.formats.base import FORMATS

T = gguf.GGMLQuantizationType
needs_c = pytest.mark.skipif(not ops.available(), reason="C extension not built")
ISAS = ops.supported_isas() or ["none"]
# which rows of x run a GEMV each, and from how many the GEMM is the integer one, if any
SMALL_M, WIDE_M, WIDE_K, IGEMM_MIN_M = ops.matmul_paths()


@dataclass
class Kind:
    fmt: str
    bytes: int
    halves_at: int  # where the block's float16 d (and dmin) lie
    halves: int
    qtype: T
    matmul: object
    dequantize: object

    @property
    def cls(self):
        return FORMATS[self.fmt]


KINDS = {
    "q5_k": Kind("q5_k", 176, 0, 2, T.Q5_K, ops.q5k_matmul, reference.dequantize_q5k),
    "q4_k": Kind("q4_k", 144, 0, 2, T.Q4_K, ops.q4k_matmul, reference.dequantize_q4k),
    "q3_k": Kind("q3_k", 110, 108, 1, T.Q3_K, ops.q3k_matmul, reference.dequantize_q3k),
    "q2_k": Kind("q2_k", 84, 80, 2, T.Q2_K, ops.q2k_matmul, reference.dequantize_q2k),
    "iq4_xs": Kind("iq4_xs", 136, 0, 1, T.IQ4_XS, ops.iq4xs_matmul, reference.dequantize_iq4xs),
}


@pytest.fixture(params=list(KINDS))
def kind(request) -> Kind:
    return KINDS[request.param]


def blocks(kind: Kind, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """(N, K/256*bytes) random blocks: every code, scale and min byte; d (and dmin) sane."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (N, K // 256, kind.bytes), dtype=torch.uint8, generator=gen)
    d = (torch.rand(N, K // 256, kind.halves, generator=gen) * 2e-3 + 1e-4).half()
    b[..., kind.halves_at : kind.halves_at + 2 * kind.halves] = d.view(torch.uint8).view(
        N, K // 256, 2 * kind.halves
    )
    return b.view(N, -1)


def digit_block(kind: Kind, M: int, K: int, isa: str) -> int:
    """The block of x that gets one step when the rows' x becomes integers: 256 in the GEMV
    of paths with an integer GEMV (int16 X), 32 in the integer GEMM (prompts: two int8
    digits) of paths that take the kind there; 0 where x stays float32."""
    if M <= SMALL_M or (M <= WIDE_M and K >= WIDE_K):
        return 256 if ops.q4k_gemv_fifteen_bits(isa) else 0
    return 32 if M >= IGEMM_MIN_M and ops.integer_gemm(isa, kind.fmt) else 0


def assert_matches(kind, y, x, qw, isa):
    wf = kind.dequantize(qw)
    ref = x @ wf.T
    tol = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
    if block := digit_block(kind, *x.shape, isa):
        tol = tol + ops.integer_gemm_error(x, wf, block=block)
    assert y.shape == ref.shape and y.dtype == torch.float32
    bad = (y - ref).abs() > tol
    assert not bad.any(), f"{bad.sum()} of {bad.numel()} outside; max {(y - ref).abs().max()}"


def test_reference_is_gguf_bit_for_bit(kind):
    qw = blocks(kind, 7, 768, seed=3)
    want = gguf.quants.dequantize(qw.numpy(), kind.qtype)
    assert torch.equal(kind.dequantize(qw), torch.from_numpy(want))


@needs_c
def test_integer_paths():
    for isa in ops.supported_isas():
        on_integers = isa in ("avx2", "avx2vnni", "avx512", "avx512vnni")
        assert ops.q4k_gemv_fifteen_bits(isa) == on_integers, isa


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_dequantization_is_gguf_bit_for_bit(kind, isa):
    qw = blocks(kind, 37, 512, seed=1)
    eye = torch.eye(512)  # y = W^T exactly, in runs of 12 rows (the float GEMM)
    y = torch.cat([kind.matmul(eye[i : i + 12], qw, isa=isa, threads=2) for i in range(0, 512, 12)])
    assert torch.equal(y.T, kind.dequantize(qw))


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [1, 3, 7, 12, 33])
def test_matches_reference(kind, isa, M):
    for N, K in [(37, 256), (5, 768), (66, 256 * 5), (1, 512)]:
        qw = blocks(kind, N, K, seed=N + K)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        assert_matches(kind, kind.matmul(x, qw, isa=isa, threads=2), x, qw, isa)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_long_rows_and_threads(kind, isa):
    K = 8960  # 35 blocks: the 1.5B model's down projection
    qw = blocks(kind, 333, K, seed=5)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(5))
    for M in (1, 3, 5, 40):
        y = kind.matmul(x[:M], qw, isa=isa, threads=1)
        assert_matches(kind, y, x[:M], qw, isa)
        for threads in (2, 3):
            assert torch.equal(kind.matmul(x[:M], qw, isa=isa, threads=threads), y)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_rows_together_equal_each_alone(kind, isa):
    """A GEMV of a few rows unpacks each block once for all of them; each row's output is
    its one-row output bit for bit, for every count of rows that takes the GEMV, and beside
    a row holding inf."""
    qw = blocks(kind, 67, 1024, seed=6)
    x = torch.randn(WIDE_M, 1024, generator=torch.Generator().manual_seed(6))
    x[1, :256] *= 1e-39  # a block of subnormals
    alone = torch.cat([kind.matmul(x[i : i + 1], qw, isa=isa) for i in range(WIDE_M)])
    for M in range(2, WIDE_M + 1):
        assert torch.equal(kind.matmul(x[:M], qw, isa=isa, threads=2), alone[:M]), M
    x[2, 100] = float("inf")
    y = kind.matmul(x, qw, isa=isa, threads=2)
    assert torch.equal(torch.cat([y[:2], y[3:]]), torch.cat([alone[:2], alone[3:]]))


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [1, 9, 17])
def test_extreme_activations(kind, isa, M):
    """Zeros, tiny and subnormal blocks, a huge value; then inf takes the float GEMV (or
    GEMM: 17 rows run the integer one where the path has it)."""
    qw = blocks(kind, 9, 1024)
    x = torch.randn(M, 1024)
    x[:, :256] = 0
    x[:, 256:512] *= 1e-30
    x[:, 512:768] *= 1e-39
    x[0, 800] = 3e30
    assert_matches(kind, kind.matmul(x, qw, isa=isa), x, qw, isa)
    x[-1, 900] = float("inf")
    ref = x @ kind.dequantize(qw).T
    assert torch.equal(kind.matmul(x, qw, isa=isa).isfinite(), ref.isfinite())


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_which_prompts_keep_fifteen_bits_of_x(kind, isa):
    """The integer GEMM multiplies x's digits, round(x / sx) sx with sx = amax / IG_XMAX
    per block of 32, and the float GEMM x itself: a block holding 1.0 and values under
    half a step (1.54e-5) shows which one ran, and that the integer one's products are
    the weights' exactly (q3_k's codes 128 - q sc, here with scales of -32: q sc = 128, the
    one product whose sign is needed)."""
    M, K = IGEMM_MIN_M + 3, 512
    qw = blocks(kind, 7, K, seed=2)
    if kind.fmt == "q3_k":
        qw.view(7, 2, 110)[:, 0, 96:108] = 0  # every scale of the first blocks: 0 - 32
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(M, K)
    x[:, 32:64] = (1 + 0.4 * torch.rand(M, 32, generator=gen)) * 1e-5
    x[:, 40] = 1.0
    x[:, 300:320] = torch.randn(M, 20, generator=gen)
    xb = x.unflatten(-1, (-1, 32))
    step = xb.abs().amax(-1, keepdim=True) / ops.IG_XMAX
    digits = torch.where(step > 0, (xb / step).round() * step, 0).flatten(-2)
    wf = kind.dequantize(qw)
    integer = ops.integer_gemm(isa, kind.fmt)
    xs = digits if integer else x
    y = kind.matmul(x, qw, isa=isa)
    tol = 1e-5 * (xs.abs() @ wf.abs().T)
    assert ((y - xs @ wf.T).abs() <= tol).all()
    other = x if integer else digits
    assert ((y - other @ wf.T).abs() > tol).any()


@needs_c
def test_binding_checks(kind):
    with pytest.raises(ValueError, match="qweight"):
        kind.matmul(torch.randn(1, 256), torch.zeros(2, kind.bytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x"):
        kind.matmul(torch.randn(1, 255), blocks(kind, 2, 256))


@needs_c
def test_quant_linear_forward(kind):
    from infer.quant.formats.base import QuantLinear

    torch.manual_seed(0)
    weight, bias = torch.randn(24, 256), torch.randn(24)
    q = kind.cls.from_float(weight, bias, search=False)
    for x in (torch.randn(2, 5, 256), torch.randn(1, 1, 256)):
        ref = QuantLinear.forward(q, x)
        flat = x.reshape(-1, 256)
        bound = ops.integer_gemm_error(flat, q.dequantize(), block=256).view(ref.shape)
        assert ((q(x) - ref).abs() <= bound + 1e-5 * ref.abs() + 1e-4).all()


def test_bad_input(kind):
    from infer import InferError
    from infer.quant.formats.fit import GroupSizeError

    with pytest.raises(GroupSizeError, match="multiple of its blocks of 256"):
        kind.cls.from_float(torch.randn(4, 576))  # the default model's width
    with pytest.raises(InferError, match="finite|inf"):
        kind.cls.from_float(torch.full((2, 256), float("inf")))
    with pytest.raises(InferError, match="whole blocks"):
        kind.cls.from_tensors({"qweight": torch.zeros(2, kind.bytes + 1, dtype=torch.uint8)}, {})
    with pytest.raises(InferError, match="unexpected"):
        kind.cls.from_tensors({"qweight": blocks(kind, 2, 256), "scales": torch.zeros(1)}, {})
