"""q3_k and q2_k (GGUF Q3_K's and Q2_K's blocks as they lie) against gguf-py and their
torch references.

The references dequantize bit for bit as gguf.quants does, and so does each path's C
dequantization (x = the identity picks W's elements out of the GEMM exactly). The GEMV
on the x86 paths takes x as q4_k's does (int16, 15 significant bits per block of 256), and
q3_k's prompts on the vpdpbusd paths the integer GEMM's two digits (per block of 32):
each within ops.integer_gemm_error at its block size of the float product; the others
within float32 summation. Then rows together against each alone, thread counts, inf in
x, and the formats' quantizers."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import pytest
import torch

from infer.kernels_cpu import ops, reference
from infer.quant.formats.q2k import Q2KLinear
from infer.quant.formats.q3k import Q3KLinear

needs_c = pytest.mark.skipif(not ops.available(), reason="C extension not built")
ISAS = ops.supported_isas() or ["none"]
SMALL_M, WIDE_M, WIDE_K = 4, 8, 768  # matmul.c: M rows that run one GEMV each
IGEMM_MIN_M = 16  # matmul.c: from this many rows the GEMM is the integer one, if any


@dataclass
class Kind:
    fmt: str
    bytes: int
    halves_at: int  # where the block's float16 d (and Q2_K's dmin) lie
    halves: int
    qtype: gguf.GGMLQuantizationType
    cls: type
    matmul: object
    dequantize: object
    unpack: object
    pack: object


KINDS = {
    "q3_k": Kind("q3_k", 110, 108, 1, gguf.GGMLQuantizationType.Q3_K, Q3KLinear,
                 ops.q3k_matmul, reference.dequantize_q3k, reference.unpack_q3k, reference.pack_q3k),
    "q2_k": Kind("q2_k", 84, 80, 2, gguf.GGMLQuantizationType.Q2_K, Q2KLinear,
                 ops.q2k_matmul, reference.dequantize_q2k, reference.unpack_q2k, reference.pack_q2k),
}  # fmt: skip


@pytest.fixture(params=sorted(KINDS))
def kind(request) -> Kind:
    return KINDS[request.param]


def blocks(kind: Kind, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """(N, K/256*bytes) random blocks: every code and scale byte; d (and dmin) sane."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (N, K // 256, kind.bytes), dtype=torch.uint8, generator=gen)
    d = (torch.rand(N, K // 256, kind.halves, generator=gen) * 2e-3 + 1e-4).half()
    b[..., kind.halves_at :] = d.view(torch.uint8).view(N, K // 256, 2 * kind.halves)
    return b.view(N, -1)


def assert_matches(kind, y, x, qw, isa):
    wf = kind.dequantize(qw)
    ref = x @ wf.T
    tol = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
    M, K = x.shape
    if (M <= SMALL_M or (M <= WIDE_M and K >= WIDE_K)) and ops.q4k_gemv_fifteen_bits(isa):
        tol = tol + ops.integer_gemm_error(x, wf, block=256)
    elif M >= IGEMM_MIN_M and ops.integer_gemm(isa, kind.fmt):
        tol = tol + ops.integer_gemm_error(x, wf, block=32)
    assert y.shape == ref.shape and y.dtype == torch.float32
    bad = (y - ref).abs() > tol
    assert not bad.any(), f"{bad.sum()} of {bad.numel()} outside; max {(y - ref).abs().max()}"


def test_reference_is_gguf_bit_for_bit(kind):
    qw = blocks(kind, 7, 768, seed=3)
    want = gguf.quants.dequantize(qw.numpy(), kind.qtype)
    assert torch.equal(kind.dequantize(qw), torch.from_numpy(want))
    assert torch.equal(kind.pack(*kind.unpack(qw)), qw)


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
    """A GEMV of a few rows makes each block's products of codes and scales once for all
    of them; each row's output is its one-row output bit for bit, for every count of rows
    that takes the GEMV, and beside a row holding inf."""
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
    """Zeros, tiny and subnormal blocks, a huge value; then inf takes the float GEMV."""
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
def test_q3_k_prompts_on_the_integer_gemm(isa):
    """The integer GEMM multiplies x's digits, round(x / sx) sx with sx per block of 32,
    by codes 128 - q sc: a block holding 1.0 and values under half a step shows that it
    ran (where the path has it) and that its products are the weights' exactly; scales
    of -32 (q sc = 128, the one product whose sign is needed) included."""
    M, K = IGEMM_MIN_M + 3, 512
    qw = blocks(KINDS["q3_k"], 7, K, seed=2)
    qw.view(7, 2, 110)[:, 0, 96:108] = 0  # every scale of the first blocks: 0 - 32
    x = torch.zeros(M, K)
    x[:, 32:64] = (1 + 0.4 * torch.rand(M, 32, generator=torch.Generator().manual_seed(1))) * 1e-5
    x[:, 40] = 1.0
    x[:, 300:320] = torch.randn(M, 20, generator=torch.Generator().manual_seed(2))
    xb = x.unflatten(-1, (-1, 32))
    step = xb.abs().amax(-1, keepdim=True) / ops.IG_XMAX
    digits = torch.where(step > 0, (xb / step).round() * step, 0).flatten(-2)
    wf = reference.dequantize_q3k(qw)
    integer = ops.integer_gemm(isa, "q3_k")
    xs = digits if integer else x
    y = ops.q3k_matmul(x, qw, isa=isa)
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


@pytest.mark.parametrize(("fmt", "bits", "factor"), [("q3_k", 3.4375, 2.3), ("q2_k", 2.625, 4.5)])
def test_from_float_error_against_int4(fmt, bits, factor):
    """Quantized, a Gaussian weight's error is near what a bit or two fewer than int4
    g32's 5 give (about 2x, 4x its error), and the bytes dequantize through gguf to the
    module's values."""
    from infer.quant.formats.int4 import Int4Linear

    kind = KINDS[fmt]
    torch.manual_seed(0)
    w = torch.randn(64, 512) * 0.02
    w[:, 7] += 0.05  # an outlier column
    q = kind.cls.from_float(w)
    assert q.qweight.shape == (64, 2 * kind.bytes) and q.bits_per_weight == bits
    err = (q.dequantize() - w).square().mean().sqrt()
    err4 = (Int4Linear.from_float(w).dequantize() - w).square().mean().sqrt()
    assert err < factor * err4, (err, err4)
    want = gguf.quants.dequantize(q.qweight.numpy(), kind.qtype)
    assert torch.equal(q.dequantize(), torch.from_numpy(want))


def test_q3_k_from_float_bounds_and_zeros():
    """Without search every element is within half a step of its group; a zero row stays
    zero; sc stays in -31..31."""
    w = torch.randn(4, 512)
    w[1] = 0
    q = Q3KLinear.from_float(w, search=False)
    codes, sc, d = reference.unpack_q3k(q.qweight)
    assert sc.abs().max() <= 31 and codes.min() >= -4 and codes.max() <= 3
    step = (d.float().repeat_interleave(16, 1) * sc.float()).abs().repeat_interleave(16, 1)
    err = (q.dequantize() - w).abs()
    assert err[1].max() == 0
    assert (err <= step / 2 * (1 + 1e-6)).all()


def test_q2_k_from_float_positive_groups_and_zeros():
    """Groups of positive weights (a min of 0: Q2_K's grid starts at 0) and a zero row;
    without search each element within a step of its group's range."""
    w = torch.rand(4, 256) + 1.0
    w[1] = 0
    q = Q2KLinear.from_float(w, search=False)
    err = (q.dequantize() - w).abs()
    assert err[1].max() == 0
    assert err.max() < 2.0 / 3  # within a step of the range [0, max]


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
        kind.cls.from_float(torch.randn(4, 576))
    with pytest.raises(InferError, match="finite|inf"):
        kind.cls.from_float(torch.full((2, 256), float("inf")))
    with pytest.raises(InferError, match="whole blocks"):
        kind.cls.from_tensors({"qweight": torch.zeros(2, kind.bytes + 1, dtype=torch.uint8)}, {})
