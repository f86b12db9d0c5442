"""The process's honest memory footprint: RSS plus the model file's page cache it holds.

RSS alone undercounts a model read through the page cache (the pages are the kernel's,
not the process's, yet they exist because of it) and a map counts only pages faulted
in. So: footprint = RSS + pages of the model file in the page cache that are not
already in this process's RSS through a map of it,

    cached(file)        mincore(2) over a fresh PROT_READ map of the file (fincore)
    mapped_rss(file)    /proc/self/smaps "Rss:" of the mappings of that file

Linux only for the second term; elsewhere the footprint is RSS + cached (an
overestimate when the file is mapped).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from pathlib import Path
from typing import Self

import numpy as np
import psutil

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (as util-linux's fincore counts them)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident = int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
        finally:
            _libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return resident * mmap.PAGESIZE


def _smaps_rss(path: Path | None) -> tuple[int, int]:
    """(this process's RSS, the part of it that is `path` mapped), from one read of
    /proc/self/smaps, so the two agree even while maps come and go. Linux; elsewhere
    (psutil's RSS, 0)."""
    target = str(Path(path).resolve()) if path is not None else None
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return psutil.Process().memory_info().rss, 0
    total = mapped = 0
    inside = False
    for line in text.splitlines():
        first = line.split(maxsplit=1)[0] if line else ""
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = target is not None and line.rstrip().endswith(target)
        elif first == "Rss:":
            kb = int(line.split()[1]) * 1024
            total += kb
            mapped += kb if inside else 0
    return total, mapped


def mapped_rss(path: Path) -> int:
    """Bytes of `path` resident in this process through its maps (Linux; else 0)."""
    return _smaps_rss(path)[1]


def footprint(path: Path | None) -> int:
    """RSS plus `path`'s cached pages not already counted in RSS.

    RSS and the mapped part come from one snapshot, and the page cache is counted after
    it: a map dropped in between leaves its pages counted once (as cached), not twice."""
    rss, mapped = _smaps_rss(path)
    if path is None:
        return rss
    return rss + max(0, cached_bytes(path) - mapped)


class PeakSampler:
    """Samples `footprint(path)` every `interval` s on a thread; `.peak` is the highest."""

    def __init__(self, path: Path | None, interval: float = 0.05):
        self.path, self.interval = path, interval
        self.peak = footprint(path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infer-footprint", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, footprint(self.path))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, footprint(self.path))
