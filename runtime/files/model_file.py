"""What a model file says about itself, from its headers alone: its config, architecture
numbers, weight type and size, and its tensors' shapes checked against the config. One
class per kind of file (a GGUF file, a Hugging Face safetensors directory, our
checkpoint directory); `open_model_file` tells them apart by content.

No torch and no numpy: `infer list` and `infer info` read models with this, in a
fraction of a second. Each source (sources.py) is one of these opened for loading, on
the same read of the headers.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from ... import InferError
from ..model.config import ModelArgs, check_rope_freq_factors
from ..model.families import model_args
from .checkpoint_header import CheckpointHeader, is_checkpoint, read_checkpoint_header
from .gguf_header import is_gguf
from .gguf_meta import GGUFMeta
from .safetensors_header import read_header

_LAYER_RE = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class ModelFile:
    """A model file's metadata, checked against itself."""

    path: Path
    format: str  # "gguf" | "safetensors" | "infer"
    config: dict  # Hugging Face config.json-style
    args: ModelArgs  # the one the model is built from (a source's weights may add rope factors)
    quantization: str  # dominant weight type: "Q4_1", "BF16", "int4", "mixed: int4, int8"
    file_bytes: int

    def shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Every tensor the model is built from by state-dict name (a quantized module's
        as its ".weight"), read from the header alone. None where only the built modules
        tell (our checkpoints' quantized modules), or naming them needs the model's own
        sanitize (HFSource has it)."""
        return None

    def check_shapes(self) -> None:
        """Every tensor has a place in the model the config describes, of its shape, and
        every place a tensor (the output layer may be the table): checked on the header
        before a weight is read, where `shapes` tells."""
        shapes = self.shapes()
        if shapes is None:
            return
        want = self.args.param_shapes()
        want["rope_freqs.weight"] = (self.args.head_dim // 2,)  # optional, as the output layer
        for name, shape in shapes.items():
            if name not in want:
                raise InferError(
                    f"{self.path}: weights do not match the config: no place for {name!r}"
                )
            if tuple(shape) != want[name]:
                raise InferError(
                    f"{self.path}: {name!r} has shape {tuple(shape)}, the config says {want[name]}"
                )
        missing = want.keys() - shapes.keys() - {"lm_head.weight", "rope_freqs.weight"}
        if missing:
            raise InferError(
                f"{self.path}: weights do not match the config: missing {min(missing)!r}"
            )

    def _check_counts(self, shapes: dict[str, list[int]]) -> None:
        """The layers the tensors hold, and the experts their routers have rows for, are
        the config's: one cheap look at the header, before anything is sized by them."""
        args = self.args
        found = max((int(m.group(1)) + 1 for n in shapes if (m := _LAYER_RE.match(n))), default=0)
        if found != args.n_layers:
            raise InferError(
                f"{self.path}: num_hidden_layers = {args.n_layers}, but the weights hold "
                f"{found} layers"
            )
        for name, shape in shapes.items():
            rows = shape[0] if shape else 0
            if name.endswith(".mlp.gate.weight") and rows != args.n_experts:
                raise InferError(
                    f"{self.path}: num_experts = {args.n_experts}, but {name} has {rows} rows"
                )


def model_kind(path: Path) -> str:
    """The format of the model file or directory `path`, told by its content."""
    path = Path(path)
    if path.is_dir():
        if is_checkpoint(path):
            return "infer"
        if not (path / "config.json").is_file():
            raise InferError(f"{path}: not a model directory (no config.json)")
        return "safetensors"
    if not path.exists():
        raise InferError(f"{path}: no such file or directory")
    if is_gguf(path):
        return "gguf"
    raise InferError(f"{path}: not a GGUF file or a Hugging Face model directory")


def open_model_file(path: Path) -> ModelFile:
    """The model file at `path`, its headers read and checked; no weight is read."""
    kind = model_kind(path)
    if kind == "gguf":
        return GGUFModelFile(GGUFMeta(path))
    if kind == "infer":
        return CheckpointFile(read_checkpoint_header(path))
    return HFModelFile(path)


def _most_common(types: Counter, default: str) -> str:
    return types.most_common(1)[0][0] if types else default


# -- GGUF ---------------------------------------------------------------------------------


class GGUFModelFile(ModelFile):
    """A GGUF file, its metadata read as a config.json (gguf_meta.py)."""

    format = "gguf"

    def __init__(self, gguf: GGUFMeta):
        self.gguf = gguf
        self.path = gguf.path
        self.config = gguf.config()
        self.args = model_args(self.config, str(self.path), gguf.config_keys)
        rope_freqs = gguf.tensors.get("rope_freqs.weight")
        if rope_freqs is not None:  # llama 3.1 rope scaling: a factor per frequency, read now
            n = self.args.head_dim // 2
            if rope_freqs.shape != (n,):
                raise InferError(
                    f"{self.path}: rope_freqs.weight has shape {rope_freqs.shape}; "
                    f"head_dim {self.args.head_dim} needs ({n},)"
                )
            factors = gguf.floats("rope_freqs.weight")
            check_rope_freq_factors(factors, self.args.head_dim, str(self.path))
        types = Counter(t.ggml_type.name for t in gguf.tensors.values() if len(t.shape) == 2)
        self.quantization = _most_common(types, "F32")
        self.file_bytes = gguf.file_bytes
        self.check_shapes()

    def shapes(self):
        shapes = {hf.removeprefix("model."): s for hf, s in self.gguf.hf_shapes().items()}
        shapes.pop("rope_freqs.weight", None)  # checked on opening
        return shapes


# -- Hugging Face safetensors ---------------------------------------------------------------


class HFModelFile(ModelFile):
    """A Hugging Face model directory: config.json and the headers of its .safetensors."""

    format = "safetensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        file = self.path / "config.json"
        try:
            self.config = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise InferError(f"{file}: invalid JSON ({e})") from None
        self.args = model_args(self.config, str(file))
        pooling = _sentence_pooling(self.path)
        if pooling is not None:  # an embedding model's (gguf_meta.POOLING_TYPES' names)
            self.config["pooling"] = pooling
        self.files = _safetensors_files(self.path)
        self.headers = {f: read_header(f) for f in self.files}  # (header, data start)
        entries = {
            k: v for h, _ in self.headers.values() for k, v in h.items() if k != "__metadata__"
        }
        self._check_counts({k: v["shape"] for k, v in entries.items()})
        self.quantization = _most_common(Counter(v["dtype"] for v in entries.values()), "?")
        self.file_bytes = sum(f.stat().st_size for f in self.files)
        self.check_shapes()


# sentence-transformers' pooling modes -> how an embedding is pooled (runtime/embedding.py)
_POOLING_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
}


def _sentence_pooling(path: Path) -> str | None:
    """How a sentence-transformers model directory pools (1_Pooling/config.json), if it
    says; an unreadable file says nothing."""
    try:
        modes = json.loads((path / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(modes, dict):
        return None
    return next((name for mode, name in _POOLING_MODES.items() if modes.get(mode) is True), None)


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


class CheckpointFile(ModelFile):
    """Our checkpoint (checkpoint.py), from its header (checkpoint_header.py)."""

    format = "infer"

    def __init__(self, header: CheckpointHeader):
        self.path = header.path
        self.config = header.config
        self.args = header.args
        self.quantization = header.quantization
        self.file_bytes = header.file.stat().st_size
        self._check_counts({k: v["shape"] for k, v in header.entries.items()})
