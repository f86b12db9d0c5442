"""Weights that were copied at load, moved into memory backed by 2 MiB pages.

Decode reads every weight once a token. Held in 4 KiB pages, a 1B model's weights are
hundreds of thousands of pages a token, each a TLB miss and a page walk; 2 MiB pages
remove most of them.

Weights mapped from a file need little here: on Linux 6.x the page cache of a file read
in order comes in large folios, mapped 2 MiB at a time (`advise` asks for them before the
first read). What needs it is what a build copies into memory torch allocates: GGUF's
Q8_0 / Q4_0 / Q4_1 blocks split into codes and scales for the kernels. build.py writes
those straight into an `Arena`: one anonymous map that asks for transparent huge pages
(MADV_HUGEPAGE; the kernel's default "madvise" mode grants them only where asked). Where
the kernel has none, they go to torch's memory. (Float weights converted at load stay
there: large float models gain nothing from huge pages and would load slower.)

The process's heap is set here too (glibc's malloc): what loading freed is given back
(`give_back_freed_heap`), and a loaded model's freed activations kept for reuse, or not
under a memory budget (`reuse_freed_heap`).
"""

from __future__ import annotations

import ctypes
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start: a cache line, as torch's own allocator gives
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel grants transparent huge pages to a map that asks."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def mapped_bytes() -> int | None:
    """How much of this process's memory is mapped 2 MiB at a time, anonymous and file
    pages together; None where the system does not say (not Linux)."""
    fields = ("AnonHugePages:", "FilePmdMapped:", "ShmemPmdMapped:")
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith(fields))


def advise(mapped) -> None:
    """Ask for huge pages in a file's map (an np.memmap) before it is read: pages not yet
    in the page cache are then read in 2 MiB folios and mapped 2 MiB at a time. Only for
    maps read whole: a fault reads the 2 MiB around it, read-ahead or not."""
    raw = getattr(mapped, "_mmap", None)
    if raw is not None and available():
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # advice only: the map works as well without it
            pass


class Arena:
    """One map of huge pages that weights copied at load are written into, one after
    another, each at a cache line (`ALIGN`). Sized in advance (`nbytes`); a tensor that
    no longer fits is copied into torch's memory instead, as without an arena."""

    def __init__(self, nbytes: int):
        self._memory = _huge_map(nbytes)
        self._used = 0

    @classmethod
    def of(cls, nbytes: int) -> Arena | None:
        """An arena of `nbytes`; None where huge pages are not available, there is
        nothing to hold, or the map cannot be made (the weights stay in torch's memory)."""
        if nbytes <= 0 or not available():
            return None
        try:
            return cls(nbytes)
        except OSError:  # no room, or the kernel refused the advice
            return None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor in the arena, its values unset (in torch's memory once full)."""
        n = math.prod(shape) * dtype.itemsize
        if self._used + n > self._memory.numel():
            return torch.empty(shape, dtype=dtype)
        out = self._memory[self._used : self._used + n].view(dtype).view(shape)
        self._used += -(-n // ALIGN) * ALIGN
        return out

    def close(self) -> None:
        """Loading is done: glibc hands back the heap that the temporaries of the copies
        (a Q4_K's codes, a tensor held in int8) took."""
        give_back_freed_heap()


def _huge_map(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory (uint8) starting on a huge page, from an anonymous
    private map advised MADV_HUGEPAGE before any page of it is touched. The tensor keeps
    the map alive."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]


# glibc's mallopt parameters, and the values reuse_freed_heap sets: kept for reuse, or
# given back at once (glibc's initial thresholds, fixed)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_FREE_HEAP, KEPT_MMAP_THRESHOLD = 1 << 30, 32 << 20  # 32 MiB: glibc's largest
EXACT_THRESHOLD = 128 << 10
_kept = False  # whether this process keeps freed blocks (mallopt's settings are global)


def reuse_freed_heap(keep: bool) -> None:
    """Whether freed activations stay in the heap for the next layer.

    A prompt's activations (tens of MB a chunk and layer) are freed and allocated again
    layer after layer; under glibc's adaptive thresholds many go back to the system and
    return as fresh zeroed pages, gigabytes of page faults a long prompt. `keep` holds
    them (free blocks up to 1 GiB at the heap's top, blocks up to 32 MiB in the heap);
    a model loaded under a memory budget asks for the opposite, every freed block
    given back, so that its footprint stays what its plan counts. The first call with
    keep False leaves glibc's own adaptive thresholds as they are."""
    global _kept
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or (not keep and not _kept):
        return
    mallopt(M_TRIM_THRESHOLD, KEPT_FREE_HEAP if keep else EXACT_THRESHOLD)
    mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD if keep else EXACT_THRESHOLD)
    _kept = keep


def give_back_freed_heap() -> None:
    """glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in its
    heap, counted in RSS; malloc_trim returns them to the system (other C libraries have
    no such call, and nothing to do here). A few ms."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
