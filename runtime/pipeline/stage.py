"""A worker: a contiguous range of a model's blocks, and the loop that serves them.

`infer worker` listens on the address it is given, for one coordinator at a time. With
each: the handshake (handshake.py: the token, the model's sha256, its layers), then the
process group, then passes from the previous rank run through its blocks and on to the
next, until the coordinator stops or a link fails; then it waits for the next one. The
blocks loaded stay loaded for a coordinator that asks for the same ones. Blocks beyond
the worker's memory stream from its disk (offload/stream.py over the stage's layers).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import InferError
from ...kernels_cpu.threads import ThreadPolicy
from ...offload.stream import load_streamed
from ..files.build import Part, build
from ..files.hugepages import reuse_freed_heap
from ..files.sources import CheckpointSource, open_source
from ..model import kvcache
from ..model.fused_decode import FusedDecode, cache_words
from ..model.llama import KVCache, Rows, rope_rows
from . import handshake, link
from .handshake import Refused
from .link import Op, Pass

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOAD_TIMEOUT = 3600.0  # seconds a worker waits for the others to check and load the model
SPEED_PROBE_BYTES = 256 << 20  # read to measure the worker's memory bandwidth, far past LLCs


class Stage:
    """Blocks [layers.start, layers.stop) of `model` (the rest of it on the meta device)
    and each sequence's KV cache for them, made on its first pass, of format `kv_cache`
    (model/kvcache.py KINDS; the coordinator's choice). Passes run as in one process
    (session.py): a prompt's chunk on the torch blocks, rows on the fused step over these
    blocks where it runs the model."""

    def __init__(
        self, model, layers: range, dtype: torch.dtype, threads: int | None = None, stream=None
    ):
        self.model, self.layers, self.dtype = model, layers, dtype
        self.stream = stream  # offload's LayerStream of the blocks that do not fit, or None
        self.kv_cache = kvcache.float_kind(dtype)
        self.caches: dict[int, list[KVCache]] = {}
        self.words: dict[int, torch.Tensor] = {}  # each cache's fused_decode.cache_words
        self.threads = ThreadPolicy(threads, kernels=model.runs_on_kernels())
        self.fused = FusedDecode.prepare(model, layers)

    def cache(self, sequence: int) -> list[KVCache]:
        if sequence not in self.caches:
            a, n = self.model.args, self.model.max_seq_len
            self.caches[sequence] = kvcache.new_cache(
                self.kv_cache, len(self.layers), a.n_kv_heads, n, a.head_dim
            )
            if self.fused is not None:
                self.words[sequence] = cache_words(self.caches[sequence])
        return self.caches[sequence]

    def forget(self) -> None:
        """Drop every sequence's cache (a new coordinator's sequences)."""
        self.caches.clear()
        self.words.clear()

    @torch.inference_mode()
    def forward(self, p: Pass) -> torch.Tensor:
        """The blocks over a pass's states, as the model's own loop runs them: Rows of
        one or several sequences, prompts' chunks (CHUNK) or decode rows (ROWS, the
        fused step where it runs)."""
        x, T = p.x, p.x.shape[1]
        pos, caches = None, Rows([(q, n, self.cache(s)) for s, q, n in p.spans])
        if p.op is Op.ROWS and self.fused is not None:
            words = torch.stack([self.words[s] for s, _, n in p.spans for _ in range(n)])
            with self.threads.forward():
                return self.fused(x, caches, words)
        rope = {}  # a table's rows, by table (Gemma's local and global layers)
        with self.threads.forward():
            for i, layer_cache in zip(self.layers, caches):
                cos, sin, _ = self.model.layer_rope(i)
                if id(cos) not in rope:
                    rope[id(cos)] = rope_rows(cos, sin, pos, T, caches)
                x = self.model.layers[i](x, pos, *rope[id(cos)], layer_cache)
        return x


def load_stage(
    path: Path, dtype: torch.dtype, ctx: int, layers: range, threads=None,
    budget: int | None = None, kv_cache: str | None = None,
) -> Stage:  # fmt: skip
    """The blocks `layers` of the model at `path`, read from it alone. With `budget`
    (the bytes they and a sequence's KV cache of `kv_cache` may hold) the blocks that do
    not fit stream from the disk as in one process (offload/stream.py)."""
    source = open_source(path)
    stream = None
    if budget is None:
        model = build(source, dtype, ctx, part=Part(layers, ends=False))
    elif not isinstance(source, CheckpointSource):
        raise InferError(
            f"layers {layers.start}-{layers.stop - 1} do not fit this worker's "
            f"{budget / 1e9:.2f} GB, and only infer's own format streams from disk: "
            f"infer quantize {path.name} -o DIR --to int8 (or int4)"
        )
    else:
        model, stream, _ = load_streamed(
            source.checkpoint, dtype, ctx, budget, process_bytes=0, kv_cache=kv_cache, layers=layers
        )
    reuse_freed_heap(keep=budget is None)  # as load_model does
    return Stage(model, layers, dtype, threads, stream)


def stage_bytes(
    path: Path, dtype: torch.dtype, ctx: int, layers: range, kv_cache: str | None = None
) -> int:
    """An estimate of what blocks `layers` hold: their share of the weights, and one
    sequence's KV cache for them (of `kv_cache`, default the dtype's float)."""
    source = open_source(path)
    a = source.args
    kind = kv_cache or kvcache.float_kind(dtype)
    per_position = kvcache.bytes_per_position(kind, a.n_kv_heads, a.head_dim)
    return source.layers_bytes(dtype, layers) + len(layers) * ctx * per_position


# ------------------------------------------------------------------------------------------
# The worker's loop
# ------------------------------------------------------------------------------------------


@dataclass
class WorkerSettings:
    host: str
    port: int
    token: bytes
    budget: int  # bytes offered to the coordinator, and the most its blocks may hold
    model: Path | None = None  # the model file here; default: as the coordinator names it
    threads: int | None = None
    speed: float | None = None  # GB/s of memory reads offered; None: measured at start


def serve_worker(s: WorkerSettings, log: Callable[[str], None], ready=None) -> None:
    """Serve coordinators one at a time, until interrupted. `ready(port)` is called once
    listening (the port chosen, when s.port is 0)."""
    server = handshake.listen(s.host, s.port)
    if s.speed is None:
        from ..membw import read_bandwidth

        s.speed = read_bandwidth(s.threads, SPEED_PROBE_BYTES, repeats=3).bytes_per_s / 1e9
        log(f"memory read bandwidth {s.speed:.1f} GB/s")
    link.use_interface(s.host)
    port = server.getsockname()[1]
    log(f"listening on {s.host}:{port}")
    if ready is not None:
        ready(port)
    held: dict = {}  # the blocks last loaded, by what they are
    with server:
        while True:
            conn, peer = server.accept()
            with conn:
                try:
                    _serve_coordinator(conn, s, held, log)
                except InferError as e:
                    log(f"coordinator {peer[0]}:{peer[1]}: {e}")
                except OSError as e:
                    log(f"coordinator {peer[0]}:{peer[1]}: connection failed ({e})")


def _serve_coordinator(conn: socket.socket, s: WorkerSettings, held: dict, log) -> None:
    handshake.prove_worker(conn, s.token)
    try:
        stage, plan = _load(conn, s, held, log)
    except Refused:
        raise
    except InferError as e:  # told to the coordinator too, on its one line
        handshake.send(conn, {"error": str(e)})
        raise
    handshake.send(conn, {"loaded": True})
    host, port = handshake.receive(conn, timeout=LOAD_TIMEOUT)["rendezvous"]
    rank, world = int(plan["rank"]), int(plan["world_size"])
    log(f"serving rank {rank} of {world}, KV cache {stage.kv_cache}")
    link.join_group(rank, world, float(plan["timeout"]), rendezvous=(str(host), int(port)))
    try:
        passes = _run(stage, rank, world)
    finally:
        link.leave_group()
    log(f"coordinator done: {passes} passes")


def _load(conn: socket.socket, s: WorkerSettings, held: dict, log) -> tuple[Stage, dict]:
    """The model check, the offer and the plan: the blocks to serve, loaded."""
    ask = handshake.receive(conn)
    path = _model_path(s, str(ask.get("model")))
    sha = handshake.model_sha256(path)
    if sha != ask.get("sha256"):
        raise InferError(
            f"model refused: the worker's {path.name} differs from the coordinator's "
            f"(sha256 {sha[:12]}, not {str(ask.get('sha256'))[:12]})"
        )
    dtype, ctx = DTYPES[ask["dtype"]], int(ask["ctx"])
    kind = ask.get("kv_cache", kvcache.float_kind(dtype))
    if kind not in kvcache.KINDS:
        raise InferError(f"a KV cache of unknown format {str(kind)[:20]!r}")
    handshake.send(conn, {"memory": s.budget, "speed": s.speed})
    plan = handshake.receive(conn, timeout=LOAD_TIMEOUT)  # after every worker's check
    layers = range(*plan["layers"])
    # Blocks that do not fit the budget stream from this machine's disk.
    budget = s.budget if stage_bytes(path, dtype, ctx, layers, kind) > s.budget else None
    key = (path, sha, layers, dtype, ctx, budget, budget and kind)  # a stream plans its KV
    if held.get("key") != key:
        held.pop("stage", None)
        t0 = time.perf_counter()
        held["stage"] = load_stage(path, dtype, ctx, layers, s.threads, budget, kind)
        held["key"] = key
        stage = held["stage"]
        step = "the fused C step" if stage.fused is not None else "torch blocks"
        if stage.stream is not None:
            n = len(stage.stream.order)
            step += f"; {n} of {len(layers)} layers streamed from disk"
        log(f"loaded layers {layers.start}-{layers.stop - 1} of {path.name} in "
            f"{time.perf_counter() - t0:.2f} s (decode: {step})")  # fmt: skip
    stage = held["stage"]
    stage.forget()  # a new coordinator's sequences
    stage.kv_cache = kind
    return stage, plan


def _run(stage: Stage, rank: int, world: int) -> int:
    """Passes from rank - 1 through the blocks to rank + 1 (the last back to the
    coordinator), until STOP. Returns how many passes ran."""
    prev, nxt = rank - 1, (rank + 1) % world
    dim, passes = stage.model.args.dim, 0
    buffers = [link.buffer(), link.buffer()]  # one receives while the other is read
    with link.failures(f"stage {rank}"):
        receiving = link.Receiving(prev, buffers[0])
        while True:
            p = receiving.wait(dim, stage.dtype)
            if p.op is Op.STOP:
                if nxt != 0:
                    link.Sending(p, nxt).wait()
                return passes
            buffers.reverse()
            receiving = link.Receiving(prev, buffers[0])  # posted before the work: link.py
            if p.op is not Op.PING:
                p = Pass(p.op, p.spans, stage.forward(p))
                passes += 1
            link.Sending(p, nxt).wait()


def _model_path(s: WorkerSettings, name: str) -> Path:
    if s.model is not None:
        return s.model
    from ..registry import resolve

    return resolve(name, download=False).path
