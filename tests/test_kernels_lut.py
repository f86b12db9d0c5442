"""LUT GEMM (kernels_cpu/csrc/lut*.c) against its references (kernels_cpu/reference.py).

C equals the int8-table reference (tables bit for bit, results to float rounding) for
1..4 bits, M in {1, 7}, awkward K and odd N; every path this CPU runs gives the same
bits as the scalar one, at any thread count; the error against the exact x W^T stays
within the tables' bound.
"""

import pytest
import torch

from infer.kernels_cpu import ops, reference
from infer.quant.formats.base import FORMATS

pytestmark = pytest.mark.skipif(not ops.available(), reason="C extension not built")

ISAS = ops.supported_isas()
# (K, group size): K = 64 * odd, 192, 576 (SmolLM2's width), a group of 32 with K % 64 = 32,
# 128, and groups that are not a multiple of 32 (the SIMD paths hand those to scalar).
SHAPES = [(64, 64), (192, 64), (576, 64), (448, 64), (160, 32), (1024, 128), (192, 96), (72, 8)]


def layer(bits: int, N: int, K: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen)
    return FORMATS[f"lut{bits}"].from_float(w, group_size=g, search=False)


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # heavy tails, as hidden states have: outliers set a group's table scale
    return torch.randn(M, K, generator=gen) * torch.rand(M, K, generator=gen) ** 4 * 3


def run(lin, x, **kw):
    return ops.lut_matmul(x, lin.qweight, lin.scales, lin.mins, lin.group_size, **kw)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("K,g", SHAPES)
def test_tables_bit_exact(bits, K, g):
    x = activations(3, K)
    x[1, :g] *= 1e-33  # a group of ~0 (zero tables)
    ref = reference.lut_build_tables(x, bits, g)
    for isa in ISAS:
        got = ops.lut_tables(x, bits, g, isa=isa)
        for r, c in zip(ref, got):
            assert torch.equal(r, c), isa
    t = ref[0].short()
    assert torch.equal(t[..., 8:], -t[..., :8].flip(-1))  # the mirror
    assert t.abs().max() <= 127


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("K,g", SHAPES)
@pytest.mark.parametrize("M", [1, 7])
def test_matches_reference_and_paths_agree(bits, K, g, M):
    N = 37  # odd: two SIMD blocks and a scalar tail
    lin = layer(bits, N, K, g)
    x = activations(M, K)
    ref = reference.lut_matmul(x, lin.qweight, lin.scales, lin.mins, g)
    scalar = run(lin, x, isa="scalar", threads=1)
    # float32 FMAs in the C vs float64 in the reference: rounding of the running sum
    mag = (lin.scales.float().abs() * 1e3 + lin.mins.float().abs()).sum(-1) * x.abs().max()
    torch.testing.assert_close(scalar, ref, rtol=1e-5, atol=float(mag.max()) * 1e-6)
    for isa in ISAS:
        for threads in (1, 2):
            assert torch.equal(run(lin, x, isa=isa, threads=threads), scalar), (isa, threads)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_error_against_exact_within_bound(bits):
    K, g, N = 576, 64, 48
    lin = layer(bits, N, K, g, seed=bits)
    x = activations(7, K, seed=bits)
    exact = reference.lut_matmul_exact(x, lin.qweight, lin.scales, lin.mins, g)
    assert torch.allclose(exact, x @ lin.dequantize().T, rtol=1e-5, atol=1e-4)
    y = run(lin, x)
    bound = reference.lut_table_error_bound(x, lin.scales, bits, g).float()
    err = (y - exact).abs()
    assert (err <= bound + 1e-4 * exact.abs() + 1e-3).all()
    # the bound is a worst case; the typical error is far inside it
    assert err.norm() / exact.norm() < 0.03


def test_larger_shapes_and_threads():
    """Several row blocks per task, and more tasks than threads."""
    lin = layer(2, 1000, 1024, 64, seed=5)
    for M in (1, 3):
        x = activations(M, 1024, seed=M)
        one = run(lin, x, threads=1)
        assert torch.equal(run(lin, x, threads=2), one)
        assert torch.equal(run(lin, x, threads=3), one)
        assert torch.equal(run(lin, x, isa="scalar", threads=2), one)


def test_forward_uses_kernel():
    lin = layer(3, 40, 192, 64)
    lin.bias = torch.nn.Parameter(torch.randn(40), requires_grad=False)
    x = activations(2, 192).view(2, 1, 192)
    y = lin(x)
    assert y.shape == (2, 1, 40)
    assert torch.equal(y, run(lin, x) + lin.bias)
    # other dtypes take the dequantizing reference
    yb = lin(x.bfloat16())
    assert yb.dtype == torch.bfloat16


def test_bad_arguments():
    lin = layer(2, 8, 64, 64)
    with pytest.raises(ValueError):
        ops.lut_matmul(torch.randn(1, 64), lin.qweight, lin.scales, lin.mins, 32)
    with pytest.raises(ValueError):
        ops.lut_matmul(torch.randn(1, 64), lin.qweight.transpose(1, 2), lin.scales, lin.mins, 64)
    with pytest.raises(TypeError):
        ops.lut_matmul(torch.randn(1, 64).double(), lin.qweight, lin.scales, lin.mins, 64)
    with pytest.raises(ValueError):
        ops.lut_matmul(torch.randn(1, 32), lin.qweight, lin.scales, lin.mins, 64)
