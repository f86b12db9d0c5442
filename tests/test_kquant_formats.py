"""The K-quant formats' own parts: packing into GGUF's layouts and fitting float weights
(q5_k, q4_k, q3_k, q2_k; their kernels: test_kernels_kquants.py)."""

from __future__ import annotations

import gguf
import pytest
import torch

from infer.kernels_cpu import reference
from infer.quant.formats.int4 import Int4Linear
from infer.quant.formats.iq4xs import IQ4XSLinear
from infer.quant.formats.q2k import Q2KLinear
from infer.quant.formats.q3k import Q3KLinear
from infer.quant.formats.q4k import Q4KLinear, pack_blocks, pack_scales
from infer.quant.formats.q5k import Q5KLinear

T = gguf.GGMLQuantizationType


def test_q4_k_pack_blocks_round_trip():
    """pack_blocks is the inverse of the file's layout: random fields packed, then
    dequantized by gguf, give d sc q - dmin m element by element."""
    gen = torch.Generator().manual_seed(0)
    N, K = 3, 512
    q = torch.randint(0, 16, (N, K), generator=gen)
    sc, m = (torch.randint(0, 64, (N, K // 32), generator=gen) for _ in range(2))
    d, dmin = (torch.rand(N, K // 256, generator=gen).half() for _ in range(2))
    packed = pack_blocks(q, sc, m, d, dmin)
    got = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), T.Q4_K))
    d1 = d.float().repeat_interleave(8, 1) * sc.float()
    m1 = dmin.float().repeat_interleave(8, 1) * m.float()
    want = d1.repeat_interleave(32, 1) * q.float() - m1.repeat_interleave(32, 1)
    assert torch.equal(got, want)
    back = reference.k_scales_mins(pack_scales(sc.view(N, -1, 8), m.view(N, -1, 8)))
    assert torch.equal(back[0].view(N, -1), sc) and torch.equal(back[1].view(N, -1), m)


@pytest.mark.parametrize(("unpack", "pack", "size"), [
    (reference.unpack_q3k, reference.pack_q3k, 110),
    (reference.unpack_q2k, reference.pack_q2k, 84),
    (reference.unpack_iq4xs, reference.pack_iq4xs, 136),
])  # fmt: skip
def test_unpack_and_pack_are_inverses(unpack, pack, size):
    b = torch.randint(0, 256, (5, 3 * size), dtype=torch.uint8, generator=torch.Generator())
    assert torch.equal(pack(*unpack(b)), b)


@pytest.mark.parametrize(
    ("cls", "qtype", "size", "bits", "factor"),
    [
        (Q5KLinear, T.Q5_K, 176, 5.5, 0.6),
        (Q4KLinear, T.Q4_K, 144, 4.5, 1.15),
        (Q3KLinear, T.Q3_K, 110, 3.4375, 2.3),
        (Q2KLinear, T.Q2_K, 84, 2.625, 4.5),
        (IQ4XSLinear, T.IQ4_XS, 136, 4.25, 1.15),
    ],
)
def test_from_float_error_against_int4(cls, qtype, size, bits, factor):
    """Quantized, a Gaussian weight with an outlier column has about the error its bits
    give against int4 g32's (5 bits a weight: 0.5x at 5.5, level at 4.5, about 2x at 3.44,
    4x at 2.63, level at IQ4_XS's 4.25 with its non-uniform levels), and the bytes
    dequantize through gguf to the module's values."""
    torch.manual_seed(0)
    w = torch.randn(64, 512) * 0.02
    w[:, 7] += 0.05  # an outlier column
    q = cls.from_float(w)
    assert q.qweight.shape == (64, 2 * size) and q.bits_per_weight == bits
    err = (q.dequantize() - w).square().mean().sqrt()
    err4 = (Int4Linear.from_float(w).dequantize() - w).square().mean().sqrt()
    assert err < factor * err4, (err, err4)
    want = gguf.quants.dequantize(q.qweight.numpy(), qtype)
    assert torch.equal(q.dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize(("cls", "top"), [(Q5KLinear, 31), (Q4KLinear, 15), (Q2KLinear, 3)])
def test_from_float_positive_groups_and_zeros(cls, top):
    """Groups of positive weights (a min of 0: the grid starts at 0) and a zero row;
    without search each element within a step of its group's range."""
    w = torch.rand(4, 256) + 1.0
    w[1] = 0
    q = cls.from_float(w, search=False)
    err = (q.dequantize() - w).abs()
    assert err[1].max() == 0
    assert err.max() < 2.0 / top  # within a step of the range [0, max]


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
