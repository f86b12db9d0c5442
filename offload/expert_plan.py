"""What an expert-offloaded model costs and how a memory budget is spent on it.

A MoE checkpoint in our format stores each expert of each layer as one unit,
"layers.N.mlp.experts.E", read in one aligned read. A budget pays for, in this order:

    dense parts        globals, attention, norms, routers, shared experts, KV cache:
                       resident, or layer-streamed as offload/stream.py streams a dense
                       model when even they do not fit (routers and norms then stay
                       resident); the routers' int8 copies that the predictions read
                       (routing.guess_router), counted with the globals
    reads in flight    top_k + workers + 1 expert buffers: a visit's k experts read side
                       by side, the prefetch reads running, one read on demand
    the cache          every byte left, in whole experts: slots = left // expert bytes,
                       split over MoE layers by `allocate` (uniform or shallow-favouring)

Below dense (streamed at the minimum) plus the reads in flight the budget is refused,
naming that minimum.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .. import InferError
from ..runtime.files.checkpoint import Checkpoint
from .budget import Overheads, Plan, format_size, minimum_bytes, plan_memory
from .expert_cache import allocate
from .reader import round_up
from .stream import converted_bytes, layer_costs, overheads

DEFAULT_SCHEME = "shallow"  # the best with prefetch on the trained MoE (benchmarks/README.md)
DEFAULT_WORKERS = 4  # expert reads in flight: a virtio/NVMe disk wants several
# Tensors of a streamed dense layer that stay resident: the predictions read them.
ALWAYS_RESIDENT = (".mlp.gate.weight", ".post_attention_layernorm.weight")

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
    dense: Plan  # offload/budget.py's plan of the dense units, within what the experts leave
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


def guess_router_bytes(n_layers: int, n_experts: int, dim: int) -> int:
    """Memory of the routers' int8 copies (routing.guess_router) of n_layers MoE layers."""
    return n_layers * n_experts * (dim + 4)  # int8 rows, a float32 scale each


def budget_inputs(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    max_seq_len: int,
    process: int,
    kv_cache: str | None = None,
):
    """(overheads, dense layer costs, expert costs, router bytes): what plan_experts
    weighs for `ckpt` at `max_seq_len` tokens (a KV cache of `kv_cache`'s format),
    `process` bytes already in use."""
    args = ckpt.args
    fixed = overheads(ckpt, args, dtype, max_seq_len, process, kv_cache)
    costs = expert_costs(ckpt, dtype)
    copies = guess_router_bytes(costs.n_layers, args.n_experts, args.dim)
    fixed = dataclasses.replace(fixed, globals=fixed.globals + copies)
    dense_costs = layer_costs(ckpt, [[f"layers.{i}"] for i in range(args.n_layers)], dtype)
    return fixed, dense_costs, costs, _router_bytes(ckpt, dtype)


def _router_bytes(ckpt: Checkpoint, dtype: torch.dtype) -> int:
    """Bytes of the tensors a streamed dense layer keeps resident (routers, norms)."""
    n = 0
    for name, t in ckpt.tensors.items():
        if name.endswith(ALWAYS_RESIDENT):
            n += round_up(t.nbytes) + (t.numel() * dtype.itemsize if t.dtype != dtype else 0)
    return n
