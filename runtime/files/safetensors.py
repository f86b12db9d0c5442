"""Read safetensors files as tensors over one memory map: zero copies, no pickles.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length N, N bytes of JSON {name: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}, then the raw tensor bytes. Validating the header here is how a
truncated or corrupt file becomes one clear error instead of a crash mid-load.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from ... import InferError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


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
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InferError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise InferError(f"{path}: corrupt safetensors header")
    return header, 8 + n


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map `path` and return ({name: tensor}, __metadata__). Tensors share the map."""
    path = Path(path)
    header, start = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    size = path.stat().st_size
    data_bytes = size - start
    # Copy-on-write map: writable, so torch accepts it, yet the file is never written.
    mm = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")) if size else None
    tensors = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InferError(f"{path}: corrupt entry for tensor '{name}'") from None
        if end > data_bytes:
            raise InferError(f"{path}: truncated (tensor '{name}' ends past the end of the file)")
        n_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != n_bytes or begin < 0:
            raise InferError(f"{path}: corrupt entry for tensor '{name}' (size mismatch)")
        raw = mm[start + begin : start + end] if n_bytes else torch.empty(0, dtype=torch.uint8)
        if (start + begin) % dtype.itemsize:
            raw = raw.clone()  # misaligned in the file: the only case that copies
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors, metadata
