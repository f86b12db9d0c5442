"""Binding a checkpoint's tensors into a built model: what layer streams and expert
caches share.

`build_unbound` builds the model (the common build, runtime/files/checkpoint.py) with
placeholders in place of the tensors offload reads itself; `tensor_slots` finds where
each of them lives in the model, to bind views of a read buffer there. `map_resident`
faults in exactly the units that stay mapped; `drop_cached` drops the others' pages.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from .. import InferError
from ..runtime.files.build import build
from ..runtime.files.checkpoint import Checkpoint
from ..runtime.files.sources import CheckpointSource
from ..runtime.model.llama import Transformer

WILLNEED_CHUNK = 2 * 2**20


@dataclass
class TensorSlot:
    """Where one stored tensor lives in the model."""

    name: str
    module: nn.Module
    attr: str
    is_param: bool
    dtype: torch.dtype  # as the model holds it (the compute dtype for floats)
    unbound: torch.Tensor  # a meta tensor of the right shape: what is there when not bound

    def set(self, t: torch.Tensor) -> None:
        setattr(
            self.module, self.attr, nn.Parameter(t, requires_grad=False) if self.is_param else t
        )


def held_dtype(ckpt: Checkpoint, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype build gives stored tensor `name`: a quantized module's packed
    buffers as stored, float weights and biases in the compute dtype."""
    t = ckpt.tensors[name]
    owner, _, suffix = name.rpartition(".")
    packed = owner in ckpt.quant and suffix != "bias"
    return dtype if t.is_floating_point() and not packed else t.dtype


def placeholder_tensor(ckpt: Checkpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One element expanded to the tensor's shape, in the dtype the model will hold:
    build assigns it as it is, without reading the file."""
    shape = ckpt.tensors[name].shape
    return torch.zeros((), dtype=held_dtype(ckpt, name, dtype)).expand(shape)


def build_unbound(
    ckpt: Checkpoint, dtype: torch.dtype, max_seq_len: int, units: list[str], part=None
) -> tuple[Transformer, dict[str, torch.Tensor]]:
    """`ckpt`'s model from the common build with `units`' tensors left out, and the
    placeholders (placeholder_tensor) standing in for them: offload binds the real ones
    as it reads them, so the file's pages for them are never faulted in. `part`: only
    a pipeline stage's weights (build's)."""
    names = [n for u in units for n in ckpt.units[u]]
    placeholders = {n: placeholder_tensor(ckpt, n, dtype) for n in names}
    tensors = {**ckpt.tensors, **placeholders}
    source = CheckpointSource(dataclasses.replace(ckpt, tensors=tensors))
    return build(source, dtype, max_seq_len, part=part), placeholders


def tensor_slots(model: Transformer, ckpt: Checkpoint, units, placeholders) -> list[TensorSlot]:
    """The module attribute holding each of `units`' tensors, checked to be the very
    placeholder build was given (a format that transformed it cannot stream)."""
    targets = []
    for unit in units:
        for name in ckpt.units[unit]:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            held = module._parameters.get(attr)
            is_param = held is not None
            if held is None:
                held = module._buffers.get(attr)
            ph = placeholders[name]
            if held is None or held.data_ptr() != ph.data_ptr() or held.shape != ph.shape:
                raise InferError(
                    f"{ckpt.file}: '{name}' is transformed when the model is built, so "
                    "its layer cannot be streamed"
                )
            meta = torch.empty(ph.shape, dtype=ph.dtype, device="meta")
            targets.append(TensorSlot(name, module, attr, is_param, ph.dtype, meta))
    return targets


def map_resident(ckpt: Checkpoint, units: list[str]) -> None:
    """Fault in exactly `units`' pages of the file map and check their crc32.

    The kernel reads around a faulting page (read_ahead_kb: 8 MB here), which would pull
    streamed layers' pages into the page cache, into the footprint: the map is marked
    MADV_RANDOM (no read-around) and the resident ranges MADV_WILLNEED (read now).
    """
    storage = max(ckpt.tensors.values(), key=lambda t: t.nbytes).untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)  # the file, as mapped
    if hasattr(mmap, "MADV_RANDOM"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = storage.data_ptr()
        libc.madvise(base, storage.nbytes(), mmap.MADV_RANDOM)
        for unit in units:  # the kernel reads at most read_ahead_kb per call: 2 MiB calls
            b, e = ckpt.ranges[unit]
            for off in range(b, e, WILLNEED_CHUNK):
                libc.madvise(base + off, min(WILLNEED_CHUNK, e - off), mmap.MADV_WILLNEED)
    for unit in units:
        b, e = ckpt.ranges[unit]
        crc = zlib.crc32(whole[b:e].numpy())
        if crc != ckpt.crc32[unit]:
            raise InferError(
                f"{ckpt.file}: unit '{unit}' is corrupt (crc32 {crc:08x}, expected "
                f"{ckpt.crc32[unit]:08x}); convert the model again"
            )


def drop_cached(ckpt: Checkpoint, units: list[str]) -> None:
    """Drop pages of streamed units a previous run left in the page cache: they are not
    this process's, but they would count in a measured footprint."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(ckpt.file, os.O_RDONLY)
    try:
        for unit in units:
            b, e = ckpt.ranges[unit]
            os.posix_fadvise(fd, b, e - b, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
