"""GGUF Q8_0 / Q6_K / Q5_K / Q5_0 / Q5_1 / Q4_K / IQ4_XS / Q3_K / Q2_K / Q4_0 / Q4_1
tensors as int8 / int6 / q5_k / int5 / q4_k / iq4_xs / q3_k / q2_k / int4 QuantLinears, by
moving bytes.

ggml's block layouts (ggml/src/ggml-common.h; QK = 32 elements per block, little-endian,
ggml_half = IEEE float16):

    block_q8_0 { ggml_half d;              int8_t  qs[32]; }  34 bytes  w = qs[i] * d
    block_q4_0 { ggml_half d;              uint8_t qs[16]; }  18 bytes  w = (q_i - 8) * d
    block_q4_1 { ggml_half d, m;           uint8_t qs[16]; }  20 bytes  w = q_i * d + m
    block_q5_0 { ggml_half d;    uint8_t qh[4]; uint8_t qs[16]; }  22 bytes  w = (q_i - 16) * d
    block_q5_1 { ggml_half d, m; uint8_t qh[4]; uint8_t qs[16]; }  24 bytes  w = q_i * d + m

where in the 4-bit types q_i is the low nibble of qs[i] and q_(16+i) its high nibble, and
the 5-bit types add bit i of the little-endian uint32 qh as q_i's bit 4.
The K-quants' 256-element blocks (Q6_K 210, Q5_K 176, Q4_K 144, Q3_K 110 and Q2_K 84
bytes) and IQ4_XS's (136) are int6's, q5_k's, q4_k's, q3_k's, q2_k's and iq4_xs's layouts
as they are (quant/formats/int6.py, q5k.py, q4k.py, q3k.py, q2k.py, iq4xs.py): the
tensor is a view of the file's map.
A row of K elements is K/32 consecutive blocks. Our int8, int5 and int4 (group 32)
layouts were chosen so that each block's `qs` is one 32-element run of `qweight` as is,
its `qh` one entry of int5's `qh`, and d (and m) one entry of `scales` (and `mins`): import splits the blocks into those
columns and changes no bit, and the result's `dequantize()` equals
`gguf_tensor.dequantize` (and so gguf-py's) exactly, as the tests check.

This is how a GGUF file's such tensors load to run (sources.GGUFSource), and how
`infer quantize` carries them into a checkpoint whose recipe asks for their format.

Loading to run, the rest go onto the kernels in int8 g32 (`to_kernels`): IQ4_NL exactly
(its 16 levels are int8 values, its scale a float16 per 32), and approximately

    every other block-quantized type (the other IQ types, ...)
        -> int8 g32 from its values, each within 1/254 of its group's largest
           magnitude (within an eighth of a step for a 5- or 6-bit grid)

Float types (F32, F16, BF16) are not quantized on load: they are converted to the
compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ... import InferError
from ...kernels_cpu.reference import IQ4_VALUES
from ...quant.formats.base import FORMATS, QuantLinear
from ...quant.formats.int4 import Int4Linear
from ...quant.formats.int5 import Int5Linear
from ...quant.formats.int6 import Int6Linear
from ...quant.formats.int8 import Int8Linear
from ...quant.formats.iq4xs import IQ4XSLinear
from ...quant.formats.q2k import Q2KLinear
from ...quant.formats.q3k import Q3KLinear
from ...quant.formats.q4k import Q4KLinear
from ...quant.formats.q5k import Q5KLinear
from ...quant.formats.recipes import is_router, spec_params
from . import hugepages
from .gguf import GGUFFile
from .gguf_tensor import GGUFTensor, dequantize

# ggml type -> the format spec whose layout and arithmetic it is.
GGUF_SPECS: dict[GGMLQuantizationType, dict] = {
    GGMLQuantizationType.Q8_0: {"format": "int8", "group_size": 32},
    GGMLQuantizationType.Q6_K: {"format": "int6"},
    GGMLQuantizationType.Q5_0: {"format": "int5", "group_size": 32, "symmetric": True},
    GGMLQuantizationType.Q5_1: {"format": "int5", "group_size": 32, "symmetric": False},
    GGMLQuantizationType.Q5_K: {"format": "q5_k"},
    GGMLQuantizationType.Q4_K: {"format": "q4_k"},
    GGMLQuantizationType.Q3_K: {"format": "q3_k"},
    GGMLQuantizationType.Q2_K: {"format": "q2_k"},
    GGMLQuantizationType.IQ4_XS: {"format": "iq4_xs"},
    GGMLQuantizationType.Q4_0: {"format": "int4", "group_size": 32, "symmetric": True},
    GGMLQuantizationType.Q4_1: {"format": "int4", "group_size": 32, "symmetric": False},
}


# Loaded to run: every block-quantized type goes onto the kernels; those that are not
# moved as they are (GGUF_SPECS) are held in int8, requantized
# from their values this many rows at a time.
ON_KERNELS = {t for t, (block, _) in GGML_QUANT_SIZES.items() if block > 1}
HELD_IN_INT8 = ON_KERNELS - set(GGUF_SPECS)
# Left in the file's map: the blocks are the format's layout as they are.
IN_PLACE = {
    GGMLQuantizationType.Q6_K: Int6Linear,
    GGMLQuantizationType.Q5_K: Q5KLinear,
    GGMLQuantizationType.Q4_K: Q4KLinear,
    GGMLQuantizationType.Q3_K: Q3KLinear,
    GGMLQuantizationType.Q2_K: Q2KLinear,
    GGMLQuantizationType.IQ4_XS: IQ4XSLinear,
}
ROWS_AT_ONCE = 4096

# Where the kernels' weights are written at load: a new tensor of a shape and dtype
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
# Lets the file's pages of a tensor, copied, go (GGUFFile.release)
Release = Callable[[GGUFTensor], None]


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in torch's memory (the Alloc without a huge-page arena)."""
    return torch.empty(shape, dtype=dtype)


def _keep(t: GGUFTensor) -> None:
    """The Release that lets nothing go."""


# Where each piece of a block of 32 weights lies, in bytes: scale d, min m, the fifth
# bits qh, the codes q (ggml-common.h).
_PIECES = {
    GGMLQuantizationType.Q8_0: {"d": (0, 2), "q": (2, 34)},
    GGMLQuantizationType.Q5_0: {"d": (0, 2), "qh": (2, 6), "q": (6, 22)},
    GGMLQuantizationType.Q5_1: {"d": (0, 2), "m": (2, 4), "qh": (4, 8), "q": (8, 24)},
    GGMLQuantizationType.Q4_0: {"d": (0, 2), "q": (2, 18)},
    GGMLQuantizationType.Q4_1: {"d": (0, 2), "m": (2, 4), "q": (4, 20)},
}


def importable(t: GGUFTensor, spec: dict) -> bool:
    """True if `t`'s blocks are exactly the format `spec` asks for (defaults filled in)."""
    target = GGUF_SPECS.get(t.ggml_type)
    if target is None or len(t.shape) != 2 or spec.get("format") != target["format"]:
        return False
    params = FORMATS[target["format"]].resolve_params(spec_params(spec))
    return {"format": target["format"], **params} == target


def kernel_weights(gguf: GGUFFile) -> set[str]:
    """The Hugging Face names of the tensors of `gguf` that run on our kernels
    (`to_kernels`): every weight of a linear layer (an expert's included) or of the
    embedding table in a type of ON_KERNELS. A router stays float, as in every recipe.
    Names only: fetching a tensor (`hf_tensor`) may un-permute a copy of its rows."""
    found = set()
    for name, t in gguf.tensors.items():
        if t.ggml_type not in ON_KERNELS:
            continue
        hf_names = gguf.hf_names(name)
        dims = len(t.shape) - (len(hf_names) > 1)  # one expert of a stacked tensor: 2-D
        for hf in hf_names:
            module = hf.removeprefix("model.").removesuffix(".weight")
            if dims == 2 and hf.endswith(".weight") and not is_router(module):
                found.add(hf)
    return found


def from_gguf(
    t: GGUFTensor,
    bias: torch.Tensor | None = None,
    alloc: Alloc = new_tensor,
    release: Release = _keep,
) -> QuantLinear:
    """The tensor `t` of a type in GGUF_SPECS (rows already un-permuted) as the format
    whose layout it is (the module docstring). IN_PLACE's blocks stay where they are
    (the file's map); the others' codes and scales are copied apart into memory
    from `alloc` (torch's by default, or the build's huge-page arena), `release` letting
    each run of rows' file pages go once copied."""
    if t.ggml_type not in GGUF_SPECS:
        supported = ", ".join(k.name for k in GGUF_SPECS)
        raise InferError(
            f"{t.name}: cannot import ggml type {t.ggml_type.name} ({supported} can be)"
        )
    if len(t.shape) != 2:
        raise InferError(f"{t.name}: expected a 2-D weight, got shape {t.shape}")
    N, K = t.shape
    if t.ggml_type in IN_PLACE:
        kind = IN_PLACE[t.ggml_type]
        return kind(torch.from_numpy(t.data).view(N, K // 256 * kind.block_bytes), {}, bias)
    p = _copied(t, _PIECES[t.ggml_type], alloc, release)
    d = p["d"].view(torch.float16).view(N, K // 32)
    m = p["m"].view(torch.float16).view(N, K // 32) if "m" in p else None
    params = spec_params(GGUF_SPECS[t.ggml_type])
    if t.ggml_type == GGMLQuantizationType.Q8_0:
        return Int8Linear(p["q"].view(torch.int8).view(N, K), d, params, bias)
    if "qh" in p:
        return Int5Linear(p["q"].view(N, K // 2), p["qh"].view(N, K // 8), d, m, params, bias)
    return Int4Linear(p["q"].view(N, K // 2), d, m, params, bias)


def _copied(
    t: GGUFTensor, pieces: dict[str, tuple[int, int]], alloc: Alloc, release: Release
) -> dict[str, torch.Tensor]:
    """Each piece of every block of `t` (bytes [a, b) of `pieces`), as (rows, blocks,
    b - a) uint8 from `alloc`. Copied ROWS_AT_ONCE rows at a time, each run's file pages
    released once copied: a large table is never whole in memory twice."""
    N = t.shape[0]
    blocks = torch.from_numpy(t.data).view(N, -1, GGML_QUANT_SIZES[t.ggml_type][1])
    out = {k: alloc((N, blocks.shape[1], b - a), torch.uint8) for k, (a, b) in pieces.items()}
    for start in range(0, N, ROWS_AT_ONCE):
        run = slice(start, start + ROWS_AT_ONCE)
        for k, (a, b) in pieces.items():
            out[k][run].copy_(blocks[run, :, a:b])
        release(t.rows(start, start + ROWS_AT_ONCE))
    return out


def loaded_bytes(t: GGUFTensor) -> int:
    """The bytes `to_kernels` holds for `t` (all its experts, for a stacked tensor):
    the file's bytes for the types of GGUF_SPECS, else int8 g32's 34 per 32 (as Q8_0)."""
    if t.ggml_type in GGUF_SPECS:
        return t.nbytes
    return math.prod(t.shape) // 32 * 34


def placed_bytes(t: GGUFTensor) -> int:
    """The bytes that `to_kernels` copies into `alloc`'s memory for `t` (all its experts, for a
    stacked tensor): none for the K-quants of IN_PLACE, left in the file's map; for the others their
    codes, scales and mins (and int5's high bits), each rounded up to a cache line as an
    arena lays them."""
    if t.ggml_type in IN_PLACE:
        return 0
    pieces = math.prod(t.shape[:-2])  # 1, or the experts of a stacked tensor
    int5 = (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1)
    return loaded_bytes(t) + (4 if t.ggml_type in int5 else 3) * hugepages.ALIGN * pieces


def to_kernels(
    t: GGUFTensor,
    bias: torch.Tensor | None = None,
    alloc: Alloc = new_tensor,
    release: Release = _keep,
) -> QuantLinear:
    """The 2-D tensor `t` (a type of ON_KERNELS) as the QuantLinear that runs it: Q8_0 /
    the types of GGUF_SPECS bit for bit, any other type in int8 g32. Its codes and scales are copied into memory from `alloc`; `release`
    lets the file's pages go (from_gguf)."""
    if t.ggml_type in GGUF_SPECS:
        return from_gguf(t, bias, alloc, release)
    if t.ggml_type not in HELD_IN_INT8:
        raise InferError(f"{t.name}: no kernel runs ggml type {t.ggml_type.name}")
    q = _held_in_int8(t, bias, release)
    for name in ("qweight", "scales"):  # computed in torch's memory: moved whole
        computed = getattr(q, name)
        setattr(q, name, alloc(computed.shape, computed.dtype).copy_(computed))
    return q


def _iq4_nl_in_int8(part: GGUFTensor) -> Int8Linear:
    """IQ4_NL's blocks (d, then 16 bytes of codes: element i low nibble, 16 + i high) as
    int8 g32 exactly: each code's level (kvalues_iq4nl, int8) times d (float16)."""
    n, K = part.shape
    blocks = torch.from_numpy(part.data).view(n, K // 32, 18)
    codes = torch.cat((blocks[..., 2:] & 15, blocks[..., 2:] >> 4), -1).view(n, K).long()
    levels = torch.tensor(IQ4_VALUES, dtype=torch.int8)[codes]
    d = blocks[..., :2].contiguous().view(torch.float16).view(n, K // 32)
    return Int8Linear(levels, d, {"group_size": 32})


def _held_in_int8(t: GGUFTensor, bias: torch.Tensor | None, release: Release) -> Int8Linear:
    """In int8 g32: IQ4_NL exactly (its levels are int8 values), the rest requantized from
    their values."""
    runs = []  # ROWS_AT_ONCE rows at a time: a large table is never whole in float32
    for start in range(0, t.shape[0], ROWS_AT_ONCE):
        part = t.rows(start, start + ROWS_AT_ONCE)
        if t.ggml_type == GGMLQuantizationType.IQ4_NL:
            runs.append(_iq4_nl_in_int8(part))
        else:
            runs.append(Int8Linear.from_float(dequantize(part), group_size=32, search=False))
        release(part)
    qweight, scales = (torch.cat([getattr(r, k) for r in runs]) for k in ("qweight", "scales"))
    return Int8Linear(qweight, scales, runs[0].params, bias)
