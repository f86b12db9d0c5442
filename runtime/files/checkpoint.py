"""Our on-disk model format: what `infer quantize` writes and `infer run/bench/eval` load.

A checkpoint is a directory:

    config.json          the Hugging Face-style config the model was built from
    tokenizer.json       } Tokenizer.save_hf
    tokenizer_config.json}
    model.safetensors    every tensor, in one file the safetensors library reads too

model.safetensors, by absolute file offset:

    [0, 8)          header length N, u64 little-endian
    [8, 8 + N)      JSON header, padded with spaces so tensor data starts on a 4 KiB boundary
    units           "globals" (embed_tokens, norm, lm_head), then "layers.0", "layers.1", ...
                    Each unit's tensors lie back to back and the unit starts on a 4 KiB
                    boundary, so loading a unit is one aligned read (what offload/ streams).
                    U8 tensors "__pad__.K" fill the gaps between units: safetensors allows
                    no holes. Inside a unit tensors go by falling element size, so each is
                    aligned to its dtype with no padding.

The header's __metadata__ (str -> str; the structured values JSON-encoded):

    format          "infer"
    format_version  "1"
    quant           {module: {"format": name, **params}} for every quantized module, e.g.
                    "layers.0.mlp.up_proj": {"format": "int4", "group_size": 32, ...}
    ranges          {unit: [begin, end]}: the absolute byte range of the unit's tensors
    crc32           {unit: "8 hex digits"}: zlib crc32 of that range
    source          {"path", "sha256": {file name: hex}, "format"}: what was converted

Tensor names are our model's state-dict names (Hugging Face names less "model."):
"layers.0.input_layernorm.weight", "embed_tokens.weight"; a quantized module stores
module + "." + each suffix of `QuantLinear.tensors()` ("layers.0.mlp.up_proj.qweight")
and its bias as module + ".bias". A tied table is stored once: as "lm_head" when
quantized (the embedding wraps it), as "embed_tokens.weight" when float. A quantized
embedding that is not tied is the module "embed_tokens.table" (QuantEmbedding.table).

Units are name prefixes: a tensor belongs to the unit its name starts with (`unit_of`),
"globals" if none. A mixture-of-experts layer (runtime/model/moe.py) stores each expert as its
own unit, "layers.N.mlp.experts.E" (its gate, up and down projections), written after the
unit "layers.N" that keeps the layer's attention, norms, router and any shared expert:
one aligned read fetches one expert. Nothing else in the format changes.

Integrity: `verify` checks units against their crc32. `loader.load_model` verifies every
unit: a resident model faults in every page on its first forward pass anyway, so this
only moves the read earlier, and a flipped byte fails the load naming its unit. Streaming (offload/) should instead
check each unit as it reads it: one read, one crc32.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ... import InferError
from ...quant.formats.base import FORMATS, QuantEmbedding, QuantLinear
from ..model.llama import Transformer
from ..wheels import file_sha256
from . import hugepages
from .checkpoint_header import (
    ALIGN,
    FORMAT,
    FORMAT_VERSION,
    GLOBALS,
    PAD,
    ROPE_FREQS,
    WEIGHTS,
    CheckpointHeader,
    is_checkpoint,
    read_checkpoint_header,
    unit_of,
)
from .safetensors import DTYPES, read_safetensors

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _unit_order(unit: str) -> tuple:
    # globals first, then layers in numeric order, each layer's experts right after it.
    if unit == GLOBALS:
        return (0,)
    return (1, *(int(p) if p.isdigit() else p for p in unit.split(".")))


@dataclass
class Checkpoint(CheckpointHeader):
    """An opened checkpoint: its header (checkpoint_header.py) plus every tensor mapped
    from the file."""

    tensors: dict[str, torch.Tensor]  # name -> view of the map (padding left out)

    def is_mapped(self, t: torch.Tensor) -> bool:
        """Whether `t`'s bytes lie inside this checkpoint's file map (no copy was made)."""
        base, size = self._map
        return base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + size

    @cached_property
    def _map(self) -> tuple[int, int]:
        # read_safetensors slices every tensor out of one map of the whole file.
        storage = max(self.tensors.values(), key=lambda t: t.nbytes).untyped_storage()
        return storage.data_ptr(), storage.nbytes()


# -- writing ------------------------------------------------------------------------------


def save_checkpoint(
    model: Transformer,
    config: dict,
    tokenizer,
    dest: Path,
    *,
    source: dict,
    force: bool = False,
) -> Path:
    """Write `model` (float or with QuantLinear modules) as a checkpoint directory `dest`.

    Everything is written into ".<name>.tmp-<pid>" beside `dest`, fsynced, then renamed
    into place, so `dest` is either absent, the old checkpoint, or the complete new one.
    Such folders left beside `dest` by processes no longer alive are removed first.
    """
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        if not force:
            raise InferError(f"{dest} already exists (pass --force to replace it)")
        if not (is_checkpoint(dest) or (dest.is_dir() and not any(dest.iterdir()))):
            raise InferError(f"{dest} exists and is not an infer checkpoint; not replacing it")
    if not {"path", "sha256", "format"} <= set(source):
        raise ValueError(f"source needs path, sha256 and format, not {sorted(source)}")
    tensors, quant = _model_tensors(model)
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "quant": json.dumps(quant),
        "source": json.dumps(source),
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(dest)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run with our pid
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_hf(tmp)
        _write_safetensors(tmp / WEIGHTS, tensors, metadata)
        for f in tmp.iterdir():
            _fsync(f, os.O_RDONLY)
        _fsync(tmp, os.O_DIRECTORY)
        _replace(tmp, dest)
    except BaseException:  # KeyboardInterrupt included: leave no half-written directory
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _remove_stale_tmp(dest: Path) -> None:
    """Remove ".<name>.tmp-<pid>" folders beside `dest` whose process is gone: what a run
    killed by SIGKILL (or the OOM killer) leaves, with no chance to clean up. A live
    process's folder is kept: it may be writing it now."""
    prefix = f".{dest.name}.tmp-"
    for path in dest.parent.iterdir():
        pid = path.name.removeprefix(prefix)
        if pid == path.name or not re.fullmatch(r"[1-9][0-9]*", pid):
            continue
        if not path.is_symlink() and path.is_dir() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OverflowError:
        return False  # no such pid can exist
    return True


def describe_source(path: Path, fmt: str) -> dict:
    """The `source` record for a checkpoint converted from `path` (a file or HF directory)."""
    path = Path(path).resolve()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return {"path": str(path), "sha256": {f.name: file_sha256(f) for f in files}, "format": fmt}


def _model_tensors(model: Transformer) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """({tensor name: tensor}, quant map) of `model`, each tied table once."""
    modules = {n: m for n, m in model.named_modules(remove_duplicate=False)}
    qnames = {n for n, m in modules.items() if isinstance(m, QuantLinear)}
    stored = set(qnames)
    if isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.table is model.lm_head:
        stored.discard("embed_tokens.table")  # tied: stored as lm_head, wrapped on load
    if len({id(modules[n]) for n in stored}) != len(stored):
        raise ValueError("a QuantLinear is shared by two modules other than tied embeddings")

    tensors, quant = {}, {}
    for name in (n for n in modules if n in stored):  # in module order
        m = modules[name]
        quant[name] = {"format": m.format, **m.params}
        parts = dict(m.tensors())
        if any("." in suffix or suffix == "bias" for suffix in parts):
            raise ValueError(f"{m.format}: tensor suffixes must be dot-free and not 'bias'")
        if m.bias is not None:
            parts["bias"] = m.bias
        tensors.update((f"{name}.{suffix}", t) for suffix, t in parts.items())
    tied_float = isinstance(model.embed_tokens, nn.Embedding) and isinstance(
        model.lm_head, nn.Linear
    )
    tied_float = tied_float and model.lm_head.weight is model.embed_tokens.weight
    for key, t in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if any(owner == q or owner.startswith(q + ".") for q in qnames):
            continue  # a quantized module's buffers, taken from tensors() above
        if key == "lm_head.weight" and tied_float:
            continue  # stored once, as embed_tokens.weight
        tensors[key] = t
    if model.args.rope_freq_factors is not None:
        tensors[ROPE_FREQS] = torch.tensor(model.args.rope_freq_factors, dtype=torch.float32)
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
    return {k: v.detach() for k, v in tensors.items()}, quant


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[list, dict[str, tuple[int, int]]]:
    """File order: ([(name, tensor or pad size, begin, unit)], {unit: (begin, end)}), offsets
    relative to the start of tensor data (itself 4 KiB-aligned)."""
    by_unit: dict[str, list[str]] = {}
    for name in tensors:
        by_unit.setdefault(unit_of(name), []).append(name)
    entries, ranges, pos = [], {}, 0
    for unit in sorted(by_unit, key=_unit_order):
        if pos % ALIGN:
            pad = ALIGN - pos % ALIGN
            entries.append((f"{PAD}{len(ranges)}", pad, pos, None))
            pos += pad
        begin = pos
        # Falling element size keeps every tensor aligned to its dtype (sizes are multiples).
        for name in sorted(by_unit[unit], key=lambda n: -tensors[n].element_size()):
            entries.append((name, tensors[name], pos, unit))
            pos += tensors[name].nbytes
        ranges[unit] = (begin, pos)
    return entries, ranges


def _header(entries, ranges, crcs, metadata, data_start) -> bytes:
    header = {
        "__metadata__": {
            **metadata,
            "ranges": json.dumps(
                {u: [data_start + b, data_start + e] for u, (b, e) in ranges.items()}
            ),
            "crc32": json.dumps({u: f"{crcs.get(u, 0):08x}" for u in ranges}),
        }
    }
    for name, t, begin, _ in entries:
        if isinstance(t, int):  # padding
            header[name] = {"dtype": "U8", "shape": [t], "data_offsets": [begin, begin + t]}
        else:
            header[name] = {
                "dtype": _DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [begin, begin + t.nbytes],
            }
    return json.dumps(header, separators=(",", ":")).encode()


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    entries, ranges = _layout(tensors)
    # The header holds absolute offsets, so its length depends on where data starts:
    # grow the guess until it fits (the length only grows with it, so this stops).
    data_start = ALIGN
    while 8 + len(_header(entries, ranges, {}, metadata, data_start)) > data_start:
        data_start += ALIGN
    # crc32s are fixed-width hex: write placeholders, checksum while writing the data in
    # one pass, then rewrite the header (same length) with the real values.
    with open(path, "wb") as f:
        f.seek(data_start)
        crcs = {}
        for _, t, _, unit in entries:
            if isinstance(t, int):
                f.write(bytes(t))
                continue
            data = _raw_bytes(t)
            f.write(data)
            crcs[unit] = zlib.crc32(data, crcs.get(unit, 0))
        head = _header(entries, ranges, crcs, metadata, data_start)
        f.seek(0)
        f.write(struct.pack("<Q", data_start - 8) + head + b" " * (data_start - 8 - len(head)))
        f.flush()
        os.fsync(f.fileno())
        # The pages just written sit in the page cache in small folios, which a map cannot
        # take 2 MiB at a time; let them go, so the first load reads the file back in
        # huge ones (runtime/files/hugepages.py): one read from disk, faster decode after it.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    # Through uint8: numpy has no bfloat16. One contiguous copy at most, per tensor.
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, dest: Path) -> None:
    """Rename the complete `tmp` to `dest`; an old `dest` goes only once `tmp` is in place."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if old is not None:
            os.rename(old, dest)
        raise
    _fsync(dest.parent, os.O_DIRECTORY)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


# -- reading ------------------------------------------------------------------------------


def read_checkpoint(path: Path) -> Checkpoint:
    """Open a checkpoint: metadata checked, tensors mapped (no weight is read yet)."""
    header = read_checkpoint_header(path)
    for name, entry in header.quant.items():
        if entry["format"] not in FORMATS:
            known = ", ".join(sorted(FORMATS)) or "none"
            raise InferError(
                f"{header.file}: module '{name}' has unknown quantization format "
                f"'{entry['format']}' (this infer knows: {known})"
            )
    tensors, _ = read_safetensors(header.file, (header.entries, header.data_start))
    fields = {f.name: getattr(header, f.name) for f in dataclasses.fields(header)}
    return Checkpoint(**fields, tensors=tensors)


def unit_views(ckpt: Checkpoint, unit: str, raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: tensor} over `raw` (uint8, the bytes of `unit`'s range as read from the file):
    the unit's tensors lie back to back in file order, so each is a view, no copy."""
    views, pos = {}, 0
    for name in ckpt.units[unit]:
        t = ckpt.tensors[name]
        views[name] = raw[pos : pos + t.nbytes].view(t.dtype).view(t.shape)
        pos += t.nbytes
    return views


def verify(ckpt: Checkpoint, units: list[str] | None = None) -> None:
    """Check the crc32 of `units` (default: all); a mismatch names the corrupt unit."""
    mm = np.memmap(ckpt.file, dtype=np.uint8, mode="r")
    if units is None:  # reading it all (a resident load): into the page cache in 2 MiB folios
        hugepages.advise(mm)
    for unit in ckpt.ranges if units is None else units:
        if unit not in ckpt.ranges:
            raise InferError(f"{ckpt.file}: no unit '{unit}'")
        b, e = ckpt.ranges[unit]
        got = zlib.crc32(mm[b:e])
        if got != ckpt.crc32[unit]:
            raise InferError(
                f"{ckpt.file}: unit '{unit}' is corrupt (crc32 {got:08x}, expected "
                f"{ckpt.crc32[unit]:08x}); convert the model again"
            )
