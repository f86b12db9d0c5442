"""An expert cache serving a MoE model's experts from disk: the provider its blocks call.

`ExpertStore` reads experts (each one unit of the checkpoint, one aligned read into a
buffer of its pool) through an ExpertCache (offload/expert_cache.py) and gives each MoE
block a `CachedExperts` provider: binding an expert's tensors to views of its buffer
while it runs. The cache is driven the way `trace.visit` drives it, so a recorded trace
replays to the same counters:

    entering layer j     prefetch(j): layer j's router on the residual stream entering
    (a pre-hook)         it, normed as its MoE input will be (`refine` experts;
                         routing.router_input)
    MoE block j routed   observe(j, router probabilities, averaged over the tokens)
    (provider.routed)    start(j, the experts the tokens chose): misses read side by side,
                         ahead of queued prefetches; queued predictions for j it does not
                         use are cancelled
                         prefetch(j + 1) and prefetch(j + 2): those blocks' routers on this
                         block's input (`width` experts per token, `ahead` layers)
    its experts run      get(j, e) for the chosen experts, ascending (MoE.forward's order)

Predictions use the routers' int8 copies (routing.guess_router). A visit's predictions
add up, from the first made for it until it ends. Caches, slots and traces number MoE
blocks 0..n-1 in model order (`layer_ids` maps them to model layers). Reads run on
`workers` threads (expert_io.ReadQueue), so the next layers' experts are read while
layer j computes; a wrong prediction costs a read (or nothing, when cancelled before it
began), never a different output. prefetch=False is naive on-demand loading.
Cancellation depends on timing, so a replay equals the live run's counters only with
cancel=False.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .. import InferError
from ..runtime.files.checkpoint import Checkpoint, unit_views
from ..runtime.model.llama import Transformer
from .binding import TensorSlot, tensor_slots
from .expert_cache import ExpertCache, make_policy
from .expert_io import BufferPool, ReadQueue
from .expert_plan import ExpertPlan, expert_costs, expert_units, in_flight_buffers, moe_layers
from .expert_stats import ExpertReport, ExpertStats
from .reader import UnitReader
from .routing import guess, guess_router, router_input
from .stream import LayerStream
from .trace import TraceRecorder

# ---------------------------------------------------------------------------------------
# The provider of one MoE block
# ---------------------------------------------------------------------------------------


class CachedExperts:
    """MoE block j's experts (runtime/model/moe.py `Experts`), got from the store's cache
    and bound to their buffers while they run."""

    resident = False

    def __init__(self, store: ExpertStore, j: int, modules: nn.ModuleList, unbound: list):
        self.store, self.j, self.modules = store, j, modules
        self.cache = store.cache
        self._unbound = unbound  # per expert, (dict, name, meta value): what unbinding puts back

    def routed(self, x, probs, ids, weights) -> None:
        self.store.visit(self.j, x, probs, ids, weights)

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        with self.bound([e]) as (expert,):
            return expert(x)

    @contextlib.contextmanager
    def bound(self, ids: list[int]):
        """Experts `ids` got from the cache in that order and bound while the context
        lasts (MoE.forward and the fused decode step bind one at a time, in order; up to
        a visit's k at once fit the pool's in-flight share)."""
        loaded = []
        try:
            for e in ids:
                loaded.append(self.cache.get(self.j, e))
                for store, name, value in loaded[-1].values:
                    store[name] = value
            yield [self.modules[e] for e in ids]
        finally:
            for e in ids[: len(loaded)]:
                for store, name, value in self._unbound[e]:
                    store[name] = value

    def ready(self, e: int) -> bool:
        return self.cache.ready(self.j, e)


@dataclass(eq=False)
class _Loaded:
    """One expert read into a pool buffer: (module's parameter or buffer dict, name,
    value) triples ready to bind. The buffer goes back to the pool when this is garbage
    (weakref.finalize)."""

    values: list[tuple[dict, str, torch.Tensor]]


def _store(tg: TensorSlot) -> dict:
    """The module dict that holds target `tg`: assigning there binds it without
    nn.Module.__setattr__ (a dozen assignments an expert, on every use)."""
    return tg.module._parameters if tg.is_param else tg.module._buffers


# ---------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------


class ExpertStore:
    """One model's experts served from disk through one ExpertCache: gives each MoE
    block a CachedExperts provider and drives the cache's predictions. `close()` stops
    the reader and the read threads (the model cannot run afterwards)."""

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
        # the routers' int8 copies that predictions use (route() keeps the float ones)
        predicts = self.width or self.refine
        self._guessers = [guess_router(b) if predicts else None for b in self.blocks]
        self._handles = [model.register_forward_pre_hook(self._count)]
        for j, block in enumerate(self.blocks):
            block.provider = CachedExperts(self, j, block.experts, self._unbound[j])
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

    # -- hooks and predictions ---------------------------------------------------------

    def _count(self, module, args) -> None:
        if self.reader.closed:
            raise InferError("this model's expert reader was closed; load the model again")
        self._tokens += args[0].shape[1]
        self._passes += 1

    @torch.no_grad()
    def _enter(self, j: int, layer, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])  # (N, dim): the residual entering
        ids = self._guess(j, router_input(layer, x), self.refine)
        self.cache.prefetch(j, ids.flatten().tolist(), refine=True)
        self._refined[j] = ids

    def _guess(self, j: int, x: torch.Tensor, k: int) -> torch.Tensor:
        """guess() for MoE layer j, by its router's int8 copy where it has one."""
        router = self._guessers[j]
        if router is None:
            return guess(self.blocks[j], x, k)
        return router(x.reshape(-1, x.shape[-1]).float()).topk(k, dim=-1).indices

    @torch.no_grad()
    def visit(self, j: int, x, probs, ids, weights) -> None:
        """MoE block j routed the tokens x (N, dim) to `ids` (N, k): tell the cache,
        start reading the misses, predict the next layers, record."""
        self.cache.observe(j, probs.mean(0).numpy())
        if self.prefetch:
            self.cache.start(j, ids.flatten().tolist())
        preds = [None, None]  # (N, width) for layers j + 1 and j + 2
        for d in range(1, self.ahead + 1):
            if j + d < len(self.blocks) and self.width:
                preds[d - 1] = self._guess(j + d, x, self.width)
                if self.prefetch:
                    self.cache.prefetch(j + d, preds[d - 1].flatten().tolist(), refine=True)
        if self.recorder is not None:
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


def _shutdown(threads: ReadQueue, reader: UnitReader, stream) -> None:
    threads.shutdown()
    reader.close()
    if stream is not None:
        stream.close()
