"""One source per kind of model file: a GGUF file, a Hugging Face safetensors directory,
our checkpoint directory (checkpoint.py). `open_source` tells them apart by content.

A source is its model file (model_file.py) opened for loading: opening reads metadata
only (the config, the file's weight types, its size) and checks the tensors' shapes
against the config. A source's
`weights` gives the model's tensors under our state-dict names, each either a tensor
(mapped from the file where its dtype already matches, converted once otherwise) or a
prebuilt QuantLinear under its module name; build.py assigns them into a model. A
quantized embedding table is the module "embed_tokens", a tied output layer absent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import torch

from ... import InferError
from ...quant.formats.base import FORMATS, QuantLinear
from ..model.families import model_class
from ..model.tokenizer import Tokenizer
from .checkpoint import Checkpoint, read_checkpoint
from .checkpoint_header import ROPE_FREQS
from .gguf import GGUFFile
from .gguf_blocks import (
    ON_KERNELS,
    Alloc,
    kernel_weights,
    loaded_bytes,
    new_tensor,
    placed_bytes,
    to_kernels,
)
from .model_file import (
    CheckpointFile,
    GGUFModelFile,
    HFModelFile,
    ModelFile,
    model_kind,
)
from .safetensors import read_safetensors
from .safetensors_header import FLOAT_DTYPES

# name -> a tensor, or a QuantLinear under its module name (see the module docstring)
Weights = dict[str, "torch.Tensor | QuantLinear"]
# Whether a tensor, by name (ours or its Hugging Face name), is to be read
Keep = Callable[[str], bool]


class Source(ModelFile):
    """A model file opened for loading: what it is (model_file.py), then its weights."""

    def tokenizer(self) -> Tokenizer:
        return _fits(Tokenizer.from_hf_dir(self.path), self)

    def weights(
        self,
        dtype: torch.dtype,
        alloc: Alloc = new_tensor,
        dequantize=False,
        keep: Keep | None = None,
    ) -> Weights:
        """The model's tensors; weights copied for the kernels go into memory from `alloc`.
        `dequantize`: a GGUF file's blocks in `dtype` too, the exact float reference.
        `keep`: only the tensors whose name it accepts are read (build.Part.holds)."""
        raise NotImplementedError

    def placed_bytes(self, dtype: torch.dtype, dequantize=False) -> int:
        """The bytes `weights` copies into `alloc`'s memory (build sizes its huge-page
        arena so)."""
        return 0

    def held_bytes(self, dtype: torch.dtype) -> int:
        """An estimate of the bytes the built model's weights hold."""
        return self.args.n_params * dtype.itemsize

    def layers_bytes(self, dtype: torch.dtype, layers: range) -> int:
        """An estimate of the bytes blocks `layers` hold (a pipeline stage's): their
        share of held_bytes."""
        return self.held_bytes(dtype) * len(layers) // self.args.n_layers


def open_source(path: Path) -> Source:
    """The source for `path`, told apart by content (model_file.model_kind); reads no weights."""
    kind = model_kind(path)
    if kind == "gguf":
        return GGUFSource(path)
    if kind == "infer":
        return CheckpointSource(read_checkpoint(path))
    return HFSource(path)


def _fits(tok: Tokenizer, source: Source) -> Tokenizer:
    """`tok`, if every id it makes has a row in the embedding table."""
    if tok.vocab_size > source.args.vocab_size:
        raise InferError(
            f"{source.path}: the tokenizer has {tok.vocab_size} tokens, more than the "
            f"{source.args.vocab_size} rows of the embedding table"
        )
    return tok


def _tensors(weights: Weights) -> list[torch.Tensor]:
    """Every tensor of `weights`, a QuantLinear's buffers and bias included."""
    return [
        t
        for w in weights.values()
        for t in (w.state_dict().values() if isinstance(w, QuantLinear) else [w])
    ]


# -- GGUF ---------------------------------------------------------------------------------


class GGUFSource(GGUFModelFile, Source):
    """A GGUF file. In float32 its quantized weights run on the kernels in their own bits,
    as llama.cpp runs them (gguf_blocks.to_kernels): Q8_0 / Q5_0 / Q5_1 / Q4_0 / Q4_1
    blocks moved into int8 / int5 / int4 unchanged, the K-quants used in place from the
    file, every other quantized type held in int8. Float types, and every weight in
    another dtype, are converted to `dtype`."""

    gguf: GGUFFile

    def __init__(self, path: Path):
        super().__init__(GGUFFile(path))

    def tokenizer(self) -> Tokenizer:
        try:
            tok = Tokenizer.from_gguf_metadata(self.gguf.metadata)
        except InferError as e:  # the metadata's message, with the file it is in
            raise InferError(f"{self.path}: {e}") from None
        return _fits(tok, self)

    def _on_kernels(self, dtype: torch.dtype, dequantize: bool) -> bool:
        return dtype == torch.float32 and not dequantize

    def weights(self, dtype, alloc=new_tensor, dequantize=False, keep=None) -> Weights:
        blocks = kernel_weights(self.gguf) if self._on_kernels(dtype, dequantize) else set()
        # A tied model's output layer is its table, whatever the file holds beside it.
        unused = {"lm_head.weight"} if self.args.tie_embeddings else set()
        if keep is not None:
            names = {hf for name in self.gguf.tensors for hf in self.gguf.hf_names(name)}
            unused |= {hf for hf in names if not keep(hf)}
        sd = self.gguf.hf_state_dict(dtype, skip=blocks | unused)
        sd = model_class(self.args).sanitize(sd, self.args)
        for hf in sorted(blocks - unused):
            t = self.gguf.hf_tensor(hf)
            name = hf.removeprefix("model.").removesuffix(".weight")
            sd[name] = to_kernels(t, sd.pop(f"{name}.bias", None), alloc, self.gguf.release)
            self.gguf.release(t)  # copied: its pages need not stay in memory
        self.gguf.hold_only(_tensors(sd))  # the weights used in place; the rest goes
        return sd

    def placed_bytes(self, dtype, dequantize=False) -> int:
        # Every quantized tensor's, used or not: a page not written costs no memory.
        if not self._on_kernels(dtype, dequantize):
            return 0
        tensors = self.gguf.tensors.values()
        return sum(placed_bytes(t) for t in tensors if t.ggml_type in ON_KERNELS)

    def held_bytes(self, dtype) -> int:
        if not self._on_kernels(dtype, False):
            return super().held_bytes(dtype)
        return sum(
            loaded_bytes(t) if t.ggml_type in ON_KERNELS else math.prod(t.shape) * 4
            for t in self.gguf.tensors.values()
        )


# -- Hugging Face safetensors ---------------------------------------------------------------


class HFSource(HFModelFile, Source):
    """A Hugging Face model directory: config.json and .safetensors weights, converted
    to the compute dtype (mapped as they are where it matches). Its tensors' shapes are
    checked on opening, named as the model's sanitize names them."""

    def shapes(self):
        # The tensors on the meta device through sanitize: its renames and splits, no data.
        sd = {}
        for header, _ in self.headers.values():
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in FLOAT_DTYPES:
                    raise InferError(f"{self.path}: tensor {name!r} is {entry['dtype']}, not float")
                sd[name] = torch.empty(entry["shape"], device="meta")
        rope_freqs = sd.pop("rope_freqs.weight", None)  # sanitize would read its values
        try:
            shapes = model_class(self.args).sanitize(sd, dataclasses.replace(self.args))
        except (ValueError, TypeError, IndexError, RuntimeError) as e:  # a name it cannot split
            raise InferError(f"{self.path}: unexpected tensor names or shapes ({e})") from None
        if rope_freqs is not None:
            shapes["rope_freqs.weight"] = rope_freqs
        return {k: tuple(v.shape) for k, v in shapes.items()}

    def weights(self, dtype, alloc=new_tensor, dequantize=False, keep=None) -> Weights:
        sd = {}
        for f in self.files:
            tensors, _ = read_safetensors(f, self.headers[f])
            sd.update(tensors)
        sd = {
            k: v.to(dtype) if v.is_floating_point() else v
            for k, v in sd.items()
            if keep is None or keep(k)
        }
        return model_class(self.args).sanitize(sd, self.args)


# -- our checkpoint -------------------------------------------------------------------------


class CheckpointSource(CheckpointFile, Source):
    """Our checkpoint (checkpoint.py): QuantLinear modules built by their format's
    `from_tensors` over the mapped buffers, float tensors mapped (converted only where
    `dtype` differs). offload/ builds over one whose streamed tensors are placeholders."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        super().__init__(checkpoint)

    def layers_bytes(self, dtype: torch.dtype, layers: range) -> int:
        # Each block is one unit of the file, held as stored (its few float tensors are
        # float32 in the file: at most that in `dtype`).
        ranges = self.checkpoint.ranges
        return sum(e - b for unit, (b, e) in ranges.items() if _layer(unit) in layers)

    def weights(self, dtype, alloc=new_tensor, dequantize=False, keep=None) -> Weights:
        ckpt = self.checkpoint
        quant = {k: v for k, v in ckpt.quant.items() if keep is None or keep(k)}
        sd, parts = {}, {name: {} for name in quant}
        for name, t in ckpt.tensors.items():
            if keep is not None and not keep(name):
                continue
            owner, _, suffix = name.rpartition(".")
            if owner in parts:
                parts[owner][suffix] = t
            elif name != ROPE_FREQS:  # in args already
                sd[name] = t.to(dtype) if t.is_floating_point() else t
        for name, entry in quant.items():
            params = {k: v for k, v in entry.items() if k != "format"}
            bias = parts[name].pop("bias", None)
            try:
                sd[name] = FORMATS[entry["format"]].from_tensors(
                    parts[name], params, None if bias is None else bias.to(dtype)
                )
            except (InferError, KeyError, TypeError, ValueError) as e:
                raise InferError(f"{ckpt.file}: cannot build '{name}': {e}") from None
        # The table is stored once: as "lm_head" when tied and quantized, as
        # "embed_tokens.table" when quantized alone; here it is "embed_tokens" either way.
        if "embed_tokens.table" in sd:
            sd["embed_tokens"] = sd.pop("embed_tokens.table")
        elif "lm_head" in sd and "embed_tokens.weight" not in sd:
            sd["embed_tokens"] = sd.pop("lm_head")
        return sd


def _layer(unit: str) -> int | None:
    """The block a checkpoint unit ("layers.3", "layers.3.mlp.experts.5") belongs to."""
    parts = unit.split(".")
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 else None
