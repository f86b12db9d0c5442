"""Stream transformer layers from disk during the forward pass (TPI-LLM's sliding window).

`load_streamed` builds the model from our checkpoint (runtime/files/checkpoint.py) with
every layer's tensors left out (`build_unbound`), so the file map never faults their
pages in, and attaches the plan (budget.py) to it (`attach_stream`): the first layers
pinned, bound to the map as a normal load would, and the rest streamed: `LayerStream`
owns `slots` page-aligned read buffers and hooks on the blocks. Layer i's pre-hook waits
for its unit and binds each module's parameter or buffer to a view of the buffer; its
post-hook unbinds it (to meta tensors: a stray use fails loudly) and hands the buffer to
the reader for the layer `slots` places further on, wrapping round to the first streamed
layer for the next token. So while layer i computes, the next `slots - 1` streamed
layers are being read. llama.py is untouched: a block does not know whether it streams.

A forward pass interrupted half way (Ctrl-C, an error) leaves the window mid-cycle; the
next pass notices at the model's pre-hook, lets reads in flight finish, and restarts
the cycle at the first streamed layer.

`prefetch=False` is naive load-on-demand, the benchmark's baseline: every layer is read
when it is needed, into one buffer, and nothing is kept.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .. import InferError
from ..runtime.files.build import Part
from ..runtime.files.checkpoint import GLOBALS, Checkpoint, unit_views
from ..runtime.model.config import ModelArgs
from ..runtime.model.kvcache import cache_bytes, float_kind
from ..runtime.model.llama import Transformer
from .binding import (
    TensorSlot,
    build_unbound,
    drop_cached,
    held_dtype,
    map_resident,
    tensor_slots,
)
from .budget import LayerCost, Overheads, Plan, minimum_bytes, plan_memory
from .reader import Ticket, UnitReader, alloc_buffer, round_up

PREFILL_CHUNK = 512  # generate.prefill's chunk: the most tokens one forward sees
# RSS the process gains after the baseline besides the model: the C kernels and quant
# modules imported, torch's and the kernels' thread pools started by the first passes,
# with a margin of two.
RUNTIME_BYTES = 32 * 2**20


# ------------------------------------------------------------------------------------------
# Costs: what the planner weighs
# ------------------------------------------------------------------------------------------


def layer_units(ckpt: Checkpoint, n_layers: int) -> list[list[str]]:
    """Each layer's units: "layers.N", then its experts' units (a MoE layer), file order."""
    groups: list[list[str]] = [[] for _ in range(n_layers)]
    for unit in ckpt.ranges:
        if unit == GLOBALS:
            continue
        i = int(unit.split(".")[1])
        if i >= n_layers:
            raise InferError(f"{ckpt.file}: unit '{unit}' but the model has {n_layers} layers")
        groups[i].append(unit)
    for i, g in enumerate(groups):
        if f"layers.{i}" not in g:
            raise InferError(f"{ckpt.file}: no unit 'layers.{i}'")
    return groups


def converted_bytes(ckpt: Checkpoint, units: list[str], dtype: torch.dtype) -> int:
    """Bytes of `units`' tensors that the model holds converted to `dtype`."""
    n = 0
    for unit in units:
        for name in ckpt.units[unit]:
            held = held_dtype(ckpt, name, dtype)
            if held != ckpt.tensors[name].dtype:
                n += ckpt.tensors[name].numel() * held.itemsize
    return n


def layer_costs(
    ckpt: Checkpoint, groups: list[list[str]], dtype: torch.dtype, layers: range | None = None
) -> list[LayerCost]:
    """Each layer's costs, of `layers` (default all; groups: layer_units)."""
    costs = []
    for i in range(len(groups)) if layers is None else layers:
        units = groups[i]
        spans = [ckpt.ranges[u] for u in units]
        read = sum(round_up(e - b) for b, e in spans)
        convert = converted_bytes(ckpt, units, dtype)
        # Resident with conversion: the mapped source pages and the converted copy.
        resident = sum(e - b for b, e in spans) + convert
        costs.append(LayerCost(f"layers.{i}", read, resident, convert))
    return costs


def overheads(
    ckpt: Checkpoint,
    args: ModelArgs,
    dtype: torch.dtype,
    max_seq_len: int,
    process: int,
    kv_cache: str | None = None,
    layers: range | None = None,
) -> Overheads:
    """What every plan pays besides the layers (estimates, at the full context, with a KV
    cache of `kv_cache`'s format: default the compute dtype's). `layers`: a pipeline
    stage's blocks, which hold no embeddings, output layer or logits, and whose budget
    does not count the process (pipeline/stage.py)."""
    stage = layers is not None
    b, e = ckpt.ranges.get(GLOBALS, (0, 0))
    globals_ = (e - b) + converted_bytes(ckpt, [GLOBALS], dtype) if GLOBALS in ckpt.ranges else 0
    el = dtype.itemsize
    kind = kv_cache or float_kind(dtype)
    kv = cache_bytes(args, max_seq_len, kind)
    if stage:
        globals_, kv = 0, kv * len(layers) // args.n_layers
    rope = 2 * max_seq_len * args.head_dim * el
    T = min(max_seq_len, PREFILL_CHUNK)
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    acts = T * (6 * args.dim + 3 * args.hidden_dim + qkv) * 4  # float32 at most
    scores = args.n_heads * T * T * 4  # attention weights of a masked prefill chunk
    logits = 0 if stage else T * args.vocab_size * 4  # every position's (infer eval)
    # Formats without a kernel for this dtype dequantize a whole weight per call
    # (QuantLinear.forward's reference path): float32, then the compute dtype.
    dequant = 0
    if ckpt.quant and dtype != torch.float32:
        dequant = max(_linear_elements(ckpt, name) for name in ckpt.quant) * (4 + el)
    if kind != float_kind(dtype):  # the torch path reads a layer's cache converted
        dequant += 2 * args.n_kv_heads * max_seq_len * args.head_dim * el
    scratch = acts + scores + logits + dequant
    return Overheads(process, globals_, kv + rope, scratch, 0 if stage else RUNTIME_BYTES)


def _linear_elements(ckpt: Checkpoint, module: str) -> int:
    """out x in of a quantized module, from the config by its name."""
    args = ckpt.args
    leaf = module.rsplit(".", 1)[-1]
    dims = {
        "q_proj": args.n_heads * args.head_dim * args.dim,
        "k_proj": args.n_kv_heads * args.head_dim * args.dim,
        "v_proj": args.n_kv_heads * args.head_dim * args.dim,
        "o_proj": args.n_heads * args.head_dim * args.dim,
        "gate_proj": args.hidden_dim * args.dim,
        "up_proj": args.hidden_dim * args.dim,
        "down_proj": args.hidden_dim * args.dim,
    }
    return dims.get(leaf, args.vocab_size * args.dim)  # lm_head, embed_tokens.table


def process_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# ------------------------------------------------------------------------------------------
# Binding a layer's tensors to buffers
# ------------------------------------------------------------------------------------------


class _Binding:
    """One streamed layer's tensors, as views of one slot's buffer, ready to assign."""

    def __init__(self, targets: list[TensorSlot], views: dict[str, torch.Tensor], arena):
        self.assign: list[tuple[TensorSlot, torch.Tensor]] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dst in arena, src)
        pos = 0
        for tg in targets:
            src = views[tg.name]
            if src.dtype == tg.dtype:
                value = src
            else:  # the file's float dtype is not the compute dtype: convert on bind
                n = src.numel() * tg.dtype.itemsize
                pos = round_up(pos, 64)
                value = arena[pos : pos + n].view(tg.dtype).view(src.shape)
                self.copies.append((value, src))
                pos += n
            param = nn.Parameter(value, requires_grad=False) if tg.is_param else value
            self.assign.append((tg, param))

    def bind(self) -> None:
        for dst, src in self.copies:
            dst.copy_(src)
        for tg, value in self.assign:
            setattr(tg.module, tg.attr, value)


# ------------------------------------------------------------------------------------------
# The stream
# ------------------------------------------------------------------------------------------


@dataclass
class StreamStats:
    passes: int = 0  # forward passes (one per decoded token; prefill chunks too)
    stall_s: float = 0.0  # compute waiting for reads
    bytes_read: int = 0
    read_busy_s: float = 0.0  # wall time with a read in flight
    check_s: float = 0.0  # crc32, summed over reader threads

    @property
    def bytes_per_pass(self) -> float:
        return self.bytes_read / self.passes if self.passes else 0.0

    @property
    def read_gb_s(self) -> float:
        return self.bytes_read / self.read_busy_s / 1e9 if self.read_busy_s > 0 else 0.0


class LayerStream:
    """Hooks that stream `plan.streamed` layers of `model` through `slots` buffers."""

    def __init__(
        self,
        model: Transformer,
        ckpt: Checkpoint,
        plan: Plan,
        groups: list[list[str]],
        targets: dict[int, list[TensorSlot]],
        reader: UnitReader,
        *,
        prefetch: bool = True,
        begins: nn.Module | None = None,
    ):
        """`begins`: the module whose call begins a pass (default the model; a pipeline
        stage's first block, since a stage runs no model forward)."""
        self.plan = plan
        self.reader = reader
        self.prefetch = prefetch
        self.order = [int(u.split(".")[1]) for u in plan.streamed]  # block indices
        self.slots = [alloc_buffer(plan.slot_bytes) for _ in range(plan.slots)]
        arena = (
            torch.zeros(plan.convert_bytes + 64, dtype=torch.uint8) if plan.convert_bytes else None
        )
        # (slot, layer) -> the reads that fill the slot with the layer's units, and the
        # views that bind it
        self._reads: dict[tuple[int, int], list[tuple[str, memoryview]]] = {}
        self._bindings: dict[tuple[int, int], _Binding] = {}
        for s, buf in enumerate(self.slots):
            raw = torch.frombuffer(buf, dtype=torch.uint8)
            mv = memoryview(buf)
            for i in self.order:
                views, pos, reads = {}, 0, []
                for unit in groups[i]:
                    b, e = ckpt.ranges[unit]
                    views.update(unit_views(ckpt, unit, raw[pos : pos + e - b]))
                    reads.append((unit, mv[pos : pos + round_up(e - b)]))
                    pos += round_up(e - b)
                self._reads[s, i] = reads
                self._bindings[s, i] = _Binding(targets[i], views, arena)
        self.targets = targets
        self.stats = StreamStats()
        self._t = 0  # position in the endless cycle of streamed layers to compute next
        self._tickets: dict[int, list[Ticket]] = {}  # slot -> reads in flight
        self._bound: int | None = None
        begins = model if begins is None else begins
        self._handles = [begins.register_forward_pre_hook(self._begin_pass)]
        for i in self.order:
            block = model.layers[i]
            self._handles.append(block.register_forward_pre_hook(self._before(i)))
            self._handles.append(block.register_forward_hook(self._after(i)))
        self._finalizer = weakref.finalize(self, reader.close)

    # -- the cycle -----------------------------------------------------------------------

    def _submit(self, t: int) -> None:
        s, i = t % len(self.slots), self.order[t % len(self.order)]
        self._tickets[s] = [self.reader.submit(u, mv) for u, mv in self._reads[s, i]]

    def _begin_pass(self, module, args) -> None:
        if self.reader.closed:
            raise InferError("this model's layer stream was closed; load the model again")
        if self._bound is not None or self._t % len(self.order):
            self._resync()  # the last pass stopped half way
        if self.prefetch and not self._tickets:
            for t in range(self._t, self._t + len(self.slots)):
                self._submit(t)
        self.stats.passes += 1

    def _before(self, i: int):
        def hook(module, args) -> None:
            t = self._t
            if self.order[t % len(self.order)] != i:
                raise InferError(f"layer stream out of order: layer {i} ran, expected another")
            s = t % len(self.slots)
            if not self.prefetch:
                self._submit(t)
            t0 = time.perf_counter()
            for ticket in self._tickets[s]:
                ticket.wait()
            self.stats.stall_s += time.perf_counter() - t0
            self._bindings[s, i].bind()
            self._bound = i

        return hook

    def _after(self, i: int):
        def hook(module, args, output) -> None:
            self._unbind(i)
            s = self._t % len(self.slots)
            del self._tickets[s]
            self._t += 1
            if self.prefetch:  # this buffer now takes the layer `slots` places further on
                self._submit(self._t - 1 + len(self.slots))

        return hook

    def _unbind(self, i: int) -> None:
        for tg in self.targets[i]:
            tg.set(tg.unbound)
        self._bound = None

    def _resync(self) -> None:
        """Back to the start of the cycle: reads in flight finish (errors dropped, the
        next pass reads again), nothing stays bound."""
        if self._bound is not None:
            self._unbind(self._bound)
        for tickets in self._tickets.values():
            for ticket in tickets:
                ticket.cancel()
        for tickets in self._tickets.values():
            for ticket in tickets:
                try:
                    ticket.wait()
                except InferError:
                    pass
        self._tickets.clear()
        self._t = 0

    # -- the outside -----------------------------------------------------------------

    def snapshot(self) -> StreamStats:
        """The counters so far (reader figures included)."""
        r = self.reader.stats
        return dataclasses.replace(
            self.stats, bytes_read=r.bytes, read_busy_s=r.busy_s, check_s=r.check_s
        )

    def reset_stats(self) -> None:
        self.stats = StreamStats()
        self.reader.stats = type(self.reader.stats)()

    def close(self) -> None:
        """Stop the reader; the model cannot run afterwards (it says so)."""
        self._finalizer()


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------


def load_streamed(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    max_seq_len: int,
    budget: int,
    *,
    process_bytes: int | None = None,
    prefetch: bool = True,
    check: str | None = "first",
    direct: bool = True,
    workers: int = 2,
    raise_to_minimum: bool = False,
    kv_cache: str | None = None,
    layers: range | None = None,
) -> tuple[Transformer, LayerStream | None, Plan]:
    """Build `ckpt`'s model to run within `budget` bytes of process footprint.

    Returns (model, stream, plan); stream is None when the plan pins every layer.
    prefetch=False: naive load-on-demand (no pinned layers, one buffer, no read-ahead).
    check: the crc32 of streamed units, "first" (a unit's first read), "always" (every
    read) or None. direct: try O_DIRECT.
    raise_to_minimum: a budget below the minimum working set becomes that minimum
    (the automatic budget of a model too large for the memory available) instead of
    being refused. kv_cache: the KV cache's format the plan counts.
    layers: only these blocks, a pipeline stage's (pipeline/stage.py): the budget holds
    them and their caches, not the embeddings and the output layer.
    """
    args = ckpt.args
    max_seq_len = min(max_seq_len, args.max_seq_len)
    groups = layer_units(ckpt, args.n_layers)
    held = range(args.n_layers) if layers is None else layers
    costs = layer_costs(ckpt, groups, dtype, held)
    process = process_rss() if process_bytes is None else process_bytes
    fixed = overheads(ckpt, args, dtype, max_seq_len, process, kv_cache, layers)
    if raise_to_minimum:
        budget = max(budget, minimum_bytes(costs, fixed))
    plan = plan_memory(costs, fixed, budget)
    if not prefetch:  # naive: everything read when needed, into one buffer
        plan = dataclasses.replace(
            plan,
            pinned=(),
            streamed=tuple(c.unit for c in costs),
            slots=1,
            slot_bytes=max(c.read_bytes for c in costs),
            convert_bytes=max(c.convert_bytes for c in costs),
            pinned_bytes=0,
            streamed_bytes=sum(c.read_bytes for c in costs),
        )

    part = Part(held, ends=False) if layers is not None else None
    units = [u for i in held for u in groups[i]]
    model, placeholders = build_unbound(ckpt, dtype, max_seq_len, units, part)
    stream = attach_stream(
        model,
        ckpt,
        plan,
        placeholders,
        prefetch=prefetch,
        check=check,
        direct=direct,
        workers=workers,
        layers=layers,
    )
    return model, stream, plan


def attach_stream(
    model: Transformer,
    ckpt: Checkpoint,
    plan: Plan,
    placeholders: dict[str, torch.Tensor],
    *,
    prefetch: bool = True,
    check: str | None = "first",
    direct: bool = True,
    workers: int = 2,
    layers: range | None = None,
) -> LayerStream | None:
    """Bind `model`'s layers (built by build_unbound with `placeholders` for them) as
    `plan` says: pinned ones to the file map, the rest to a LayerStream (None when every
    layer is pinned). The keyword arguments are load_streamed's."""
    groups = layer_units(ckpt, ckpt.args.n_layers)
    held = range(len(groups)) if layers is None else layers
    targets = {i: tensor_slots(model, ckpt, groups[i], placeholders) for i in held}
    pinned = [int(u.split(".")[1]) for u in plan.pinned]
    # Resident units are read and checked now, as load_model checks a resident model;
    # streamed ones as they are read.
    ends = [GLOBALS] if layers is None else []
    map_resident(ckpt, [*ends, *(u for i in pinned for u in groups[i])])
    for i in pinned:  # mapped from the file, as a normal load keeps them
        for tg in targets[i]:
            t = ckpt.tensors[tg.name]
            tg.set(t.to(tg.dtype) if t.dtype != tg.dtype else t)
    streamed = [int(u.split(".")[1]) for u in plan.streamed]
    for i in streamed:
        for tg in targets[i]:
            tg.set(tg.unbound)
    if not streamed:
        return None
    # Streamed layers hold placeholders at rest, so a session's fused decode step (which
    # holds pointers to every layer's weights) is not planned: decode runs block by block.
    drop_cached(ckpt, [u for i in streamed for u in groups[i]])
    reader = UnitReader(
        ckpt.file,
        ckpt.ranges,
        ckpt.crc32 if check else None,
        check=check or "first",
        workers=workers,
        direct=direct,
    )
    try:
        begins = None if layers is None else model.layers[layers.start]
        return LayerStream(
            model, ckpt, plan, groups, targets, reader, prefetch=prefetch, begins=begins
        )
    except BaseException:
        reader.close()
        raise


@dataclass
class StreamReport:
    """A budgeted run's figures, for `infer bench` (table and --json)."""

    budget_bytes: int
    planned_bytes: int  # the plan's estimate of the peak
    footprint_bytes: int  # measured: RSS + the model file's cached pages not in RSS
    resident_bytes: int  # globals and pinned layers
    streamed_bytes: int  # layers read per forward pass
    layers_pinned: int
    layers_streamed: int
    window: int
    read_method: str  # "O_DIRECT", "pread+DONTNEED"
    crc32_check: str  # "first" (each unit's first read), "always", "off"
    passes: int
    bytes_read_per_token: float
    read_gb_s: float
    stall_s: float
    stall_s_per_token: float


def report(plan: Plan, stream: LayerStream | None, file) -> StreamReport:
    from .footprint import footprint

    s = stream.snapshot() if stream is not None else StreamStats()
    return StreamReport(
        budget_bytes=plan.budget,
        planned_bytes=plan.footprint,
        footprint_bytes=footprint(file),
        resident_bytes=plan.overheads.globals + plan.pinned_bytes,
        streamed_bytes=plan.streamed_bytes,
        layers_pinned=len(plan.pinned),
        layers_streamed=len(plan.streamed),
        window=plan.window,
        read_method=stream.reader.method if stream is not None else "-",
        crc32_check=_check_mode(stream),
        passes=s.passes,
        bytes_read_per_token=s.bytes_per_pass,
        read_gb_s=s.read_gb_s,
        stall_s=s.stall_s,
        stall_s_per_token=s.stall_s / s.passes if s.passes else 0.0,
    )


def _check_mode(stream: LayerStream | None) -> str:
    if stream is None or stream.reader.crc32 is None:
        return "off"
    return stream.reader.check


def describe(stream: LayerStream | None, plan: Plan) -> str:
    """One line for --verbose: the plan and what streaming cost so far."""
    line = plan.describe()
    if stream is None:
        return line
    s = stream.snapshot()
    return (
        f"{line}; read {s.bytes_read / 1e9:.2f} GB in {s.passes} passes "
        f"({s.bytes_per_pass / 1e6:.1f} MB/token) at {s.read_gb_s:.2f} GB/s "
        f"({stream.reader.method}, crc32 {_check_mode(stream)}), "
        f"stalled {s.stall_s:.2f} s"
    )
