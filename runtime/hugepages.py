"""Weights that were copied at load, moved into memory backed by 2 MiB pages.

Decode reads every weight once a token. Held in 4 KiB pages, the 1B shape's 700 MB are
175,000 pages a token, each a TLB miss and a page walk. In 2 MiB pages the 1B's Q4_0 and
the default model decoded 20-25 % faster on one core of a Zen 4 host, and as fast or
faster on two (benchmarks/README.md, "Huge pages for the weights").

Weights mapped from a file need little here: on Linux 6.x the page cache of a file read
in order comes in large folios, mapped 2 MiB at a time (`advise` asks for them before the
first read). What needs it is what the loader copies into memory torch allocates: GGUF's
Q8_0 / Q4_0 / Q4_1 blocks split into codes and scales for the kernels. `rehome` moves
those into one anonymous map that asks for transparent huge pages (MADV_HUGEPAGE; the
kernel's default "madvise" mode grants them only where asked). Where the kernel has none,
nothing moves. (Float weights converted at load are left: the 1B's 4.9 GB in float32
decoded no faster, and loaded 1.7 s slower.)
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable
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


def rehome(tensors: Iterable[torch.Tensor]) -> int:
    """Move the storages of `tensors` that torch allocated (not those mapped from a file,
    nor those already moved) into one map of huge pages, in place: each tensor keeps its
    identity, shape, strides and values; only its storage changes. A view's base moves
    with it, so the old storage is freed unless a tensor not named here still holds it.
    Returns the bytes moved: 0 where huge pages are not available, or the map could not
    be made (nothing moves then)."""
    if not available():
        return 0
    # storage address -> (the storage, its offset in the map, {id: each tensor on it})
    moves: dict[int, tuple[torch.UntypedStorage, int, dict[int, torch.Tensor]]] = {}
    total = 0
    for t in tensors:
        if t is None or t.device.type != "cpu":  # absent, or on the meta device
            continue
        s = t.untyped_storage()
        if not s.resizable() or s.nbytes() == 0:  # mapped from a file, or already here
            continue
        if s.data_ptr() not in moves:
            moves[s.data_ptr()] = (s, total, {})
            total += -(-s.nbytes() // ALIGN) * ALIGN
        group = moves[s.data_ptr()][2]
        while t is not None:  # a view's base holds the storage too: it moves with it
            group[id(t)] = t
            t = t._base
    if total == 0:
        return 0
    try:
        arena = _huge_map(total)
    except OSError:  # no room for a second copy, or the kernel refused the advice
        return 0
    target = arena.untyped_storage()
    base = arena.storage_offset()  # bytes from the map's start to the first huge page
    with torch.no_grad():
        for ptr in list(moves):  # in order: the first weights (the table) first
            s, offset, group = moves.pop(ptr)  # held no longer than its copy takes
            arena[offset : offset + s.nbytes()].copy_(_bytes_of(s))
            for t in group.values():
                size = t.element_size()
                at = base + offset + t.storage_offset() * size
                t.set_(target, at // size, t.size(), t.stride())
            del s  # with its tensors moved, the old storage is freed here
    _give_back_freed_memory()
    return total


def _huge_map(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed memory (uint8) starting on a huge page, from an anonymous
    private map advised MADV_HUGEPAGE before any page of it is touched. The tensor keeps
    the map alive."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]


def _bytes_of(s: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(s)


def _give_back_freed_memory() -> None:
    """glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in its
    heap, counted in RSS; malloc_trim returns them to the system (other C libraries have
    no such call, and nothing to do here)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
