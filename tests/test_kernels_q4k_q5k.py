"""q4_k and q5_k (GGUF Q4_K's and Q5_K's blocks as they lie) against gguf-py and their
torch references.

The reference dequantizes bit for bit as gguf.quants does, and so does each path's C
dequantization (x = the identity picks W's elements out of the GEMM exactly). The GEMV
on the paths that take x as two int8 digits (15 significant bits per block of 256) is
within ops.integer_gemm_error at that block size of the float product; the others within
float32 summation. Then thread counts, inf in x, and the format's quantizer (the fused
decode step's tests run it beside the other formats)."""

from __future__ import annotations

import gguf
import pytest
import torch

from infer.kernels_cpu import ops, reference
from infer.quant.formats.q4k import Q4KLinear, pack_blocks, pack_scales
from infer.quant.formats.q5k import Q5KLinear

needs_c = pytest.mark.skipif(not ops.available(), reason="C extension not built")
ISAS = ops.supported_isas() or ["none"]
SMALL_M, WIDE_M, WIDE_K = 4, 8, 768  # matmul.c: M rows that run one GEMV each
IGEMM_MIN_M = 16  # matmul.c: from this many rows the GEMM is the integer one, if any


class Kind:
    def __init__(self, fmt, size, qtype, cls, matmul, dequantize):
        self.fmt, self.bytes, self.qtype, self.cls = fmt, size, qtype, cls
        self.matmul, self.dequantize = matmul, dequantize


KINDS = {
    "q4_k": Kind("q4_k", 144, gguf.GGMLQuantizationType.Q4_K, Q4KLinear, ops.q4k_matmul,
                 reference.dequantize_q4k),
    "q5_k": Kind("q5_k", 176, gguf.GGMLQuantizationType.Q5_K, Q5KLinear, ops.q5k_matmul,
                 reference.dequantize_q5k),
}  # fmt: skip


@pytest.fixture(params=sorted(KINDS))
def kind(request) -> Kind:
    return KINDS[request.param]


def blocks(N: int, K: int, seed: int = 0, kind: Kind = KINDS["q4_k"]) -> torch.Tensor:
    """(N, K/256*bytes) random Q4_K (or Q5_K) blocks: every code, scale and min byte; d
    and dmin sane."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (N, K // 256, kind.bytes), dtype=torch.uint8, generator=gen)
    d = (torch.rand(N, K // 256, 2, generator=gen) * 2e-3 + 1e-4).half()
    b[..., :4] = d.view(torch.uint8).view(N, K // 256, 4)
    return b.view(N, -1)


def digit_block(M: int, K: int, isa: str, fmt: str = "q4_k") -> int:
    """The block of x that gets one step when the rows' x becomes two int8 digits: 256 in
    the GEMV of paths with them, 32 in the integer GEMM (prompts) of paths that take q4_k
    there; 0 where x stays float32."""
    runs_gemv = M <= SMALL_M or (M <= WIDE_M and K >= WIDE_K)
    if runs_gemv:
        return 256 if ops.q4k_gemv_fifteen_bits(isa) else 0
    return 32 if M >= IGEMM_MIN_M and ops.integer_gemm(isa, fmt) else 0


def assert_matches(y, x, qw, isa, kind=KINDS["q4_k"]):
    wf = kind.dequantize(qw)
    ref = x @ wf.T
    tol = 1e-5 * (x.abs() @ wf.abs().T) + 1e-30
    if block := digit_block(*x.shape, isa, kind.fmt):
        tol = tol + ops.integer_gemm_error(x, wf, block=block)
    assert y.shape == ref.shape and y.dtype == torch.float32
    bad = (y - ref).abs() > tol
    assert not bad.any(), f"{bad.sum()} of {bad.numel()} outside; max {(y - ref).abs().max()}"


def test_reference_is_gguf_bit_for_bit(kind):
    qw = blocks(7, 768, seed=3, kind=kind)
    want = gguf.quants.dequantize(qw.numpy(), kind.qtype)
    assert torch.equal(kind.dequantize(qw), torch.from_numpy(want))


@needs_c
def test_digit_paths():
    for isa in ops.supported_isas():
        on_digits = isa in ("avx2", "avx2vnni", "avx512", "avx512vnni")
        assert ops.q4k_gemv_fifteen_bits(isa) == on_digits, isa


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_dequantization_is_gguf_bit_for_bit(kind, isa):
    qw = blocks(37, 512, seed=1, kind=kind)
    # x = I: every y[k, n] is the one product 1 * w[n, k], so y is W^T as dequantized; in
    # runs of 12 rows, which take the float GEMM (the integer one scales the digits)
    eye = torch.eye(512)
    y = torch.cat([kind.matmul(eye[i : i + 12], qw, isa=isa, threads=2) for i in range(0, 512, 12)])
    assert torch.equal(y.T, kind.dequantize(qw))


@needs_c
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [1, 3, 7, 12, 33])
def test_matches_reference(kind, isa, M):
    for N, K in [(37, 256), (5, 768), (66, 256 * 5), (1, 512)]:
        qw = blocks(N, K, seed=N + K, kind=kind)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        assert_matches(kind.matmul(x, qw, isa=isa, threads=2), x, qw, isa, kind)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_long_rows_and_threads(kind, isa):
    K = 8960  # 35 blocks: the 1.5B model's down projection
    qw = blocks(333, K, seed=5, kind=kind)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(5))
    for M in (1, 3, 5, 40):
        y = kind.matmul(x[:M], qw, isa=isa, threads=1)
        assert_matches(y, x[:M], qw, isa, kind)
        for threads in (2, 3):
            assert torch.equal(kind.matmul(x[:M], qw, isa=isa, threads=threads), y)


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_rows_together_equal_each_alone(kind, isa):
    """A GEMV of a few rows unpacks each block once for all of them (int16 x on AVX2,
    where one row takes its two digits); each row's output is its one-row output bit for
    bit, for every count of rows that takes the GEMV, and beside a row holding inf."""
    qw = blocks(67, 1024, seed=6, kind=kind)
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
    qw = blocks(9, 1024, kind=kind)
    x = torch.randn(M, 1024)
    x[:, :256] = 0
    x[:, 256:512] *= 1e-30
    x[:, 512:768] *= 1e-39
    x[0, 800] = 3e30
    assert_matches(kind.matmul(x, qw, isa=isa), x, qw, isa, kind)
    x[-1, 900] = float("inf")
    ref = x @ kind.dequantize(qw).T
    assert torch.equal(kind.matmul(x, qw, isa=isa).isfinite(), ref.isfinite())


@needs_c
@pytest.mark.parametrize("isa", ISAS)
def test_which_prompts_keep_fifteen_bits_of_x(kind, isa):
    """The integer GEMM multiplies x's digits, round(x / sx) sx with sx = amax / IG_XMAX
    per block of 32 (not q4_k's 256), and the float GEMM x itself: a block holding 1.0 and
    values under half a step (1.54e-5) shows which one ran."""
    M, K = IGEMM_MIN_M + 3, 512
    qw = blocks(7, K, seed=2, kind=kind)
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(M, K)
    x[:, 32:64] = (1 + 0.4 * torch.rand(M, 32, generator=gen)) * 1e-5
    x[:, 40] = 1.0
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
        kind.matmul(torch.randn(1, 256), torch.zeros(2, 140, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x"):
        kind.matmul(torch.randn(1, 255), blocks(2, 256, kind=kind))


def test_pack_blocks_round_trip():
    """pack_blocks is the inverse of the file's layout: random fields packed, then
    dequantized by gguf, give d sc q - dmin m element by element."""
    gen = torch.Generator().manual_seed(0)
    N, K = 3, 512
    q = torch.randint(0, 16, (N, K), generator=gen)
    sc, m = (torch.randint(0, 64, (N, K // 32), generator=gen) for _ in range(2))
    d, dmin = (torch.rand(N, K // 256, generator=gen).half() for _ in range(2))
    packed = pack_blocks(q, sc, m, d, dmin)
    got = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType.Q4_K))
    d1 = d.float().repeat_interleave(8, 1) * sc.float()
    m1 = dmin.float().repeat_interleave(8, 1) * m.float()
    want = d1.repeat_interleave(32, 1) * q.float() - m1.repeat_interleave(32, 1)
    assert torch.equal(got, want)
    back = reference.k_scales_mins(pack_scales(sc.view(N, -1, 8), m.view(N, -1, 8)))
    assert torch.equal(back[0].view(N, -1), sc) and torch.equal(back[1].view(N, -1), m)


def test_q5_k_from_float_halves_q4_k_error():
    """q5_k's codes reach 31: a Gaussian weight's error about half q4_k's, the bytes
    through gguf the module's values, and the packing gguf's layout."""
    torch.manual_seed(0)
    w = torch.randn(64, 512) * 0.02
    q5, q4 = Q5KLinear.from_float(w), Q4KLinear.from_float(w)
    assert q5.qweight.shape == (64, 2 * 176) and q5.bits_per_weight == 5.5
    err5, err4 = ((q.dequantize() - w).square().mean().sqrt() for q in (q5, q4))
    assert err5 < 0.6 * err4, (err5, err4)
    want = gguf.quants.dequantize(q5.qweight.numpy(), gguf.GGMLQuantizationType.Q5_K)
    assert torch.equal(q5.dequantize(), torch.from_numpy(want))


def test_from_float_error_like_int4():
    """Quantized, a Gaussian weight's error is near int4 g32's (5 bits a weight: its
    float16 scale and min per 32 against 6-bit ones per 32 and float16 per 256)."""
    from infer.quant.formats.int4 import Int4Linear

    torch.manual_seed(0)
    w = torch.randn(64, 512) * 0.02
    w[:, 7] += 0.05  # an outlier column
    q = Q4KLinear.from_float(w)
    assert q.qweight.shape == (64, 2 * 144) and q.bits_per_weight == 4.5
    err = (q.dequantize() - w).square().mean().sqrt()
    err4 = (Int4Linear.from_float(w).dequantize() - w).square().mean().sqrt()
    assert err < 1.15 * err4, (err, err4)
    # the same bytes through gguf
    want = gguf.quants.dequantize(q.qweight.numpy(), gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(q.dequantize(), torch.from_numpy(want))


def test_from_float_positive_groups_and_zeros():
    w = torch.rand(4, 256) + 1.0  # every min > 0: Q4_K's grid starts at 0
    w[1] = 0
    q = Q4KLinear.from_float(w, search=False)
    err = (q.dequantize() - w).abs()
    assert err[1].max() == 0
    assert err.max() < 2.0 / 15  # within a step of the range [0, max]


@needs_c
def test_quant_linear_forward():
    from infer.quant.formats.base import QuantLinear

    torch.manual_seed(0)
    weight, bias = torch.randn(24, 256), torch.randn(24)
    q = Q4KLinear.from_float(weight, bias, search=False)
    for x in (torch.randn(2, 5, 256), torch.randn(1, 1, 256)):
        ref = QuantLinear.forward(q, x)
        flat = x.reshape(-1, 256)
        bound = ops.integer_gemm_error(flat, q.dequantize(), block=256).view(ref.shape)
        assert ((q(x) - ref).abs() <= bound + 1e-5 * ref.abs() + 1e-4).all()


def test_bad_input():
    from infer import InferError
    from infer.quant.formats.fit import GroupSizeError

    with pytest.raises(GroupSizeError, match="multiple of its blocks of 256"):
        Q4KLinear.from_float(torch.randn(4, 576))  # the default model's width
    with pytest.raises(InferError, match="finite|inf"):
        Q4KLinear.from_float(torch.full((2, 256), float("inf")))
    with pytest.raises(InferError, match="whole blocks"):
        Q4KLinear.from_tensors({"qweight": torch.zeros(2, 200, dtype=torch.uint8)}, {})
    with pytest.raises(InferError, match="unexpected"):
        Q4KLinear.from_tensors({"qweight": blocks(2, 256), "scales": torch.zeros(1)}, {})
