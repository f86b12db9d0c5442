"""What stays resident and what streams from disk, under a memory budget.

The budget is the whole process's footprint (RSS plus the page cache it holds):

    budget >= overheads                   process before loading (torch, tokenizer),
                                          globals (embedding, norm, lm_head), KV cache
                                          and rope tables, activations
            + pinned layers               resident, as a normal load would keep them
            + slots x slot_bytes          read buffers for the streamed layers: one holds
                                          the layer computing, the others the next ones
                                          being read (TPI-LLM's sliding window)
            + convert_bytes               a bound layer's tensors in the compute dtype,
                                          where the file stores another one

Pinning a layer saves reading it every token. A slot lets the reader run one layer
further ahead, which is what keeps the disk busy while compute varies and, above all,
while the pinned layers and the output layer compute (the reader can fill only the free
slots then); a wider window beat more pinned layers (benchmarks/README.md). So the plan
takes the window first, `max_slots` buffers (or as many as fit, at least two), then pins
as many layers as fit beside them (the first k, a contiguous set). Below the minimum
working set (the fewest pins with two slots) the budget is refused, naming that minimum.

Pure standard library: the CLI parses sizes with it before torch is imported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .. import InferError

MIN_SLOTS = 2  # the computing layer and at least one being read ahead
MAX_SLOTS = 4

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in "2GB", "1.5GiB", "800MB", "2G" (G, M, K: binary, as ulimit and docker)."""
    m = _SIZE_RE.fullmatch(text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not unit:
        raise InferError(
            f"invalid size {text!r}: give a number and a unit, e.g. 2GB, 1.5GiB or 800MB"
        )
    size = int(float(m.group(1)) * unit)
    if size <= 0:
        raise InferError(f"invalid size {text!r}: must be more than 0 bytes")
    return size


def format_size(n: float) -> str:
    """1234567 -> "1.23 MB" (decimal units, as `infer list` shows sizes)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


@dataclass(frozen=True)
class LayerCost:
    unit: str  # "layers.N"
    read_bytes: int  # one read of the unit: its range rounded up to whole pages
    resident_bytes: int  # keeping it resident: its bytes, plus converted copies if any
    convert_bytes: int  # its floating tensors in the compute dtype, if that differs


@dataclass(frozen=True)
class Overheads:
    """What every plan pays, whatever streams."""

    process: int  # RSS before loading: the interpreter, torch, the tokenizer
    globals: int  # embedding, final norm, lm_head (and any conversion of them)
    kv_cache: int  # KV caches and rope tables, at the full context
    scratch: int  # activations and logits of a prefill chunk, dequantized temporaries
    runtime: int = 0  # libraries loaded and thread pools started by the first passes

    @property
    def total(self) -> int:
        return self.process + self.runtime + self.globals + self.kv_cache + self.scratch

    def describe(self) -> str:
        return (
            f"process {format_size(self.process + self.runtime)}, "
            f"globals {format_size(self.globals)}, KV cache {format_size(self.kv_cache)}, "
            f"activations {format_size(self.scratch)}"
        )


@dataclass(frozen=True)
class Plan:
    budget: int
    overheads: Overheads
    pinned: tuple[str, ...]  # resident layers, in order
    streamed: tuple[str, ...]  # read every forward pass, in order
    slots: int  # read buffers (0 when nothing streams)
    slot_bytes: int  # each buffer: the largest streamed read
    convert_bytes: int  # one bound layer's converted tensors (0 if none need it)
    pinned_bytes: int
    streamed_bytes: int  # bytes read per forward pass (per decoded token)

    @property
    def window(self) -> int:
        """Layers read ahead while one computes."""
        return max(self.slots - 1, 0)

    @property
    def footprint(self) -> int:
        """The planned peak: everything above, at the full context."""
        buffers = self.slots * self.slot_bytes + self.convert_bytes
        return self.overheads.total + self.pinned_bytes + buffers

    def describe(self) -> str:
        n = len(self.pinned) + len(self.streamed)
        if not self.streamed:
            return f"all {n} layers resident (planned {format_size(self.footprint)})"
        return (
            f"{len(self.pinned)} of {n} layers resident, {len(self.streamed)} streamed "
            f"({format_size(self.streamed_bytes)} per token, window {self.window}), "
            f"planned {format_size(self.footprint)} of {format_size(self.budget)}"
        )


def _need(layers: Sequence[LayerCost], k: int, slots: int, overheads: Overheads):
    """(footprint, slot_bytes, convert_bytes) with the first k layers pinned."""
    streamed = layers[k:]
    slot = max((c.read_bytes for c in streamed), default=0)
    convert = max((c.convert_bytes for c in streamed), default=0)
    pinned = sum(c.resident_bytes for c in layers[:k])
    return overheads.total + pinned + slots * slot + convert, slot, convert


def minimum_bytes(layers: Sequence[LayerCost], overheads: Overheads) -> int:
    """The smallest workable budget: usually every layer streamed through two buffers
    (pinning an unusually large first layer can cost less than buffers its size)."""
    n = len(layers)
    return min(_need(layers, k, min(MIN_SLOTS, n - k), overheads)[0] for k in range(n + 1))


def plan_memory(
    layers: Sequence[LayerCost],
    overheads: Overheads,
    budget: int,
    max_slots: int = MAX_SLOTS,
) -> Plan:
    """The most read buffers that fit (up to `max_slots`), then the most pinned layers
    (a prefix) beside them; everything if it all fits."""
    n = len(layers)
    for want in range(max(max_slots, MIN_SLOTS), MIN_SLOTS - 1, -1):
        for k in range(n, -1, -1):  # the most pins that fit with this window
            slots = min(want, n - k)
            need, slot, convert = _need(layers, k, slots, overheads)
            if need > budget:
                continue
            return Plan(
                budget=budget,
                overheads=overheads,
                pinned=tuple(c.unit for c in layers[:k]),
                streamed=tuple(c.unit for c in layers[k:]),
                slots=slots,
                slot_bytes=slot,
                convert_bytes=convert,
                pinned_bytes=sum(c.resident_bytes for c in layers[:k]),
                streamed_bytes=sum(c.read_bytes for c in layers[k:]),
            )
    minimum = minimum_bytes(layers, overheads)
    raise InferError(
        f"memory budget {format_size(budget)} is below this model's minimum working set "
        f"of {format_size(minimum)} ({overheads.describe()}, layers "
        f"{format_size(minimum - overheads.total)} streamed through {MIN_SLOTS} buffers); "
        f"give at least --max-memory {math.ceil(minimum / 1e6)}MB"
    )
