"""The coordinator's end of a pipeline: it holds the embeddings, the output layer and
the sampler; the workers, in order, hold every block.

    pipeline = Pipeline.connect([("h1", 7070), ("h2", 7070)], token, name, path, ...)
    session = Session(model, stages=pipeline)   # the model built with no blocks
    logits = session.prefill(prompt)            # hidden states round the ring

A model's forward takes a `blocks` callable in place of its loop over blocks; `blocks`
here sends the states to the first worker and waits for the last one's. `start` sends
a pass without waiting: a server keeps as many groups of sequences on the ring as
there are stages (scheduler.py), so that every stage works while the coordinator
samples one group's tokens.

A worker that dies or a link that drops fails the pass in progress (or the idle ping)
with a LinkError, and every later pass with the same error (`failed`). A server then
forms the group again with `connect`, which leaves out workers that cannot be reached
when the others can hold every block.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ... import InferError
from ..model import kvcache
from . import handshake, link
from .link import LinkError, Op, Pass
from .stage import stage_bytes

STEP_TIMEOUT = 120.0  # seconds any wait on a stage may take (a prompt chunk's included)
STAGE_LOAD_TIMEOUT = 3600.0  # seconds a worker may take to load its blocks
CHECK_TIMEOUT = 600.0  # seconds a worker may take to find and hash its copy of the model


@dataclass
class Worker:
    host: str
    port: int
    sock: object  # the control connection, open while the group is
    memory: int = 0  # bytes it offers
    speed: float = 0.0  # GB/s of memory reads it offers (0: not said)
    layers: range = range(0)

    @property
    def name(self) -> str:
        return f"worker {self.host}:{self.port}"


def assign_layers(
    n_layers: int, memories: list[int], speeds: list[float] | None = None, layer_bytes: int = 0
) -> list[range]:
    """Contiguous layer ranges, one layer at least each: in proportion to each worker's
    speed (decode's time per layer goes as 1 / its memory bandwidth, so the stages take
    equal times), none given more than `layer_bytes`-sized layers than its memory holds;
    in proportion to memory without speeds, or when the memories cannot hold the model
    (the workers then refuse what does not fit)."""
    k = len(memories)
    if n_layers < k:
        raise InferError(f"{k} workers for a model of {n_layers} layers: give at most {n_layers}")
    caps = [m // layer_bytes if layer_bytes else n_layers for m in memories]
    if speeds and all(s > 0 for s in speeds) and sum(caps) >= n_layers:
        shares = _fill(n_layers, speeds, caps)
    else:
        shares, caps = _fill(n_layers, memories, [n_layers] * k), [n_layers] * k
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > n_layers:  # the floors of one layer at least: from the largest
        counts[max(range(k), key=lambda i: (counts[i], -i))] -= 1
    while sum(counts) < n_layers:  # then the largest remainders, within the caps
        open_ = [i for i in range(k) if counts[i] < caps[i]] or list(range(k))
        counts[max(open_, key=lambda i: (shares[i] - counts[i], -i))] += 1
    bounds = list(itertools.accumulate(counts, initial=0))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _fill(n: float, weights: list[float], caps: list[float]) -> list[float]:
    """n split in proportion to weights, none above its cap: a capped share's excess
    goes to the others in the same proportion (caps sum to n at least)."""
    shares, free, left = [0.0] * len(weights), set(range(len(weights))), float(n)
    while free:
        total = sum(weights[i] for i in free)
        part = {i: left * (weights[i] / total if total > 0 else 1 / len(free)) for i in free}
        over = [i for i in free if part[i] > caps[i]]
        if not over:
            for i in free:
                shares[i] = part[i]
            break
        for i in over:
            shares[i], left = caps[i], left - caps[i]
            free.remove(i)
    return shares


class Pipeline:
    def __init__(self, workers: list[Worker], dim: int, dtype: torch.dtype, timeout: float):
        self.workers, self.dim, self.dtype, self.timeout = workers, dim, dtype, timeout
        self._sequences = 0
        self._lock = threading.RLock()  # posting and waiting for passes (and the pings)
        self._flying: collections.deque[Flight] = collections.deque()  # started, not back
        self._failed: str | None = None
        self._used = time.monotonic()
        self._closed = threading.Event()
        self._pinger = threading.Thread(target=self._ping_while_idle, daemon=True)
        self._pinger.start()

    @classmethod
    def connect(
        cls, addresses: list[tuple[str, int]], token: bytes, model: str, path, args,
        dtype: torch.dtype, ctx: int, timeout: float = STEP_TIMEOUT, kv_cache: str | None = None,
    ) -> Pipeline:  # fmt: skip
        """Prove the token to each worker, have it check the model (`model` names it,
        `path` is this side's copy) and load its layers, then form the group. The
        workers' KV caches are of format `kv_cache` (default the dtype's float). A
        worker that cannot be reached is left out, said on stderr, while one remains:
        the others are given its layers, and refuse them if they do not fit."""
        sha = handshake.model_sha256(path)
        dtype_name = str(dtype).removeprefix("torch.")
        workers = []
        try:
            for i, (host, port) in enumerate(addresses):
                try:
                    sock = handshake.connect(host, port)
                except InferError as e:
                    if workers or i + 1 < len(addresses):
                        print(f"warning: {e}; its layers go to the others", file=sys.stderr)
                        continue
                    raise
                w = Worker(host, port, sock)
                workers.append(w)
                with _about(w):
                    handshake.prove_coordinator(w.sock, token)
                    ask = {"model": model, "sha256": sha, "dtype": dtype_name, "ctx": ctx,
                           "kv_cache": kv_cache or kvcache.float_kind(dtype)}  # fmt: skip
                    handshake.send(w.sock, ask)
                    offer = handshake.receive(w.sock, CHECK_TIMEOUT)
                    w.memory, w.speed = int(offer["memory"]), float(offer.get("speed") or 0)
            n = args.n_layers
            layer_bytes = stage_bytes(path, dtype, ctx, range(n), kv_cache) // n
            memories, speeds = [w.memory for w in workers], [w.speed for w in workers]
            ranges = assign_layers(n, memories, speeds, layer_bytes)
            world = len(workers) + 1
            for rank, (w, layers) in enumerate(zip(workers, ranges), 1):
                w.layers = layers
                plan = {"layers": [layers.start, layers.stop], "rank": rank,
                        "world_size": world, "timeout": timeout}  # fmt: skip
                with _about(w):
                    handshake.send(w.sock, plan)
            for w in workers:
                with _about(w):
                    handshake.receive(w.sock, timeout=STAGE_LOAD_TIMEOUT)
            address = workers[0].sock.getsockname()[0]  # this end of the first link
            link.use_interface(address)
            store, port = link.host_group(address, world, timeout)
            for w in workers:
                with _about(w):
                    handshake.send(w.sock, {"rendezvous": [address, port]})
            link.join_group(0, world, timeout, store=store)
        except BaseException:
            for w in workers:
                w.sock.close()
            raise
        return cls(workers, args.dim, dtype, timeout)

    def describe(self) -> str:
        return ", ".join(
            f"{w.host}:{w.port} layers {w.layers.start}-{w.layers.stop - 1}" for w in self.workers
        )

    @property
    def failed(self) -> bool:
        """A stage failed: every pass fails from now on (form the group again)."""
        return self._failed is not None

    def new_sequence(self) -> int:
        """An id for a new sequence: each worker keeps a KV cache under it."""
        self._sequences += 1
        return self._sequences

    def blocks(self, spans: list[tuple[int, int, int]], rows: bool):
        """The model's `blocks` for a pass: `spans` (sequence, pos, n) in row order; one
        sequence's chunk, or `rows` of several (llama.Rows)."""
        return lambda x, _pos: self.run(x, spans, rows)

    def run(self, x: torch.Tensor, spans: list[tuple[int, int, int]], rows: bool):
        """x (1, T, dim) after every block, each stage in turn."""
        return self.start(x, spans, rows).wait()

    def start(self, x: torch.Tensor, spans: list[tuple[int, int, int]], rows: bool) -> Flight:
        """Send x (1, T, dim) round the ring and return at once: the pass's Flight gives
        its states after every block. Passes started one after another come back in
        that order; the stages work on them at the same time, each on its own."""
        with self._lock:
            self._check()
            # A pass whose states follow its header as a second message (link.py) must
            # be the last recv posted until they are in: no other recv may match them.
            if self._flying and self._flying[-1].large:
                self._flying[-1].wait()
            flight = Flight(self, Pass(Op.ROWS if rows else Op.CHUNK, spans, x))
            self._flying.append(flight)
        return flight

    def _check(self) -> None:
        if self._failed is not None:
            raise LinkError(self._failed)
        if self._closed.is_set():
            raise InferError("the pipeline is closed")

    @contextlib.contextmanager
    def _failures(self):
        """A stage's failure as a LinkError, which fails every pass from now on."""
        try:
            with link.failures("a pipeline stage failed (a worker died or a link dropped)"):
                yield
        except LinkError as e:
            self._failed = str(e)
            raise

    def _ping_while_idle(self) -> None:
        """A ping round the ring whenever it has been idle a quarter of the timeout: a
        worker's wait for the next pass is bounded too, and a dead one is found early."""
        interval = self.timeout / 4
        while not self._closed.wait(interval / 4):
            if time.monotonic() - self._used < interval or self._failed is not None:
                continue
            with self._lock:
                if self._closed.is_set() or self._failed is not None:
                    return
                if self._flying:
                    continue
                try:
                    with link.failures("a pipeline stage failed while idle"):
                        receiving = link.Receiving(len(self.workers))
                        link.Sending(Pass(Op.PING), 1).wait()
                        receiving.wait(self.dim, self.dtype)
                except LinkError as e:
                    self._failed = str(e)
                self._used = time.monotonic()

    def close(self) -> None:
        """Tell the workers to leave the group (each then waits for its next
        coordinator), and leave it."""
        if self._closed.is_set():
            return
        with self._lock:
            self._closed.set()
            if self._failed is None:
                try:
                    with link.failures("stopping the pipeline"):
                        link.Sending(Pass(Op.STOP), 1).wait()
                except LinkError as e:
                    print(f"warning: {e}", file=sys.stderr)
            link.leave_group()
            for w in self.workers:
                w.sock.close()


class Flight:
    """A pass on the ring (Pipeline.start): `wait` gives its states after every block;
    a stage's failure fails it, and the pipeline, with a LinkError."""

    def __init__(self, pipeline: Pipeline, p: Pass):
        self.pipeline = pipeline
        self.large = p.x.numel() * p.x.element_size() > link.INLINE_BYTES
        self._out: torch.Tensor | None = None
        pipeline._used = time.monotonic()
        with pipeline._failures():
            self._receiving = link.Receiving(len(pipeline.workers))
            self._sending = link.Sending(p, 1)

    def wait(self) -> torch.Tensor:
        pipeline = self.pipeline
        with pipeline._lock:
            if self._out is None:
                pipeline._check()
                with pipeline._failures():
                    self._out = self._receiving.wait(pipeline.dim, pipeline.dtype).x
                    self._sending.wait()
                pipeline._flying.remove(self)
            pipeline._used = time.monotonic()
        return self._out


class _about:
    """Errors of the handshake with one worker, named after it: "worker h:p: ..."."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, InferError) and not str(e).startswith("worker "):
            raise type(e)(f"{self.worker.name}: {e}") from None
        if isinstance(e, OSError):
            raise InferError(f"{self.worker.name}: connection failed ({e})") from None
        return False


def load_pipelined(
    reference: str, path, workers: list[tuple[str, int]], token: bytes, dtype, ctx: int,
    timeout: float = STEP_TIMEOUT, kv_cache: str | None = None,
):  # fmt: skip
    """The coordinator's model at `path` (the embeddings, the output layer: no blocks)
    as a LoadedModel whose `stages` is the pipeline over `workers`, which find the model
    by `reference` (a name or a path) unless told its path; their caches of `kv_cache`."""
    from ..files.build import Part, build
    from ..files.sources import open_source
    from ..loader import LoadedModel

    t0 = time.perf_counter()
    source = open_source(path)
    model = build(source, dtype, ctx, part=Part(range(0), ends=True))
    tokenizer = source.tokenizer()
    ctx = model.max_seq_len
    pipeline = Pipeline.connect(
        workers, token, reference, path, source.args, dtype, ctx, timeout, kv_cache
    )
    load_s = time.perf_counter() - t0
    return LoadedModel(model, tokenizer, source, dtype, load_s, stages=pipeline)
