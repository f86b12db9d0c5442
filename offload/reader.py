"""A background reader: whole units of a checkpoint file into caller-owned buffers.

A request is (unit, buffer); the answer is a `Ticket` to wait on. Units are the
checkpoint's contiguous, page-aligned byte ranges (runtime/files/checkpoint.py), so one unit is
one read: "layers.N" for the layer stream, "layers.N.mlp.experts.E" for an expert cache.

Reads bypass the page cache, so the process's footprint is what it allocates: O_DIRECT
where the filesystem allows it (offsets, lengths and buffers page-aligned: `alloc_buffer`),
else pread followed by posix_fadvise(DONTNEED) on the range. The file's identity (inode,
size, mtime) is checked before and after every read, so a model replaced, truncated,
rewritten or deleted under a running stream fails with a clear error instead of feeding
the model other bytes. Each unit's crc32 is checked the first time it is read (a byte
flipped at rest, a bad copy); checking every read as well ("always") costs a core's
worth of crc32 at disk speed, a large share of decode time on a machine with few cores
(benchmarks/README.md, "Offloading").

Two worker threads by default: while one checks a unit's crc32 the other is already
reading, so checking costs no disk time. Errors reach the waiter as InferError; waits
time out rather than hang; threads are daemons and `close()` stops them.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from .. import InferError

PAGE = 4096  # the checkpoint aligns units to this; O_DIRECT needs no more on Linux
DEFAULT_TIMEOUT_S = 120.0


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def alloc_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of `nbytes` rounded up to a page, every page
    touched now so that RSS counts it from the start (an honest budget)."""
    buf = mmap.mmap(-1, round_up(max(nbytes, 1)))
    for off in range(0, len(buf), PAGE):
        buf[off] = 0
    return buf


@dataclass
class ReadStats:
    reads: int = 0
    bytes: int = 0
    busy_s: float = 0.0  # wall time with at least one read in flight (crc32 excluded)
    check_s: float = 0.0  # crc32 time, summed over workers

    @property
    def gb_s(self) -> float:
        """Achieved disk read bandwidth while reading."""
        return self.bytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0


class Ticket:
    """One requested read; `wait()` returns when the unit is in its buffer, or raises."""

    def __init__(self, reader: UnitReader, unit: str, buf):
        self.unit = unit
        self.buf = buf
        self.error: InferError | None = None
        self.cancelled = False
        self._reader = reader
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Skip the read if no worker has started it (one in progress completes)."""
        self.cancelled = True

    def wait(self, timeout: float | None = None) -> None:
        reader = self._reader
        timeout = reader.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # Short slices: a dead reader or a closed one is noticed, and Ctrl-C gets through.
        while not self._done.wait(0.1):
            if reader.closed:
                raise InferError(f"{reader.file}: the reader was closed before '{self.unit}'")
            if not reader.alive():
                raise InferError(f"{reader.file}: the reader thread stopped unexpectedly")
            if time.monotonic() > deadline:
                raise InferError(
                    f"{reader.file}: reading '{self.unit}' took more than {timeout:.0f} s"
                )
        if self.error is not None:
            raise self.error


class UnitReader:
    """Reads units of `file` (absolute byte `ranges`) into page-aligned buffers."""

    def __init__(
        self,
        file: Path,
        ranges: dict[str, tuple[int, int]],
        crc32: dict[str, int] | None = None,
        *,
        check: str = "first",
        workers: int = 2,
        direct: bool = True,
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self.file = Path(file)
        self.ranges = ranges
        if check not in ("first", "always"):
            raise ValueError(f"check must be 'first' or 'always', not {check!r}")
        self.crc32 = crc32  # None: reads are not checked
        self.check = check  # "first": a unit's first read only; "always": every read
        self._checked: set[str] = set()  # units whose crc32 matched once
        self.timeout = timeout
        self.stats = ReadStats()
        self.closed = False
        self._lock = threading.Lock()
        self._active = 0
        self._busy_since = 0.0
        try:
            st = os.stat(self.file)
        except OSError as e:
            raise InferError(f"{self.file}: cannot open for streaming ({e.strerror})") from None
        self._identity = _identity(st)
        self.fd, self.method = self._open(direct)
        self._queue: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"infer-reader-{i}", daemon=True)
            for i in range(max(workers, 1))
        ]
        for t in self._threads:
            t.start()

    # -- the caller's side -----------------------------------------------------------

    def submit(self, unit: str, buf) -> Ticket:
        """Queue a read of `unit` into `buf` (page-aligned, at least the unit's range
        rounded up to a page); the buffer is the reader's until the ticket is done."""
        if self.closed:
            raise InferError(f"{self.file}: the reader is closed")
        if unit not in self.ranges:
            raise InferError(f"{self.file}: no unit '{unit}'")
        b, e = self.ranges[unit]
        if len(memoryview(buf)) < round_up(e - b):
            raise ValueError(f"buffer of {len(memoryview(buf))} bytes for '{unit}' ({e - b})")
        ticket = Ticket(self, unit, buf)
        self._queue.put(ticket)
        return ticket

    def read(self, unit: str, buf) -> None:
        """Read `unit` into `buf` now (on a worker) and wait for it."""
        self.submit(unit, buf).wait()

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Stop the workers (a read in progress finishes first) and close the file."""
        if self.closed:
            return
        self.closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self.timeout)
        os.close(self.fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the workers' side -----------------------------------------------------------

    def _open(self, direct: bool) -> tuple[int, str]:
        """(fd, method): O_DIRECT if requested and the filesystem takes it (probed with
        one aligned read), else buffered reads whose pages are dropped after use."""
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.file, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                pass  # e.g. tmpfs: EINVAL
            else:
                probe = alloc_buffer(PAGE)
                try:
                    os.preadv(fd, [probe], 0)
                    return fd, "O_DIRECT"
                except OSError:
                    os.close(fd)
                finally:
                    probe.close()
        fd = os.open(self.file, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            return fd, "pread+DONTNEED"
        return fd, "pread"  # macOS: no fadvise; pages stay in the page cache

    def _work(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            if self.closed:
                ticket.error = InferError(f"{self.file}: the reader was closed")
            elif not ticket.cancelled:
                try:
                    self._read(ticket.unit, ticket.buf)
                except InferError as e:
                    ticket.error = e
                except Exception as e:  # noqa: BLE001  (delivered to the waiter, one line)
                    ticket.error = InferError(
                        f"{self.file}: reading '{ticket.unit}' failed: {type(e).__name__}: {e}"
                    )
            ticket._done.set()

    def _read(self, unit: str, buf) -> None:
        begin, end = self.ranges[unit]
        n = end - begin
        length = round_up(n)  # O_DIRECT: whole pages; past the end of the file reads short
        view = memoryview(buf)
        self._check_file(unit)
        got = 0
        self._busy(+1)
        try:
            while got < n:
                k = os.preadv(self.fd, [view[got:length]], begin + got)
                if k == 0:
                    break
                got += k
        except OSError as e:
            raise InferError(f"{self.file}: reading '{unit}' failed: {e.strerror}") from None
        finally:
            self._busy(-1, got)
        if self.method == "pread+DONTNEED":
            os.posix_fadvise(self.fd, begin, length, os.POSIX_FADV_DONTNEED)
        if got < n:
            raise InferError(
                f"{self.file}: read {got} of {n} bytes of '{unit}': the file was truncated"
            )
        self._check_file(unit)
        if self.crc32 is not None and (self.check == "always" or unit not in self._checked):
            t0 = time.perf_counter()
            crc = zlib.crc32(view[:n])
            with self._lock:
                self.stats.check_s += time.perf_counter() - t0
            if crc != self.crc32[unit]:
                raise InferError(
                    f"{self.file}: unit '{unit}' is corrupt (crc32 {crc:08x}, expected "
                    f"{self.crc32[unit]:08x}); convert the model again"
                )
            self._checked.add(unit)

    def _check_file(self, unit: str) -> None:
        try:
            st = os.stat(self.file)
        except FileNotFoundError:
            raise InferError(
                f"{self.file}: the model file vanished while streaming ('{unit}' not read)"
            ) from None
        if _identity(st) != self._identity:
            raise InferError(
                f"{self.file}: the model file changed while streaming (inode, size or "
                f"modification time differ from when it was opened); load it again"
            )

    def _busy(self, step: int, nbytes: int = 0) -> None:
        """A read starts (+1) or ends (-1); busy time grows while any is in flight."""
        with self._lock:
            now = time.perf_counter()
            if self._active:
                self.stats.busy_s += now - self._busy_since
            self._busy_since = now
            self._active += step
            if step < 0:
                self.stats.reads += 1
                self.stats.bytes += nbytes


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
