"""A safetensors file's header, read and checked with the standard library alone (no
torch), so `infer info` reads a checkpoint's without importing it; safetensors.py maps
the tensors over it.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length N, N bytes of JSON {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the raw tensor bytes. Validating the header here is how a
truncated or corrupt file becomes one clear error instead of a crash mid-load.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ... import InferError

# dtype -> bytes per element
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_header(path: Path) -> tuple[dict, int]:
    """Return (header dict, byte offset where tensor data starts)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InferError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise InferError(f"{path}: truncated or not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise InferError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise InferError(f"{path}: corrupt safetensors header")
    _check_entries(path, header, size - 8 - n)
    return header, 8 + n


def _check_entries(path: Path, header: dict, data_bytes: int) -> None:
    """Each entry has a known dtype, a shape and byte offsets that agree, and the entries
    tile the data exactly, as the format requires (a hole means a dtype or shape was
    changed to a smaller one)."""
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InferError(f"{path}: corrupt safetensors __metadata__")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            itemsize = DTYPE_SIZES[info["dtype"]]
            shape, offsets = info["shape"], info["data_offsets"]
            ints = [*shape, *offsets]
            ok = isinstance(shape, list) and len(offsets) == 2
            ok = ok and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ints)
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise InferError(f"{path}: corrupt entry for tensor {name!r}")
        begin, end = offsets
        if end > data_bytes:
            raise InferError(f"{path}: truncated (tensor {name!r} ends past the end of the file)")
        if end - begin != math.prod(shape) * itemsize:
            raise InferError(f"{path}: corrupt entry for tensor {name!r} (size mismatch)")
        spans.append((begin, end, name))
    spans.sort()
    at = 0
    for begin, end, name in spans:
        if begin != at:
            problem = "overlaps the tensor before" if begin < at else "leaves a hole before it"
            raise InferError(f"{path}: tensor {name!r} {problem}")
        at = end
    if at != data_bytes:
        raise InferError(f"{path}: {data_bytes - at} bytes after the last tensor")
