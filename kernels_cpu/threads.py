"""Who runs on the cores during a forward pass: the kernels' thread pool or torch's.

    policy = ThreadPolicy(n)          # n=None: torch.get_num_threads() when a pass starts
    with policy.forward():            # the kernels get n threads, torch's ops one
        ...
    with wide():                      # inside a pass: one large torch op on n threads

torch's OpenMP workers spin after each parallel op, and the pool's workers spin after
each job (csrc/pool.c): with as many threads as cores, a torch op between two kernel
calls leaves a worker spinning on the core the other pool needs. So while the kernels
run the matmuls, torch's ops run on the calling thread. The count in force lives in a
context variable set only by ThreadPolicy.forward, so concurrent sessions in other
threads each keep their own.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

_in_pass: ContextVar[int | None] = ContextVar("infer_kernel_threads", default=None)


def kernel_threads() -> int:
    """The kernels' thread count now: the policy's inside a pass, else torch's."""
    return _in_pass.get() or torch.get_num_threads()


class ThreadPolicy:
    """Threads for one session's forward passes. kernels=False (a model whose matmuls
    run in torch, float weights): torch keeps its threads and nothing changes."""

    def __init__(self, n: int | None = None, *, kernels: bool = True):
        if n is not None and n < 1:
            raise ValueError(f"threads must be at least 1, got {n}")
        self.n, self.kernels = n, kernels

    @contextlib.contextmanager
    def forward(self):
        """A forward pass (or a stretch of them). Nested passes keep the outer counts."""
        if not self.kernels or _in_pass.get() is not None:
            yield
            return
        saved = torch.get_num_threads()
        token = _in_pass.set(self.n or saved)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(saved)
            _in_pass.reset(token)


@contextlib.contextmanager
def wide():
    """torch's ops in the block on the kernels' thread count: inside a pass, for an op
    large enough to be worth the spinning workers it leaves (a long prompt's attention);
    elsewhere it changes nothing."""
    saved = torch.get_num_threads()
    torch.set_num_threads(kernel_threads())
    try:
        yield
    finally:
        torch.set_num_threads(saved)
