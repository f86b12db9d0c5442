"""Expert reads: a fixed pool of expert buffers and the threads that fill them.

Expert buffers come from one preallocated pool (`BufferPool`, touched at load so RSS
counts it from the start), so expert memory is fixed whatever the routing does. Reads
run on `workers` threads (`ReadQueue`): a visit's misses ahead of queued prefetches,
and a queued prefetch can be cancelled until a thread takes it.
"""

from __future__ import annotations

import itertools
import queue
import threading

from .. import InferError
from .reader import DEFAULT_TIMEOUT_S, alloc_buffer, round_up


class BufferPool:
    """`n` page-aligned buffers of `size` bytes in one anonymous map, touched now (RSS
    counts them from the start). A loaded expert holds one until it is garbage."""

    def __init__(self, n: int, size: int, timeout: float = DEFAULT_TIMEOUT_S):
        self.size = round_up(size)
        self.n = n
        self._arena = alloc_buffer(n * self.size)
        view = memoryview(self._arena)
        self._free = [view[i * self.size : (i + 1) * self.size] for i in range(n)]
        self._cond = threading.Condition()
        self.timeout = timeout
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self.n - len(self._free)

    def take(self) -> memoryview:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, self.timeout):
                raise InferError(
                    f"all {self.n} expert buffers stayed in use for {self.timeout:.0f} s"
                )
            buf = self._free.pop()
            self.peak = max(self.peak, self.in_use)
            return buf

    def give(self, buf: memoryview) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class ReadQueue:
    """`workers` threads running reads from one queue: `urgent` ones (a visit's misses)
    before any queued `submit` (prefetches), first come first served within each. A
    queued read can be cancelled until a thread takes it (`_Task.cancel()`)."""

    def __init__(self, workers: int):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"infer-expert-{i}", daemon=True)
            for i in range(workers)
        ]
        self.closed = False
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> _Task:
        return self._put(1, fn, args)

    def urgent(self, fn, *args) -> _Task:
        return self._put(0, fn, args)

    def _put(self, priority: int, fn, args) -> _Task:
        if self.closed:
            raise InferError("the expert reader is closed")
        task = _Task(fn, args)
        self._queue.put((priority, next(self._seq), task))
        return task

    def _work(self) -> None:
        while True:
            _, _, task = self._queue.get()
            if task is None:
                return
            if task.claim():
                task.fn(*task.args)  # ExpertCache._fill: delivers its own errors

    def shutdown(self) -> None:
        """Queued reads are cancelled; reads in progress finish; the threads stop."""
        self.closed = True
        while True:
            try:
                _, _, task = self._queue.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task.cancel()
        for _ in self._threads:
            self._queue.put((2, next(self._seq), None))
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


class _Task:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self._state = "queued"
        self._lock = threading.Lock()

    def claim(self) -> bool:
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def cancel(self) -> bool:
        """True if the read will not run."""
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"
            return self._state == "cancelled"
