"""GGUF Q8_0 / Q4_0 / Q4_1 tensors as int8 / int4 QuantLinears, by moving bytes.

ggml's block layouts (ggml/src/ggml-common.h; QK = 32 elements per block, little-endian,
ggml_half = IEEE float16):

    block_q8_0 { ggml_half d;              int8_t  qs[32]; }  34 bytes  w = qs[i] * d
    block_q4_0 { ggml_half d;              uint8_t qs[16]; }  18 bytes  w = (q_i - 8) * d
    block_q4_1 { ggml_half d, m;           uint8_t qs[16]; }  20 bytes  w = q_i * d + m

where in the 4-bit types q_i is the low nibble of qs[i] and q_(16+i) its high nibble.
A row of K elements is K/32 consecutive blocks. Our int8 (group 32) and int4 (group 32)
layouts were chosen so that each block's `qs` is one 32-element run of `qweight` as is,
and d (and m) one entry of `scales` (and `mins`): import splits the blocks into those
columns and changes no bit, and the result's `dequantize()` equals
`infer.runtime.gguf_file.dequantize` (and so gguf-py's) exactly, as the tests check.

This is how a GGUF file's such tensors load to run (runtime/loader.py), and how
`infer quantize` carries them into a checkpoint whose recipe asks for their format.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..runtime.errors import InferError
from ..runtime.gguf_file import GGUFFile, GGUFTensor
from .base import FORMATS, QuantLinear
from .int4 import Int4Linear
from .int8 import Int8Linear
from .recipes import is_router

# ggml type -> the format spec whose layout and arithmetic it is.
GGUF_SPECS: dict[GGMLQuantizationType, dict] = {
    GGMLQuantizationType.Q8_0: {"format": "int8", "group_size": 32},
    GGMLQuantizationType.Q4_0: {"format": "int4", "group_size": 32, "symmetric": True},
    GGMLQuantizationType.Q4_1: {"format": "int4", "group_size": 32, "symmetric": False},
}


def importable(t: GGUFTensor, spec: dict) -> bool:
    """True if `t`'s blocks are exactly the format `spec` asks for (defaults filled in)."""
    target = GGUF_SPECS.get(t.ggml_type)
    if target is None or len(t.shape) != 2 or spec.get("format") != target["format"]:
        return False
    params = FORMATS[target["format"]].resolve_params(
        {k: v for k, v in spec.items() if k != "format"}
    )
    return {"format": target["format"], **params} == target


def kernel_tensors(gguf: GGUFFile) -> dict[str, GGUFTensor]:
    """The tensors of `gguf` that run on our kernels as they are, by Hugging Face name:
    every Q8_0 / Q4_0 / Q4_1 weight of a linear layer (an expert's included) or of the
    embedding table. A router stays float, as in every recipe."""
    found = {}
    for name, t in gguf.tensors.items():
        if t.ggml_type not in GGUF_SPECS:
            continue
        for hf in gguf.hf_names(name):
            module = hf.removeprefix("model.").removesuffix(".weight")
            if hf.endswith(".weight") and not is_router(module):
                part = gguf.hf_tensor(hf)  # an expert's rows of a stacked tensor
                if len(part.shape) == 2:
                    found[hf] = part
    return found


def from_gguf(t: GGUFTensor, bias: torch.Tensor | None = None) -> QuantLinear:
    """The Q8_0 / Q4_0 / Q4_1 tensor `t` (rows already un-permuted) as int8 / int4."""
    if t.ggml_type not in GGUF_SPECS:
        supported = ", ".join(k.name for k in GGUF_SPECS)
        raise InferError(
            f"{t.name}: cannot import ggml type {t.ggml_type.name} ({supported} can be)"
        )
    if len(t.shape) != 2:
        raise InferError(f"{t.name}: expected a 2-D weight, got shape {t.shape}")
    N, K = t.shape
    _, type_size = GGML_QUANT_SIZES[t.ggml_type]
    blocks = torch.from_numpy(t.data).view(N, K // 32, type_size)  # (N, K/32, bytes)

    def f16(at: int) -> torch.Tensor:  # the float16 at byte `at` of every block: (N, K/32)
        return blocks[:, :, at : at + 2].contiguous().view(torch.float16).view(N, K // 32)

    params = {k: v for k, v in GGUF_SPECS[t.ggml_type].items() if k != "format"}
    if t.ggml_type == GGMLQuantizationType.Q8_0:
        qweight = blocks[:, :, 2:].contiguous().view(torch.int8).view(N, K)
        return Int8Linear(qweight, f16(0), params, bias)
    if t.ggml_type == GGMLQuantizationType.Q4_0:
        qweight = blocks[:, :, 2:].contiguous().view(N, K // 2)
        return Int4Linear(qweight, f16(0), None, params, bias)
    qweight = blocks[:, :, 4:].contiguous().view(N, K // 2)  # Q4_1
    return Int4Linear(qweight, f16(0), f16(2), params, bias)
