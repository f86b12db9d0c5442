"""The machine's memory read bandwidth: the ceiling that decode speed is held against.

Decode reads every weight once per token, so no runtime can decode faster than

    ceiling tok/s = read bandwidth / weight bytes per token.

The bandwidth is measured by streaming reads of a buffer far larger than the last-level
cache (1 GiB by default; LLCs here are tens of MB), with the thread count the model runs
with. Several streaming reads are tried and the fastest honest one is kept: each touches
every byte of the buffer once and does almost no arithmetic per byte.

  - torch.sum over float32: torch's vectorized reduction, split over its threads;
  - numpy.sum over float32, one chunk per thread (numpy drops the GIL inside a ufunc
    reduction, so threads overlap);
  - torch.mv of a (rows, 1024) float32 matrix by a vector: the decode matmul itself,
    through the BLAS torch was built with.

Each figure is the best of `repeats` passes after one untimed pass (page faults,
frequency ramp): on a shared machine the best is the least disturbed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_BUFFER_BYTES = 1 << 30
_COLS = 1024  # torch.mv's matrix: rows of 4 KiB, long contiguous streams like a weight's


@dataclass
class Bandwidth:
    bytes_per_s: float  # the best method's figure
    method: str
    threads: int
    buffer_bytes: int
    by_method: dict[str, float]  # bytes/s of each method

    @property
    def gb_s(self) -> float:
        return self.bytes_per_s / 1e9


def _best_seconds(fn, repeats: int) -> float:
    fn()  # untimed: first touch, caches, thread pool start-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _methods(buf: torch.Tensor, threads: int) -> tuple[dict, ThreadPoolExecutor | None]:
    """{name: a callable that reads all of `buf` (1-D float32) once}, and the thread pool
    numpy's method runs on (None for one thread), for the caller to shut down."""
    arr = buf.numpy()
    chunks = np.array_split(arr, threads)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def numpy_sum():
        if pool is None:
            return float(arr.sum())
        return sum(pool.map(np.sum, chunks))

    mat = buf.view(-1, _COLS)
    vec = torch.ones(_COLS)
    return {
        "torch.sum": lambda: buf.sum(),
        "numpy.sum": numpy_sum,
        "torch.mv": lambda: torch.mv(mat, vec),
    }, pool


def read_bandwidth(
    threads: int | None = None, nbytes: int | None = None, repeats: int = 5
) -> Bandwidth:
    """Best streaming read bandwidth with `threads` threads (default: torch's count)
    over a buffer of `nbytes` (default: DEFAULT_BUFFER_BYTES)."""
    threads = threads or torch.get_num_threads()
    nbytes = nbytes or DEFAULT_BUFFER_BYTES
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Written once, so the pages are real; a whole number of torch.mv rows.
        buf = torch.ones(max(1, nbytes // (4 * _COLS)) * _COLS, dtype=torch.float32)
        methods, pool = _methods(buf, threads)
        try:
            by_method = {
                name: buf.nbytes / _best_seconds(fn, repeats) for name, fn in methods.items()
            }
        finally:
            if pool is not None:
                pool.shutdown()
    finally:
        torch.set_num_threads(previous)
    method = max(by_method, key=by_method.get)
    return Bandwidth(by_method[method], method, threads, buf.nbytes, by_method)
