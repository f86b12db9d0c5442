"""Our checkpoint's header (the format: checkpoint.py): config.json, and the safetensors
header of model.safetensors with our __metadata__, read as JSON and checked, with the
standard library alone (no torch), so `infer info` describes a checkpoint without
importing it. checkpoint.py maps the tensors over the same read.
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ... import InferError
from ..model.config import ModelArgs, check_rope_freq_factors
from ..model.families import model_args
from .safetensors_header import DTYPE_SIZES, FLOAT_DTYPES, read_header

FORMAT = "infer"
FORMAT_VERSION = "1"
WEIGHTS = "model.safetensors"
ALIGN = 4096  # every unit starts on a page boundary: one aligned read per unit
PAD = "__pad__."
GLOBALS = "globals"
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 GGUF rope factors (see Transformer.sanitize)

# "layers.N", or a future MoE expert "layers.N.<...>.experts.E", followed by a dot.
_UNIT_RE = re.compile(r"layers\.\d+(?:\.\w+)*?\.experts\.\d+(?=\.)|layers\.\d+(?=\.)")
_FLOAT_CODES = {"F64": "d", "F32": "f", "F16": "e"}


def unit_of(name: str) -> str:
    """The unit (name prefix) tensor `name` is stored in."""
    m = _UNIT_RE.match(name)
    return m.group(0) if m else GLOBALS


@dataclass
class CheckpointHeader:
    """An opened checkpoint's metadata: every tensor's entry, none of its data."""

    path: Path  # the directory
    file: Path  # its model.safetensors
    config: dict
    quant: dict[str, dict]  # module -> {"format": name, **params}
    ranges: dict[str, tuple[int, int]]  # unit -> absolute byte range [begin, end)
    crc32: dict[str, int]  # unit -> crc32 of its range
    source: dict
    units: dict[str, list[str]]  # unit -> its tensor names in file order
    # name -> {"dtype", "shape", "data_offsets"} (padding left out); offsets from data_start
    entries: dict[str, dict]
    data_start: int

    @property
    def args(self) -> ModelArgs:
        args = model_args(self.config, str(self.path / "config.json"))
        if ROPE_FREQS in self.entries:
            args.rope_freq_factors = self._floats(ROPE_FREQS)
            check_rope_freq_factors(args.rope_freq_factors, args.head_dim, str(self.file))
        return args

    @property
    def quantization(self) -> str:
        """The weight format: "int4", "mixed: int4, int8" (most used first), or the float
        dtype ("BF16") when nothing is quantized."""
        formats = Counter(entry["format"] for entry in self.quant.values())
        if not formats:
            matrices = (e["dtype"] for e in self.entries.values() if len(e["shape"]) == 2)
            dtypes = Counter(matrices)
            return dtypes.most_common(1)[0][0] if dtypes else "?"
        names = [name for name, _ in formats.most_common()]
        return names[0] if len(names) == 1 else "mixed: " + ", ".join(names)

    def _floats(self, name: str) -> list[float]:
        """The values of a small float tensor (rope factors), read from the file."""
        entry = self.entries[name]
        dtype, (begin, end) = entry["dtype"], entry["data_offsets"]
        if dtype not in FLOAT_DTYPES:
            raise InferError(f"{self.file}: {name!r} is {dtype}, not a float type")
        with open(self.file, "rb") as f:
            f.seek(self.data_start + begin)
            raw = f.read(end - begin)
        n = len(raw) // DTYPE_SIZES[dtype]
        if dtype == "BF16":  # the high half of a float32
            raw = b"".join(b"\0\0" + raw[i : i + 2] for i in range(0, len(raw), 2))
            dtype = "F32"
        return list(struct.unpack(f"<{n}{_FLOAT_CODES[dtype]}", raw))


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is our format: config.json + model.safetensors marked format=infer."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        return False
    try:
        header, _ = read_header(path / WEIGHTS)
    except InferError:
        return False
    metadata = header.get("__metadata__")
    return isinstance(metadata, dict) and metadata.get("format") == FORMAT


def read_checkpoint_header(path: Path) -> CheckpointHeader:
    """Open a checkpoint's metadata, checked: its config, quantized modules, units and
    their ranges; no tensor is mapped."""
    path = Path(path)
    file = path / WEIGHTS
    if not (path / "config.json").is_file() or not file.is_file():
        raise InferError(f"{path}: not an infer checkpoint (needs config.json and {WEIGHTS})")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InferError(f"{path / 'config.json'}: invalid JSON ({e})") from None
    header, data_start = read_header(file)
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise InferError(f"{file}: no infer metadata (not written by `infer quantize`)")
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise InferError(
            f"{file}: format version {version!r}; this infer reads version {FORMAT_VERSION}"
        )
    quant, ranges, crc32, source = (
        _metadata_json(metadata, key, file) for key in ("quant", "ranges", "crc32", "source")
    )
    size = file.stat().st_size
    try:
        ranges = {u: (int(b), int(e)) for u, (b, e) in ranges.items()}
        crc32 = {u: int(crc32[u], 16) for u in ranges}
        formats = {name: entry["format"] for name, entry in quant.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InferError(f"{file}: corrupt infer metadata") from None
    for unit, (b, e) in ranges.items():
        if not 0 <= b <= e <= size:
            raise InferError(
                f"{file}: unit '{unit}' [{b}, {e}) lies outside the file ({size} bytes): truncated?"
            )
        if b % ALIGN:
            raise InferError(f"{file}: unit '{unit}' does not start on a {ALIGN}-byte boundary")
    for name, fmt in formats.items():
        if not isinstance(fmt, str):  # checkpoint.py checks the names against the formats
            raise InferError(f"{file}: module '{name}' has unknown quantization format '{fmt}'")
    units = _check_units(file, header, data_start, ranges)
    entries = {k: v for k, v in header.items() if k != "__metadata__" and not k.startswith(PAD)}
    return CheckpointHeader(
        path, file, config, quant, ranges, crc32, source, units, entries, data_start
    )


def _metadata_json(metadata: dict, key: str, file: Path) -> dict:
    try:
        value = json.loads(metadata[key])
    except (KeyError, TypeError, json.JSONDecodeError, RecursionError):
        raise InferError(f"{file}: missing or corrupt infer metadata '{key}'") from None
    if not isinstance(value, dict):
        raise InferError(f"{file}: corrupt infer metadata '{key}'")
    return value


def _check_units(file: Path, header: dict, data_start: int, ranges: dict) -> dict[str, list[str]]:
    """Check each unit's tensors tile its range exactly; return unit -> names in file order."""
    spans: dict[str, list] = {u: [] for u in ranges}
    for name, entry in header.items():
        if name == "__metadata__" or name.startswith(PAD):
            continue
        unit = unit_of(name)
        if unit not in spans:
            raise InferError(f"{file}: tensor '{name}' belongs to no unit ('{unit}' has no range)")
        try:
            b, e = (data_start + int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InferError(f"{file}: corrupt entry for tensor '{name}'") from None
        spans[unit].append((b, e, name))
    units = {}
    for unit, (begin, end) in ranges.items():
        pos = begin
        for b, e, name in sorted(spans[unit]):
            if b != pos:
                raise InferError(f"{file}: unit '{unit}' is not contiguous at tensor '{name}'")
            pos = e
        if pos != end:
            raise InferError(f"{file}: unit '{unit}' tensors do not fill its range")
        units[unit] = [name for _, _, name in sorted(spans[unit])]
    return units
