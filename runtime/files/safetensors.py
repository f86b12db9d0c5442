"""Read safetensors files as tensors over one memory map: zero copies, no pickles. The
header is safetensors_header.py's, checked there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .safetensors_header import read_header

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


def read_safetensors(
    path: Path, header: tuple[dict, int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map `path` and return ({name: tensor}, __metadata__). Tensors share the map.
    `header`: what read_header gave for the file, when it has been read already (only
    its tensors are mapped)."""
    path = Path(path)
    header, start = header or read_header(path)
    metadata = header.get("__metadata__") or {}
    size = path.stat().st_size
    # Copy-on-write map: writable, so torch accepts it, yet the file is never written.
    mm = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c")) if size else None
    tensors = {}
    for name, info in header.items():  # checked by read_header
        if name == "__metadata__":
            continue
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        begin, end = info["data_offsets"]
        raw = mm[start + begin : start + end] if end > begin else torch.empty(0, dtype=torch.uint8)
        if (start + begin) % dtype.itemsize:
            raw = raw.clone()  # misaligned in the file: the only case that copies
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors, metadata
