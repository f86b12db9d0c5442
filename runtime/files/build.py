"""Build a Transformer from a source (sources.py): the one way every model is made.

The source checked its tensors' shapes against the config when it was opened
(model_file.py). The model is built on the meta device and those tensors are assigned
into it, so weights exist once: mapped straight from the file where the dtype already
matches, converted (or dequantized, for GGUF blocks) exactly once otherwise. Weights
copied for the kernels (a GGUF file's blocks) go into one huge-page arena (hugepages.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ... import InferError
from ...quant.formats.base import QuantEmbedding, QuantLinear
from ..model.families import model_class
from ..model.llama import Transformer
from . import hugepages
from .gguf_blocks import new_tensor
from .sources import Source

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Part:
    """The weights one stage of a pipeline holds (runtime/pipeline/): the blocks of
    `layers`, and with `ends` the embeddings, the final norm and the output layer."""

    layers: range
    ends: bool

    def holds(self, name: str) -> bool:
        """Whether the tensor or module `name` (ours or a Hugging Face name) is held."""
        if "rope_freqs" in name:  # every stage builds rope tables
            return True
        m = _LAYER.search(name)
        return int(m[1]) in self.layers if m else self.ends


def build(
    source: Source,
    dtype: torch.dtype,
    max_seq_len: int | None = None,
    *,
    dequantize=False,
    part: Part | None = None,
) -> Transformer:
    """`source`'s model in `dtype`, ready to run over `max_seq_len` positions (default:
    the model's context). `dequantize`: see Source.weights. `part`: only those weights
    are read; the rest of the model stays on the meta device (a pipeline stage)."""
    args = source.args
    with torch.device("meta"):
        model = model_class(args)(args)
    arena = hugepages.Arena.of(source.placed_bytes(dtype, dequantize))
    alloc = arena.empty if arena else new_tensor
    weights = source.weights(dtype, alloc, dequantize, keep=part and part.holds)
    if arena:
        arena.close()
    floats = {k: v for k, v in weights.items() if not isinstance(v, QuantLinear)}
    modules = {k: v for k, v in weights.items() if isinstance(v, QuantLinear)}
    for name, t in floats.items():  # assign=True would take an integer tensor as it is
        if not t.is_floating_point():
            raise InferError(f"{source.path}: {name!r} is {t.dtype}, not a float type")
    # Tied embeddings: the output layer is the table (a file may hold a copy beside it).
    tied = args.tie_embeddings or not {"lm_head", "lm_head.weight"} & weights.keys()
    if tied:
        floats.pop("lm_head.weight", None)
        modules.pop("lm_head", None)
    table = modules.pop("embed_tokens", None)
    if table is not None:
        _check_linear("embed_tokens", table, (args.vocab_size, args.dim), source.path)
        model.embed_tokens = QuantEmbedding(table)
        if tied:
            model.lm_head = table
    elif tied and "embed_tokens.weight" in floats:
        floats["lm_head.weight"] = floats["embed_tokens.weight"]
    for name, module in modules.items():
        _place(model, name, module, source.path)
    try:
        result = model.load_state_dict(floats, strict=False, assign=True)
    except RuntimeError as e:
        lines = str(e).strip().splitlines()
        detail = lines[1].strip() if len(lines) > 1 else lines[0]
        raise InferError(f"{source.path}: weights do not match the config: {detail}") from None
    missing = [
        n
        for n, t in (*model.named_parameters(), *model.named_buffers())
        if t.is_meta and (part is None or part.holds(n))
    ]
    if result.unexpected_keys or missing:
        detail = (
            f"no place for {result.unexpected_keys[0]!r}"
            if result.unexpected_keys
            else f"missing {missing[0]!r}"
        )
        raise InferError(f"{source.path}: weights do not match the config: {detail}")
    if tied and table is None:  # one parameter, as the file stores one table
        model.lm_head.weight = model.embed_tokens.weight
    model.setup_rope(min(max_seq_len or args.max_seq_len, args.max_seq_len), dtype)
    return model.eval().requires_grad_(False)


def _place(model: Transformer, name: str, module: QuantLinear, path: Path) -> None:
    """Put a QuantLinear where the model's nn.Linear `name` is, if its shape is that one's."""
    parent_name, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        parent = None
    linear = getattr(parent, child, None)
    if not isinstance(linear, nn.Linear):
        raise InferError(f"{path}: quantized module '{name}' is not a linear layer of this model")
    _check_linear(name, module, tuple(linear.weight.shape), path)
    setattr(parent, child, module)


def _check_linear(name: str, module: QuantLinear, want: tuple[int, int], path: Path) -> None:
    shape = (module.out_features, module.in_features)
    if shape != want:
        raise InferError(f"{path}: {name!r} has shape {shape}, the config says {want}")
