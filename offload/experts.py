"""A mixture-of-experts model whose experts are read from disk through an expert cache.

`load_moe_budgeted` fits a MoE checkpoint (our format: each expert of each layer one unit,
"layers.N.mlp.experts.E", one aligned read) into a memory budget; `load_expert_cached`
does the same for a cache size given in experts. The budget pays for, in this order:

    dense parts        globals, attention, norms, routers, shared experts, KV cache:
                       resident, or layer-streamed as offload/stream.py streams a dense
                       model when even they do not fit (routers and norms then stay
                       resident); the routers' int8 copies that the predictions below
                       read (`guess_router`), counted with the globals
    reads in flight    top_k + workers + 1 expert buffers: a visit's k experts read side
                       by side, the prefetch reads running, one read on demand
    the cache          every byte left, in whole experts: slots = left // expert bytes,
                       split over MoE layers by `allocate` (uniform or shallow-favouring)

Below dense (streamed at the minimum) plus the reads in flight the budget is refused,
naming that minimum. Expert buffers come from one preallocated pool (`BufferPool`,
touched at load so RSS counts it from the start), so expert memory is fixed whatever
the routing does.

Each MoE block's `run_expert(e, x)` becomes: get the expert from the ExpertCache
(offload/expert_cache.py), bind its tensors (views of its pool buffer), run it, unbind.
`bound(ids)` does the same for the fused decode step, which asks `ready(e)` to run the
experts already in memory together.
Hooks drive the cache the way `trace.visit` does, so a recorded trace replays to the
same counters:

    entering layer j     prefetch(j): layer j's router on the residual stream entering
    (before attention)   it, normed as its MoE input will be (`refine` experts; for a
                         model whose router runs before attention, as SmallThinker's, this
                         is the router's own input: an exact prediction; `router_input`)
    MoE block j          observe(j, router probabilities, averaged over the tokens)
                         start(j, the experts the tokens chose): misses read side by side,
                         ahead of queued prefetches; queued predictions for j it does not
                         use are cancelled
                         prefetch(j + 1) and prefetch(j + 2): those blocks' routers on this
                         block's input (Fate's cross-layer prediction, `width` experts per
                         token, `ahead` layers)
                         get(j, e) for the chosen experts, ascending (MoE.forward's order)

Predictions rank experts by a router's logits (`guess`), from its int8 copy; route()
keeps the float router and takes the visit's output of it for the same input. A visit's
predictions add up, from the first made for it until it ends. Caches, slots
and traces number MoE blocks 0..n-1 in model order (`layer_ids` maps them to model
layers). Reads run on `workers` threads (`ReadQueue`) that wait on the UnitReader, so
the next layers' experts are read while layer j computes; a wrong prediction costs a
read (or nothing, when cancelled before it began), never a different output: every
expert used is the one the router chose. prefetch=False is naive on-demand loading
(each expert read when MoE.forward asks for it, one at a time). Cancellation depends on
timing, so a replay equals the live run's counters only with cancel=False.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import queue
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .. import InferError
from ..kernels_cpu import ops as kernel_ops
from ..quant.formats.int8 import Int8Linear
from ..runtime.files.build import build
from ..runtime.files.checkpoint import Checkpoint, unit_views
from ..runtime.files.sources import CheckpointSource
from ..runtime.model.llama import RMSNorm, Transformer
from ..runtime.model.moe import MoE
from .budget import Overheads, Plan, format_size, minimum_bytes, plan_memory
from .expert_cache import DEFAULT_POLICY, CacheStats, ExpertCache, allocate, make_policy
from .reader import DEFAULT_TIMEOUT_S, UnitReader, alloc_buffer, round_up
from .stream import (
    LayerStream,
    TensorSlot,
    converted_bytes,
    drop_cached,
    layer_costs,
    map_resident,
    overheads,
    placeholder_tensor,
    process_rss,
    tensor_slots,
)
from .trace import TraceRecorder

DEFAULT_SCHEME = "shallow"  # measured best with prefetch on the trained MoE (README)
DEFAULT_WORKERS = 4  # expert reads in flight: a virtio/NVMe disk wants several
# Predictions: Fate's next-layer guess (top_k), one two layers ahead, and a refinement on
# entering each layer (top_k): on the Qwen3-30B-A3B-shaped model at 25 % cached, 3.74 tok/s
# against 2.67 with the next-layer guess alone (benchmarks/README.md).
DEFAULT_AHEAD = 2
# Tensors of a streamed dense layer that stay resident: the predictions read them.
_ALWAYS_RESIDENT = (".mlp.gate.weight", ".post_attention_layernorm.weight")


# ---------------------------------------------------------------------------------------
# The checkpoint's experts
# ---------------------------------------------------------------------------------------


def moe_layers(ckpt: Checkpoint) -> list[int]:
    args = ckpt.args
    return [i for i in range(args.n_layers) if args.is_moe_layer(i)]


def expert_units(ckpt: Checkpoint) -> list[list[str]]:
    """Per MoE layer, its experts' unit names; checked to be stored one per unit."""
    layers = moe_layers(ckpt)
    if not layers:
        raise InferError(f"{ckpt.file}: not a mixture-of-experts model")
    units = [[f"layers.{i}.mlp.experts.{e}" for e in range(ckpt.args.n_experts)] for i in layers]
    missing = [u for us in units for u in us if u not in ckpt.units]
    if missing:
        raise InferError(
            f"{ckpt.file}: no unit '{missing[0]}': experts must be stored one per unit "
            "(infer quantize writes them so)"
        )
    return units


def stores_experts_apart(ckpt: Checkpoint) -> bool:
    """Whether `ckpt` is a MoE checkpoint whose experts can be cached one by one."""
    layers = moe_layers(ckpt)
    return bool(layers) and f"layers.{layers[0]}.mlp.experts.0" in ckpt.units


@dataclass(frozen=True)
class ExpertCosts:
    read_bytes: int  # one expert's read: its largest range rounded up to whole pages
    memory_bytes: int  # what one loaded expert holds: the read, plus converted copies
    n_layers: int  # MoE layers
    n_experts: int  # per MoE layer
    top_k: int

    @property
    def total(self) -> int:
        return self.n_layers * self.n_experts


def expert_costs(ckpt: Checkpoint, dtype: torch.dtype) -> ExpertCosts:
    units = expert_units(ckpt)
    flat = [u for us in units for u in us]
    read = max(round_up(e - b) for b, e in map(ckpt.ranges.get, flat))
    convert = max(converted_bytes(ckpt, [u], dtype) for u in flat)
    args = ckpt.args
    return ExpertCosts(read, read + convert, len(units), args.n_experts, args.n_experts_per_tok)


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertPlan:
    budget: int
    dense: Plan  # issue 5's plan over the dense units, within what the experts leave
    experts: ExpertCosts
    slots: tuple[int, ...]  # cache slots per MoE layer
    in_flight: int  # buffers beyond the slots: a visit's k, the reads in flight
    scheme: str
    router_bytes: int = 0  # routers and norms kept resident in streamed dense layers

    @property
    def buffers(self) -> int:
        return sum(self.slots) + self.in_flight

    @property
    def expert_memory(self) -> int:
        return self.buffers * self.experts.memory_bytes

    @property
    def footprint(self) -> int:
        """The planned peak: dense (with its own overheads) plus the expert pool."""
        return self.dense.footprint + self.router_bytes + self.expert_memory

    def describe(self) -> str:
        e = self.experts
        cached = sum(self.slots)
        dense = self.dense
        n = len(dense.pinned) + len(dense.streamed)
        dense_text = (
            f"dense parts of all {n} layers resident"
            if not dense.streamed
            else f"dense parts: {len(dense.pinned)} of {n} layers resident, "
            f"{len(dense.streamed)} streamed"
        )
        return (
            f"{cached} of {e.total} experts cached ({100 * cached / e.total:.1f} %, "
            f"{format_size(e.read_bytes)} each, {self.scheme} slots), "
            f"{self.in_flight} more buffers for reads in flight; {dense_text}; "
            f"planned {format_size(self.footprint)} of {format_size(self.budget)}"
        )


def in_flight_buffers(top_k: int, workers: int) -> int:
    """Expert buffers beyond the cache's slots: a visit's k experts that found no slot,
    one read per prefetch worker of an expert evicted while being read, one on demand."""
    return top_k + workers + 1


def minimum_budget(
    dense_costs, fixed: Overheads, experts: ExpertCosts, workers: int, router_bytes: int = 0
) -> int:
    """The smallest workable budget: dense parts (streamed at their minimum, unless all
    resident costs less) and the expert buffers in flight, no cache."""
    dense_all = fixed.total + sum(c.resident_bytes for c in dense_costs)
    dense_min = min(dense_all, minimum_bytes(dense_costs, fixed) + router_bytes)
    return dense_min + in_flight_buffers(experts.top_k, workers) * experts.memory_bytes


def plan_experts(
    dense_costs,
    fixed: Overheads,
    experts: ExpertCosts,
    budget: int,
    *,
    workers: int = DEFAULT_WORKERS,
    scheme: str = DEFAULT_SCHEME,
    router_bytes: int = 0,
) -> ExpertPlan:
    """Dense parts first (resident if they fit beside the reads in flight, else streamed),
    every byte left to expert slots."""
    in_flight = in_flight_buffers(experts.top_k, workers)
    floor = in_flight * experts.memory_bytes
    dense_all = fixed.total + sum(c.resident_bytes for c in dense_costs)
    minimum = minimum_budget(dense_costs, fixed, experts, workers, router_bytes)
    if budget < minimum:
        raise InferError(
            f"memory budget {format_size(budget)} is below this model's minimum working set "
            f"of {format_size(minimum)} ({fixed.describe()}, dense layers "
            f"{format_size(minimum - floor - fixed.total)}, {in_flight} experts in flight of "
            f"{format_size(experts.memory_bytes)}: top {experts.top_k} of a layer and "
            f"{in_flight - experts.top_k} reads); give at least --max-memory "
            f"{math.ceil(minimum / 1e6)}MB"
        )
    left = budget - floor
    if left >= dense_all:  # dense resident; the rest is cache
        n = min(experts.total, (left - dense_all) // experts.memory_bytes)
        dense = plan_memory(dense_costs, fixed, dense_all)
        router_bytes = 0
    else:  # dense parts stream: the experts get no cache, only their reads in flight
        n = 0
        dense = plan_memory(dense_costs, fixed, left - router_bytes)
        if not dense.streamed:
            router_bytes = 0
    slots = allocate(n, experts.n_layers, experts.n_experts, scheme)
    return ExpertPlan(budget, dense, experts, tuple(slots), in_flight, scheme, router_bytes)


# ---------------------------------------------------------------------------------------
# Expert buffers
# ---------------------------------------------------------------------------------------


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


@dataclass(eq=False)
class _Loaded:
    """One expert read into a pool buffer: (module's parameter or buffer dict, name,
    value) triples ready to bind. The buffer goes back to the pool when this is garbage
    (weakref.finalize)."""

    values: list[tuple[dict, str, torch.Tensor]]


def _store(tg: TensorSlot) -> dict:
    """The module dict that holds target `tg`: assigning there binds it without
    nn.Module.__setattr__ (15 ms a token on a 128-expert model: 12 assignments an expert)."""
    return tg.module._parameters if tg.is_param else tg.module._buffers


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------


@dataclass
class ExpertStats:
    """Counters of an expert-offloaded model; `a - b` is what happened between two
    snapshots."""

    layers: list[CacheStats]  # per MoE layer
    tokens: int = 0  # tokens through the model (a prompt's all count)
    passes: int = 0  # forward passes
    read_busy_s: float = 0.0  # the reader: wall time with a read in flight
    check_s: float = 0.0  # crc32 time
    dense_bytes_read: int = 0  # dense layers streamed (0 when resident)
    dense_stall_s: float = 0.0

    def __sub__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(
            [a - b for a, b in zip(self.layers, other.layers)],
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)[1:]),
        )

    def __add__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(
            [a + b for a, b in zip(self.layers, other.layers)],
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)[1:]),
        )

    @property
    def total(self) -> CacheStats:
        return sum(self.layers, CacheStats())

    @property
    def predicted(self) -> CacheStats:
        """The layers that had predictions (layer 0 only gets the entry refinement)."""
        return sum((s for s in self.layers if s.predicted), CacheStats())


@dataclass
class ExpertReport:
    """An expert-offloaded run's figures, for `infer bench` (table and --json)."""

    budget_bytes: int | None  # None: a cache size given in experts
    planned_bytes: int
    footprint_bytes: int  # measured: RSS + the model file's cached pages not in RSS
    policy: str
    scheme: str
    expert_bytes: int
    experts_total: int
    slots: list[int]  # per MoE layer
    buffers: int
    dense_layers_streamed: int
    read_method: str
    crc32_check: str
    phase: str  # what the counters cover: "decode", "all"
    tokens: int
    hit_rate: float
    hit_rate_per_layer: list[float]
    precision: float
    recall: float
    reads_per_token: float
    bytes_read_per_token: float
    prefetch_reads_per_token: float
    prefetch_reads_used: float  # share of prefetch reads used before eviction
    read_gb_s: float
    stall_s: float
    stall_s_per_token: float
    dense_bytes_read_per_token: float


# ---------------------------------------------------------------------------------------
# The hooks and the cache
# ---------------------------------------------------------------------------------------


class ExpertOffload:
    """The hooks and the cache serving one model's experts; `close()` stops the reader
    and the read threads (the model cannot run afterwards)."""

    def __init__(
        self,
        model: Transformer,
        ckpt: Checkpoint,
        dtype: torch.dtype,
        slots: list[int],
        policy: str,
        *,
        prefetch: bool,
        width: int | None,
        refine: int,
        recorder: TraceRecorder | None,
        reader: UnitReader,
        ahead: int = 1,
        placeholders: dict[str, torch.Tensor],
        workers: int,
        cancel: bool = True,
        plan: ExpertPlan | None = None,
        stream: LayerStream | None = None,
    ):
        args = ckpt.args
        self.layer_ids = moe_layers(ckpt)
        self.blocks = [model.layers[i].mlp for i in self.layer_ids]
        self.units = expert_units(ckpt)
        self.targets = [
            [tensor_slots(model, ckpt, [u], placeholders) for u in us] for us in self.units
        ]
        for per_layer in self.targets:
            for targets in per_layer:
                for tg in targets:
                    tg.set(tg.unbound)
        # (dict, name, meta value) per expert: what unbinding puts back
        self._unbound = [
            [[(_store(tg), tg.attr, getattr(tg.module, tg.attr)) for tg in tgs] for tgs in layer]
            for layer in self.targets
        ]
        self.ckpt, self.dtype, self.reader = ckpt, dtype, reader
        self.costs = expert_costs(ckpt, dtype)
        self.expert_bytes = self.costs.read_bytes
        self.policy = policy
        self.prefetch, self.recorder = prefetch, recorder
        self.width = args.n_experts_per_tok if width is None else width
        if ahead not in (1, 2):
            raise InferError(f"ahead {ahead}: predict 1 or 2 layers ahead")
        self.ahead = ahead
        self.refine = refine if prefetch else 0
        self.plan, self.stream = plan, stream
        k = args.n_experts_per_tok
        self.pool = BufferPool(sum(slots) + in_flight_buffers(k, workers), self.costs.read_bytes)
        self._threads = ReadQueue(workers)
        self.cache = ExpertCache(
            self._load,
            slots,
            make_policy(policy),
            self.expert_bytes,
            submit=self._threads.submit,
            urgent=self._threads.urgent,
            unslotted=k if prefetch else 0,
            cancel=cancel,
        )
        self._tokens = self._passes = 0
        self._refined: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._memo = None  # (layer, input, probs): a visit's router output, for route()
        # the routers' int8 copies that predictions use (route() keeps the float ones)
        predicts = self.width or self.refine
        self._guessers = [guess_router(b) if predicts else None for b in self.blocks]
        self._handles = [model.register_forward_pre_hook(self._count)]
        for j, block in enumerate(self.blocks):
            block.run_expert = functools.partial(self._run, j, block)
            block.bound = functools.partial(self._bound, j, block)
            block.ready = functools.partial(self.cache.ready, j)
            block.probs = functools.partial(self._probs, j, block)
            block.resident_experts = False
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._visit, j)))
            if self.refine:
                layer = model.layers[self.layer_ids[j]]
                self._handles.append(
                    layer.register_forward_pre_hook(functools.partial(self._enter, j))
                )
        self._finalizer = weakref.finalize(self, _shutdown, self._threads, reader, stream)

    # -- reads -------------------------------------------------------------------------

    def _load(self, j: int, e: int) -> _Loaded:
        unit = self.units[j][e]
        buf = self.pool.take()
        try:
            self.reader.read(unit, buf)
        except BaseException:
            self.pool.give(buf)
            raise
        b, end = self.ckpt.ranges[unit]
        views = unit_views(self.ckpt, unit, torch.frombuffer(buf, dtype=torch.uint8)[: end - b])
        values = []
        for tg in self.targets[j][e]:
            t = views[tg.name]
            t = t if t.dtype == tg.dtype else t.to(tg.dtype)
            values.append((_store(tg), tg.attr, nn.Parameter(t, False) if tg.is_param else t))
        loaded = _Loaded(values)
        weakref.finalize(loaded, self.pool.give, buf)
        return loaded

    def _run(self, j: int, block, e: int, x: torch.Tensor) -> torch.Tensor:
        with self._bound(j, block, [e]) as (expert,):
            return expert(x)

    @contextlib.contextmanager
    def _bound(self, j: int, block, ids: list[int]):
        """MoE.bound: experts `ids` got from the cache in that order and bound while the
        context lasts (run_expert and the fused decode step bind one at a time, in
        MoE.forward's order; up to a visit's k at once fit the pool's in-flight share)."""
        loaded = []
        try:
            for e in ids:
                loaded.append(self.cache.get(j, e))
                for store, name, value in loaded[-1].values:
                    store[name] = value
            yield [block.experts[e] for e in ids]
        finally:
            for e in ids[: len(loaded)]:
                for store, name, value in self._unbound[j][e]:
                    store[name] = value

    # -- hooks -------------------------------------------------------------------------

    def _count(self, module, args) -> None:
        if self.reader.closed:
            raise InferError("this model's expert reader was closed; load the model again")
        self._tokens += args[0].shape[1]
        self._passes += 1

    @staticmethod
    def router_input(layer, x: torch.Tensor) -> torch.Tensor:
        """What a layer's router will see, guessed from the residual stream `x` entering
        the layer: the layer's MoE-input norm of it (attention's update is not known
        yet), up to a positive factor per token, which does not change the router's
        ranking: an RMSNorm's weight times x, without its 1 / rms. A model whose router
        runs before attention would return its router's own input here, and the
        prediction would be exact."""
        norm = layer.post_attention_layernorm
        return x * norm.weight if isinstance(norm, RMSNorm) else norm(x)

    @torch.no_grad()
    def _enter(self, j: int, layer, args) -> None:
        self._memo = None
        x = args[0].reshape(-1, args[0].shape[-1])  # (N, dim): the residual entering
        ids = self._guess(j, self.router_input(layer, x), self.refine)
        self.cache.prefetch(j, ids.flatten().tolist(), refine=True)
        self._refined[j] = ids

    def _guess(self, j: int, x: torch.Tensor, k: int) -> torch.Tensor:
        """guess() for MoE layer j, by its router's int8 copy where it has one."""
        router = self._guessers[j]
        if router is None:
            return guess(self.blocks[j], x, k)
        return router(x.reshape(-1, x.shape[-1]).float()).topk(k, dim=-1).indices

    def _probs(self, j: int, block, x: torch.Tensor) -> torch.Tensor:
        """MoE.probs, taking what this layer's visit computed from the same input
        instead of running the router twice: the route() that follows the visit's hook
        (the fused step's, or MoE.forward's on a reshaped view), with nothing run between
        them that could write to that memory (the version counter cannot tell: inference
        tensors have none). A layer's entry forgets it."""
        memo = self._memo
        if (memo is not None and memo[0] == j and memo[1].data_ptr() == x.data_ptr()
                and memo[1].numel() == x.numel()):  # fmt: skip
            self._memo = None
            return memo[2]
        return MoE.probs(block, x)

    @torch.no_grad()
    def _visit(self, j: int, block, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])  # (N, dim): the MoE block's input
        probs = MoE.probs(block, x)  # (N, E)
        self._memo = (j, x, probs)  # for the route() that follows
        self.cache.observe(j, probs.mean(0).numpy())
        ids = probs.topk(block.top_k, dim=-1).indices  # what route(x) chooses
        if self.prefetch:
            self.cache.start(j, ids.flatten().tolist())
        preds = [None, None]  # (N, width) for layers j + 1 and j + 2
        for d in range(1, self.ahead + 1):
            if j + d < len(self.blocks) and self.width:
                preds[d - 1] = self._guess(j + d, x, self.width)
                if self.prefetch:
                    self.cache.prefetch(j + d, preds[d - 1].flatten().tolist(), refine=True)
        if self.recorder is not None:
            ids, weights = block.route(x)
            pred, ahead = preds
            self.recorder.record(j, ids, weights.float(), probs, pred, self._refined[j], ahead)
        self._refined[j] = None

    # -- figures -----------------------------------------------------------------------

    def snapshot(self) -> ExpertStats:
        r = self.reader.stats
        dense_bytes = dense_stall = 0
        if self.stream is not None:
            s = self.stream.snapshot()
            dense_bytes, dense_stall = s.bytes_read, s.stall_s
        with self.cache._lock:
            layers = [dataclasses.replace(s) for s in self.cache.stats]
        return ExpertStats(
            layers, self._tokens, self._passes, r.busy_s, r.check_s, dense_bytes, dense_stall
        )

    def report(self, stats: ExpertStats | None = None, phase: str = "all") -> ExpertReport:
        from .footprint import footprint

        s = self.snapshot() if stats is None else stats
        t, p, n = s.total, s.predicted, max(s.tokens, 1)
        plan = self.plan
        busy = s.read_busy_s
        reader = self.reader
        return ExpertReport(
            budget_bytes=plan.budget if plan else None,
            planned_bytes=plan.footprint if plan else self.pool.n * self.pool.size,
            footprint_bytes=footprint(self.ckpt.file),
            policy=self.policy,
            scheme=plan.scheme if plan else "-",
            expert_bytes=self.expert_bytes,
            experts_total=self.costs.total,
            slots=list(self.cache.slots),
            buffers=self.pool.n,
            dense_layers_streamed=len(plan.dense.streamed) if plan else 0,
            read_method=reader.method,
            crc32_check="off" if reader.crc32 is None else reader.check,
            phase=phase,
            tokens=s.tokens,
            hit_rate=t.hit_rate,
            hit_rate_per_layer=[x.hit_rate for x in s.layers],
            precision=p.precision,
            recall=p.recall,
            reads_per_token=(t.misses + t.prefetched) / n,
            bytes_read_per_token=t.bytes_read / n,
            prefetch_reads_per_token=t.prefetched / n,
            prefetch_reads_used=t.prefetch_used / t.prefetched if t.prefetched else 0.0,
            read_gb_s=t.bytes_read / busy / 1e9 if busy > 0 else 0.0,
            stall_s=t.stall_s + s.dense_stall_s,
            stall_s_per_token=(t.stall_s + s.dense_stall_s) / n,
            dense_bytes_read_per_token=s.dense_bytes_read / n,
        )

    def describe(self) -> str:
        """One line for --verbose: the cache and what it cost so far."""
        r = self.report()
        per_layer = " ".join(f"{h:.2f}" for h in r.hit_rate_per_layer)
        return (
            f"{self.policy}, {sum(r.slots)} of {r.experts_total} experts cached; "
            f"hit rate {r.hit_rate:.3f} (per layer {per_layer}); prefetch precision "
            f"{r.precision:.3f}, recall {r.recall:.3f}; {r.bytes_read_per_token / 1e6:.2f} MB "
            f"read per token ({r.reads_per_token:.1f} experts) at {r.read_gb_s:.2f} GB/s "
            f"({r.read_method}); stalled {r.stall_s:.2f} s over {r.tokens} tokens"
        )

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._finalizer()


def guess(block: MoE, x: torch.Tensor, k: int) -> torch.Tensor:
    """(N, k) ids of the k experts that `block`'s router ranks first for each of the N
    tokens of x (..., dim): a prediction to prefetch by. Its logits' top k: the softmax
    that route() takes them through does not change their order."""
    return block.gate(x.reshape(-1, x.shape[-1])).topk(k, dim=-1).indices


def guess_router(block: MoE) -> Int8Linear | None:
    """An int8 copy of `block`'s router (per-channel scales) to predict with: a quarter
    of the float router's bytes, read by the C GEMV on every kernel thread, where torch
    reads the float one on one (the fused step keeps torch to one thread). A prediction
    is a guess, so the copy's rounding costs nothing but the odd swap at the k-th place.
    None without the C kernels, or for a router with a bias."""
    gate = block.gate
    if not kernel_ops.available() or gate.bias is not None:
        return None
    return Int8Linear.from_float(gate.weight.detach().float(), group_size=0, search=False)


def guess_router_bytes(n_layers: int, n_experts: int, dim: int) -> int:
    """Memory of the guess_router copies of n_layers MoE layers' routers."""
    return n_layers * n_experts * (dim + 4)  # int8 rows, a float32 scale each


def _shutdown(threads: ReadQueue, reader: UnitReader, stream) -> None:
    threads.shutdown()
    reader.close()
    if stream is not None:
        stream.close()


# ---------------------------------------------------------------------------------------
# Recording a resident model's routing
# ---------------------------------------------------------------------------------------


class RoutingRecorder:
    """Hooks that record a resident MoE model's routing into `recorder` (what `--trace`
    does when the experts are not offloaded): the same rows ExpertOffload records, with
    Fate's prediction `width` wide."""

    def __init__(self, model: Transformer, recorder: TraceRecorder, width: int | None = None):
        args = model.args
        ids = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
        if not ids:
            raise InferError("--trace needs a mixture-of-experts model")
        self.recorder = recorder
        self.blocks = [model.layers[i].mlp for i in ids]
        self.width = args.n_experts_per_tok if width is None else width
        self._handles = [
            b.register_forward_pre_hook(functools.partial(self._visit, j))
            for j, b in enumerate(self.blocks)
        ]

    @torch.no_grad()
    def _visit(self, j: int, block, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        pred = None
        if j + 1 < len(self.blocks):
            pred = guess(self.blocks[j + 1], x, self.width)
        ids, weights = block.route(x)
        self.recorder.record(j, ids, weights.float(), block.probs(x), pred)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def new_recorder(ckpt_args, meta: dict | None = None) -> TraceRecorder:
    n = sum(1 for i in range(ckpt_args.n_layers) if ckpt_args.is_moe_layer(i))
    return TraceRecorder(n, ckpt_args.n_experts, meta)


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertOptions:
    """How the experts are cached, predicted and read (load_expert_cached's and
    load_moe_budgeted's keyword arguments)."""

    policy: str = DEFAULT_POLICY  # the cache's eviction policy: lru, lfu or score
    scheme: str = DEFAULT_SCHEME  # slots over the MoE layers: uniform or shallow
    prefetch: bool = True  # False: naive on-demand reads, one at a time, nothing predicted
    # experts predicted per token for the next layer (and, with ahead=2, the one after);
    # None: top_k; 0: no cross-layer prediction
    width: int | None = None
    refine: int | None = None  # experts predicted on entering a layer (None: top_k; 0: off)
    ahead: int = DEFAULT_AHEAD  # layers predicted ahead: 1 or 2
    recorder: TraceRecorder | None = None  # records the routing (offload/trace.py)
    # crc32 of each expert's first read ("first"), of every read ("always"), or None
    check: str | None = "first"
    direct: bool = True  # O_DIRECT reads (no page cache)
    workers: int = DEFAULT_WORKERS  # expert reads in flight
    cancel: bool = True  # queued predictions that turned out wrong are not read


# Which predictions start expert reads early (`infer run --expert-prediction`): ExpertOptions
# for each. Measured (benchmarks/README.md): on the 24-layer trained MoE at 50 % cached,
# "entry" has the best precision (0.91 = recall, hit rate 0.986) and "all" the best hit
# rate (0.990, precision 0.80, recall 0.94); on the large random MoE from disk "all" is
# faster (6.1 against 5.5 tok/s): its reads start a layer or two before they are needed.
PREDICTIONS = {
    "all": {},  # the next two layers' routers on this layer's MoE input, and "entry"
    "entry": {"width": 0},  # each layer's router on the residual entering it
    "next": {"refine": 0, "ahead": 1},  # the next layer's router on this layer's MoE input
    "none": {"width": 0, "refine": 0},  # only a layer's misses, read side by side
}
DEFAULT_PREDICTION = "all"


def prediction_options(name: str | None) -> dict:
    """ExpertOptions fields of the prediction `name` (None: the default)."""
    name = name or DEFAULT_PREDICTION
    if name not in PREDICTIONS:
        raise InferError(f"unknown expert prediction {name!r} (known: {', '.join(PREDICTIONS)})")
    return PREDICTIONS[name]


def load_expert_cached(
    ckpt: Checkpoint, dtype: torch.dtype, max_seq_len: int, slots: int | list[int], **options
) -> tuple[Transformer, ExpertOffload]:
    """`ckpt`'s model with its dense parts resident and its experts served from an
    ExpertCache of `slots` experts (a total split over MoE layers by the scheme, or a
    list per MoE layer). `options`: ExpertOptions' fields."""
    return _load(ckpt, dtype, max_seq_len, None, slots, ExpertOptions(**options))


def load_moe_budgeted(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    max_seq_len: int,
    budget: int,
    *,
    process_bytes: int | None = None,
    raise_to_minimum: bool = False,
    **options,
) -> tuple[Transformer, ExpertOffload]:
    """`ckpt`'s model within `budget` bytes of process footprint (see the module doc);
    the plan is `offload.plan`. raise_to_minimum: a budget below the minimum working
    set becomes that minimum (the automatic budget of a model too large for memory).
    `options`: ExpertOptions' fields."""
    opts = ExpertOptions(**options)
    max_seq_len = min(max_seq_len, ckpt.args.max_seq_len)
    process = process_rss() if process_bytes is None else process_bytes
    fixed, dense_costs, costs, routers = budget_inputs(ckpt, dtype, max_seq_len, process)
    if raise_to_minimum:
        budget = max(budget, minimum_budget(dense_costs, fixed, costs, opts.workers, routers))
    plan = plan_experts(
        dense_costs,
        fixed,
        costs,
        budget,
        workers=opts.workers,
        scheme=opts.scheme,
        router_bytes=routers,
    )
    return _load(ckpt, dtype, max_seq_len, plan, list(plan.slots), opts)


def budget_inputs(ckpt: Checkpoint, dtype: torch.dtype, max_seq_len: int, process: int):
    """(overheads, dense layer costs, expert costs, router bytes): what plan_experts
    weighs for `ckpt` at `max_seq_len` tokens, `process` bytes already in use."""
    args = ckpt.args
    fixed = overheads(ckpt, args, dtype, max_seq_len, process)
    costs = expert_costs(ckpt, dtype)
    copies = guess_router_bytes(costs.n_layers, args.n_experts, args.dim)
    fixed = dataclasses.replace(fixed, globals=fixed.globals + copies)
    dense_costs = layer_costs(ckpt, [[f"layers.{i}"] for i in range(args.n_layers)], dtype)
    return fixed, dense_costs, costs, _router_bytes(ckpt, dtype)


def _router_bytes(ckpt: Checkpoint, dtype: torch.dtype) -> int:
    """Bytes of the tensors a streamed dense layer keeps resident (routers, norms)."""
    n = 0
    for name, t in ckpt.tensors.items():
        if name.endswith(_ALWAYS_RESIDENT):
            n += round_up(t.nbytes) + (t.numel() * dtype.itemsize if t.dtype != dtype else 0)
    return n


def _load(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    max_seq_len: int,
    plan: ExpertPlan | None,
    slots: int | list[int],
    opts: ExpertOptions,
) -> tuple[Transformer, ExpertOffload]:
    args = ckpt.args
    units = expert_units(ckpt)
    make_policy(opts.policy)  # an unknown name fails before anything is read
    if isinstance(slots, int):
        slots = allocate(slots, len(units), args.n_experts, opts.scheme)
    if len(slots) != len(units):
        raise InferError(f"{len(slots)} slot counts for {len(units)} MoE layers")
    refine = args.n_experts_per_tok if opts.refine is None else opts.refine
    for name, n in (("width", opts.width), ("refine", refine)):
        if n is not None and not 0 <= n <= args.n_experts:
            raise InferError(f"{name} {n}: must be 0 to {args.n_experts} experts")
    streamed = [int(u.split(".")[1]) for u in plan.dense.streamed] if plan else []
    flat = [u for us in units for u in us]
    dense_units = [f"layers.{i}" for i in streamed]
    names = [n for u in flat + dense_units for n in ckpt.units[u]]
    placeholders = {n: placeholder_tensor(ckpt, n, dtype) for n in names}
    # Resident units: faulted in exactly (no read-around into experts' pages) and checked.
    map_resident(ckpt, [u for u in ckpt.ranges if u not in set(flat + dense_units)])
    with_placeholders = dataclasses.replace(ckpt, tensors={**ckpt.tensors, **placeholders})
    model = build(CheckpointSource(with_placeholders), dtype, max_seq_len)
    drop_cached(ckpt, flat + dense_units)
    reader = stream = None
    try:
        reader = UnitReader(
            ckpt.file,
            ckpt.ranges,
            ckpt.crc32 if opts.check else None,
            check=opts.check or "first",
            workers=opts.workers,
            direct=opts.direct,
        )
        if streamed:
            stream = _dense_stream(model, ckpt, plan.dense, dtype, streamed, placeholders)
        offload = ExpertOffload(
            model,
            ckpt,
            dtype,
            list(slots),
            opts.policy,
            prefetch=opts.prefetch,
            width=opts.width,
            refine=refine,
            ahead=opts.ahead,
            recorder=opts.recorder,
            reader=reader,
            placeholders=placeholders,
            workers=opts.workers,
            cancel=opts.cancel,
            plan=plan,
            stream=stream,
        )
    except BaseException:
        if stream is not None:
            stream.close()
        if reader is not None:
            reader.close()
        raise
    return model, offload


def _dense_stream(model, ckpt, plan: Plan, dtype, streamed, placeholders) -> LayerStream:
    """Stream the dense units of `streamed` layers as offload/stream.py does, with their
    routers and MoE-input norms kept resident (mapped): the predictions read them while
    the layer is not bound."""
    n = ckpt.args.n_layers
    groups = [[f"layers.{i}"] for i in range(n)]
    targets = {}
    for i in streamed:
        keep = []
        for tg in tensor_slots(model, ckpt, groups[i], placeholders):
            if tg.name.endswith(_ALWAYS_RESIDENT):
                t = ckpt.tensors[tg.name]
                tg.set(t if t.dtype == tg.dtype else t.to(tg.dtype))
            else:
                tg.set(tg.unbound)
                keep.append(tg)
        targets[i] = keep
    reader = UnitReader(ckpt.file, ckpt.ranges, ckpt.crc32, workers=2)
    try:
        return LayerStream(model, ckpt, plan, groups, targets, reader)
    except BaseException:
        reader.close()
        raise
