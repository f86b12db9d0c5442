"""One source per kind of model file: a GGUF file, a Hugging Face safetensors directory,
our checkpoint directory (checkpoint.py). `open_source` tells them apart by content.

Opening reads metadata only: the config, the file's weight types, its size. A source's
`weights` gives the model's tensors under our state-dict names, each either a tensor
(mapped from the file where its dtype already matches, converted once otherwise) or a
prebuilt QuantLinear under its module name; build.py assigns them into a model. A
quantized embedding table is the module "embed_tokens", a tied output layer absent.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path

import torch

from ... import InferError
from ...quant.formats.base import FORMATS, QuantLinear
from ..model.config import ModelArgs, check_rope_freq_factors
from ..model.families import model_args, model_class
from ..model.tokenizer import Tokenizer
from .checkpoint import ROPE_FREQS, Checkpoint, is_checkpoint, read_checkpoint
from .gguf import GGUFFile
from .gguf_blocks import ON_KERNELS, Place, kernel_weights, loaded_bytes, placed_bytes, to_kernels
from .gguf_header import is_gguf
from .gguf_tensor import dequantize
from .safetensors import FLOAT_DTYPES, read_header, read_safetensors

# name -> a tensor, or a QuantLinear under its module name (see the module docstring)
Weights = dict[str, "torch.Tensor | QuantLinear"]


class Source:
    """A model file opened for loading: what it is, then its weights."""

    path: Path
    format: str  # "gguf" | "safetensors" | "infer"
    config: dict  # Hugging Face config.json-style
    args: ModelArgs  # the one the model is built from (weights() may add rope factors)
    quantization: str  # dominant weight type: "Q4_1", "BF16", "int4", "mixed: int4, int8"
    file_bytes: int

    def tokenizer(self) -> Tokenizer:
        return _fits(Tokenizer.from_hf_dir(self.path), self)

    def shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Every tensor `weights` gives by state-dict name (a quantized module's as its
        ".weight"), read from the header alone: build checks them against the config
        before any is read. None where only the built modules tell (our checkpoints)."""
        return None

    def weights(
        self, dtype: torch.dtype, place: Place = torch.Tensor.contiguous, dequantize=False
    ) -> Weights:
        """The model's tensors; weights copied for the kernels go where `place` puts them.
        `dequantize`: a GGUF file's blocks in `dtype` too, the exact float reference."""
        raise NotImplementedError

    def placed_bytes(self, dtype: torch.dtype, dequantize=False) -> int:
        """The bytes `weights` copies with `place` (build sizes its huge-page arena so)."""
        return 0

    def held_bytes(self, dtype: torch.dtype) -> int:
        """An estimate of the bytes the built model's weights hold."""
        return self.args.n_params * dtype.itemsize


def open_source(path: Path) -> Source:
    """The source for `path`, told apart by content; reads no weights."""
    path = Path(path)
    if path.is_dir():
        if is_checkpoint(path):
            return CheckpointSource(read_checkpoint(path))
        if not (path / "config.json").is_file():
            raise InferError(f"{path}: not a model directory (no config.json)")
        return HFSource(path)
    if not path.exists():
        raise InferError(f"{path}: no such file or directory")
    if is_gguf(path):
        return GGUFSource(path)
    raise InferError(f"{path}: not a GGUF file or a Hugging Face model directory")


def _most_common(types: Counter, default: str) -> str:
    return types.most_common(1)[0][0] if types else default


def _fits(tok: Tokenizer, source: Source) -> Tokenizer:
    """`tok`, if every id it makes has a row in the embedding table."""
    if tok.vocab_size > source.args.vocab_size:
        raise InferError(
            f"{source.path}: the tokenizer has {tok.vocab_size} tokens, more than the "
            f"{source.args.vocab_size} rows of the embedding table"
        )
    return tok


_LAYER_RE = re.compile(r"(?:model\.)?layers\.(\d+)\.")


def _check_counts(source: Source, shapes: dict[str, list[int]]) -> None:
    """The layers the tensors hold, and the experts their routers have rows for, are the
    config's: one cheap look at the header before the model is built layer by layer."""
    args = source.args
    found = max((int(m.group(1)) + 1 for n in shapes if (m := _LAYER_RE.match(n))), default=0)
    if found != args.n_layers:
        raise InferError(
            f"{source.path}: num_hidden_layers = {args.n_layers}, but the weights hold "
            f"{found} layers"
        )
    for name, shape in shapes.items():
        rows = shape[0] if shape else 0
        if name.endswith(".mlp.gate.weight") and rows != args.n_experts:
            raise InferError(
                f"{source.path}: num_experts = {args.n_experts}, but {name} has {rows} rows"
            )


# -- GGUF ---------------------------------------------------------------------------------


class GGUFSource(Source):
    """A GGUF file. In float32 its quantized weights run on the int8 / int4 kernels, as
    llama.cpp runs them (gguf_blocks.to_kernels): Q8_0 / Q4_0 / Q4_1 blocks moved into
    those formats unchanged, Q4_K's codes into int4, every other quantized type held in
    int8. Float types, and every weight in another dtype, are converted to `dtype`."""

    format = "gguf"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.gguf = GGUFFile(path)
        self.config = self.gguf.config()
        self.args = model_args(self.config, str(self.path), self.gguf.config_keys)
        rope_freqs = self.gguf.tensors.get("rope_freqs.weight")
        if rope_freqs is not None:  # llama 3.1 rope scaling: a factor per frequency, read now
            n = self.args.head_dim // 2
            if rope_freqs.shape != (n,):
                raise InferError(
                    f"{self.path}: rope_freqs.weight has shape {rope_freqs.shape}; "
                    f"head_dim {self.args.head_dim} needs ({n},)"
                )
            factors = dequantize(rope_freqs).tolist()
            check_rope_freq_factors(factors, self.args.head_dim, str(self.path))
        types = Counter(t.ggml_type.name for t in self.gguf.tensors.values() if len(t.shape) == 2)
        self.quantization = _most_common(types, "F32")
        self.file_bytes = self.gguf.file_bytes

    def tokenizer(self) -> Tokenizer:
        try:
            tok = Tokenizer.from_gguf_metadata(self.gguf.metadata)
        except InferError as e:  # the metadata's message, with the file it is in
            raise InferError(f"{self.path}: {e}") from None
        return _fits(tok, self)

    def shapes(self):
        shapes = {hf.removeprefix("model."): s for hf, s in self.gguf.hf_shapes().items()}
        shapes.pop("rope_freqs.weight", None)  # checked on opening
        return shapes

    def _on_kernels(self, dtype: torch.dtype, dequantize: bool) -> bool:
        return dtype == torch.float32 and not dequantize

    def weights(self, dtype, place=torch.Tensor.contiguous, dequantize=False) -> Weights:
        blocks = kernel_weights(self.gguf) if self._on_kernels(dtype, dequantize) else set()
        # A tied model's output layer is its table, whatever the file holds beside it.
        unused = {"lm_head.weight"} if self.args.tie_embeddings else set()
        sd = self.gguf.hf_state_dict(dtype, skip=blocks | unused)
        sd = model_class(self.args).sanitize(sd, self.args)
        for hf in sorted(blocks - unused):
            t = self.gguf.hf_tensor(hf)
            name = hf.removeprefix("model.").removesuffix(".weight")
            sd[name] = to_kernels(t, sd.pop(f"{name}.bias", None), place)
            self.gguf.release(t)  # copied: its pages need not stay in memory
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


class HFSource(Source):
    """A Hugging Face model directory: config.json and .safetensors weights, converted
    to the compute dtype (mapped as they are where it matches)."""

    format = "safetensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        file = self.path / "config.json"
        try:
            self.config = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise InferError(f"{file}: invalid JSON ({e})") from None
        self.args = model_args(self.config, str(file))
        self.files = _safetensors_files(self.path)
        self.headers = {f: read_header(f)[0] for f in self.files}
        entries = {k: v for h in self.headers.values() for k, v in h.items() if k != "__metadata__"}
        _check_counts(self, {k: v["shape"] for k, v in entries.items()})
        self.quantization = _most_common(Counter(v["dtype"] for v in entries.values()), "?")
        self.file_bytes = sum(f.stat().st_size for f in self.files)

    def shapes(self):
        # The tensors on the meta device through sanitize: its renames and splits, no data.
        sd = {}
        for header in self.headers.values():
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

    def weights(self, dtype, place=torch.Tensor.contiguous, dequantize=False) -> Weights:
        sd = {}
        for f in self.files:
            tensors, _ = read_safetensors(f)
            sd.update(tensors)
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        return model_class(self.args).sanitize(sd, self.args)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, RecursionError, LookupError, TypeError, AttributeError):
            # not JSON or UTF-8, no weight_map, or not a map of names
            raise InferError(f"{index}: corrupt safetensors index") from None
        # Shards are files of this folder, never a path that leads out of it.
        if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
            raise InferError(f"{index}: a shard name that is not a file name in {path}")
        files = [path / name for name in sorted(names)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InferError(f"{path}: missing weight shards {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = list(path.glob("*.bin")) + list(path.glob("*.pt"))
        hint = (
            " (pickled .bin/.pt weights are never loaded: convert to safetensors)"
            if pickles
            else ""
        )
        raise InferError(f"{path}: no .safetensors weights{hint}")
    return files


# -- our checkpoint -------------------------------------------------------------------------


class CheckpointSource(Source):
    """Our checkpoint (checkpoint.py): QuantLinear modules built by their format's
    `from_tensors` over the mapped buffers, float tensors mapped (converted only where
    `dtype` differs). offload/ builds over one whose streamed tensors are placeholders."""

    format = "infer"

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.path = checkpoint.path
        self.config = checkpoint.config
        self.args = checkpoint.args
        self.quantization = checkpoint.quantization
        self.file_bytes = checkpoint.file.stat().st_size
        _check_counts(self, {k: list(t.shape) for k, t in checkpoint.tensors.items()})

    def weights(self, dtype, place=torch.Tensor.contiguous, dequantize=False) -> Weights:
        ckpt = self.checkpoint
        sd, parts = {}, {name: {} for name in ckpt.quant}
        for name, t in ckpt.tensors.items():
            owner, _, suffix = name.rpartition(".")
            if owner in parts:
                parts[owner][suffix] = t
            elif name != ROPE_FREQS:  # in args already
                sd[name] = t.to(dtype) if t.is_floating_point() else t
        for name, entry in ckpt.quant.items():
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
