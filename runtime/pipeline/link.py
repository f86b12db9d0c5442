"""One pass on the wire from one stage to the next: torch.distributed point to point.

gloo sends a message at once only when its receiver has already posted the matching
recv; otherwise the sender announces it and waits for the receiver's go-ahead, a round
trip (gloo/transport/tcp/pair.cc). A stage posts the recv of its next pass while it
waits, so a pass that is one message costs no round trip: the header, the spans and,
when they are small (a decode step's rows), the hidden states travel as one uint8
tensor. Larger states (a prompt's chunk) follow as a second message.

    words  int64: op, rows T, spans n, whether the states are inline
    spans  int64 (n, 3): sequence id, first position, rows; in row order
    x      (1, T, dim) in the compute dtype, inline or next

Every wait is bounded by the group's timeout; a failed or timed-out link raises
LinkError, whose message is gloo's first line without its source location.
"""

from __future__ import annotations

import datetime
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

from ... import InferError

HEADER_WORDS = 4
MAX_SPANS = 256  # sequences in one pass
INLINE_BYTES = 1 << 20  # hidden states sent in the pass's one message up to this size
CAPACITY = 8 * (HEADER_WORDS + 3 * MAX_SPANS) + INLINE_BYTES


class Op(IntEnum):
    STOP = 0  # the coordinator is done: each worker passes it on and leaves the group
    PING = 1  # round the ring while idle, so that no stage's wait times out
    CHUNK = 2  # prompts' tokens, one or several sequences': Session.forward, prefill_together
    ROWS = 3  # decode rows of several sequences: session.decode (the fused step)


class LinkError(InferError):
    """A stage died, a link dropped, or a wait timed out."""

    http_status = 503  # a server's answer: not the request's fault


@dataclass
class Pass:
    op: Op
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (sequence, pos, rows)
    x: torch.Tensor | None = None  # (1, T, dim)


@contextmanager
def failures(what: str):
    """gloo's errors as one-line LinkErrors: "<what>: <gloo's reason>"."""
    try:
        yield
    except RuntimeError as e:
        raise LinkError(f"{what}: {reason(e)}") from None


def reason(e: BaseException) -> str:
    """gloo's message, its first line without the source location and the advice."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\] ", "", text)
    return text.split(". This is typically")[0].rstrip(".")


class Sending:
    """A pass on its way; `wait` ends when the next stage has it."""

    def __init__(self, p: Pass, dst: int):
        x = p.x.contiguous() if p.x is not None else None
        inline = x is not None and x.numel() * x.element_size() <= INLINE_BYTES
        T = x.shape[1] if x is not None else 0
        words = [p.op, T, len(p.spans), int(inline)] + [w for s in p.spans for w in s]
        parts = [torch.tensor(words, dtype=torch.int64).view(torch.uint8)]
        if inline:
            parts.append(x.reshape(-1).view(torch.uint8))
        self._tensors = [torch.cat(parts)] + ([x] if x is not None and not inline else [])
        self._works = [dist.isend(t, dst) for t in self._tensors]

    def wait(self) -> None:
        for w in self._works:
            w.wait()


def buffer() -> torch.Tensor:
    """Room for a pass's one message."""
    return torch.empty(CAPACITY, dtype=torch.uint8)


class Receiving:
    """The recv of the next pass from `src`, posted at once (see the module docstring),
    into `buf` (a new buffer by default); the pass's states are a view of it."""

    def __init__(self, src: int, buf: torch.Tensor | None = None):
        self.src = src
        self._buf = buffer() if buf is None else buf
        self._work = dist.irecv(self._buf, src)

    def wait(self, dim: int, dtype: torch.dtype) -> Pass:
        self._work.wait()
        op, T, n, inline = self._buf[: 8 * HEADER_WORDS].view(torch.int64).tolist()
        end = 8 * (HEADER_WORDS + 3 * n)
        flat = self._buf[8 * HEADER_WORDS : end].view(torch.int64).tolist()
        spans = [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]
        x = None
        if op in (Op.CHUNK, Op.ROWS):
            nbytes = T * dim * dtype.itemsize
            if inline:
                x = self._buf[end : end + nbytes].view(dtype).view(1, T, dim)
            else:
                x = torch.empty(1, T, dim, dtype=dtype)
                dist.recv(x, self.src)
        return Pass(Op(op), spans, x)


# ------------------------------------------------------------------------------------------
# The process group
# ------------------------------------------------------------------------------------------


def use_interface(address: str) -> None:
    """Have gloo's data plane listen on the interface that holds `address`, not on the
    one the host name resolves to. gloo reads GLOO_SOCKET_IFNAME when a group forms;
    it is this process's setting, set once by the command that owns the process."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def host_group(address: str, world_size: int, timeout: float):
    """Rank 0's rendezvous: a TCPStore listening on `address` only (a store given just a
    port listens on every interface), and the port the others join at."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    sock.bind((address, 0))
    sock.listen(world_size)
    port = sock.getsockname()[1]
    # The store owns the socket from here (detach: Python must not close it under it).
    store = dist.TCPStore(
        address, port, world_size, is_master=True,
        timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False,
        master_listen_fd=sock.detach(), use_libuv=False,
    )  # fmt: skip
    return store, port


def join_group(rank: int, world_size: int, timeout: float, store=None, rendezvous=None):
    """Form the gloo group: rank 0 over its own store (host_group), the others over a
    client of it at `rendezvous` (address, port); every wait in the group is bounded by
    `timeout` seconds. (Both sides pass a store: init_method="tcp://" would prefix the
    others' keys and not rank 0's.)"""
    limit = datetime.timedelta(seconds=timeout)
    with failures("forming the process group"):
        if store is None:
            host, port = rendezvous
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=limit)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=limit
        )


def leave_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass  # a broken group: its connections close with it anyway
