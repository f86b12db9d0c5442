"""A mixture-of-experts model whose experts are read from disk through an expert cache.

`load_moe_budgeted` fits a MoE checkpoint into a memory budget (offload/expert_plan.py:
what the budget pays for); `load_expert_cached` takes a cache size in experts. Both build
the model with the offloaded tensors left out (binding.build_unbound) and attach an
ExpertStore to it (`attach_experts`): its experts then come from the store's cache
(offload/expert_store.py), its dense parts stay resident or, when even they do not fit,
stream layer by layer as offload/stream.py streams a dense model, their routers and
norms kept resident for the predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import InferError
from ..runtime.files.checkpoint import Checkpoint
from ..runtime.model.llama import Transformer
from .binding import build_unbound, drop_cached, map_resident, tensor_slots
from .budget import Plan
from .expert_cache import DEFAULT_POLICY, allocate, make_policy
from .expert_plan import (
    ALWAYS_RESIDENT,
    DEFAULT_SCHEME,
    DEFAULT_WORKERS,
    ExpertPlan,
    budget_inputs,
    expert_units,
    minimum_budget,
    plan_experts,
)
from .expert_store import ExpertStore
from .reader import UnitReader
from .stream import LayerStream, process_rss
from .trace import TraceRecorder

DEFAULT_AHEAD = 2  # predict the next two layers (PREDICTIONS["all"])


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
# for each. "entry" predicts most precisely, "all" starts reads a layer or two before they
# are needed (benchmarks/README.md compares them).
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
) -> tuple[Transformer, ExpertStore]:
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
    kv_cache: str | None = None,
    **options,
) -> tuple[Transformer, ExpertStore]:
    """`ckpt`'s model within `budget` bytes of process footprint (how it is spent:
    offload/expert_plan.py); the plan is `store.plan`. raise_to_minimum: a budget below
    the minimum working set becomes that minimum (the automatic budget of a model too
    large for memory). kv_cache: the KV cache's format the plan counts. `options`:
    ExpertOptions' fields."""
    opts = ExpertOptions(**options)
    max_seq_len = min(max_seq_len, ckpt.args.max_seq_len)
    process = process_rss() if process_bytes is None else process_bytes
    fixed, dense_costs, costs, routers = budget_inputs(ckpt, dtype, max_seq_len, process, kv_cache)
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


def _load(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    max_seq_len: int,
    plan: ExpertPlan | None,
    slots: int | list[int],
    opts: ExpertOptions,
) -> tuple[Transformer, ExpertStore]:
    units = expert_units(ckpt)
    make_policy(opts.policy)  # an unknown name fails before anything is read
    streamed = [int(u.split(".")[1]) for u in plan.dense.streamed] if plan else []
    offloaded = [u for us in units for u in us] + [f"layers.{i}" for i in streamed]
    # Resident units: faulted in exactly (no read-around into experts' pages) and checked.
    map_resident(ckpt, [u for u in ckpt.ranges if u not in set(offloaded)])
    model, placeholders = build_unbound(ckpt, dtype, max_seq_len, offloaded)
    store = attach_experts(model, ckpt, dtype, placeholders, slots, opts, plan)
    return model, store


def attach_experts(
    model: Transformer,
    ckpt: Checkpoint,
    dtype: torch.dtype,
    placeholders: dict[str, torch.Tensor],
    slots: int | list[int],
    opts: ExpertOptions,
    plan: ExpertPlan | None = None,
) -> ExpertStore:
    """Serve the experts of `model` (built by binding.build_unbound with `placeholders`
    for its experts, and for the dense layers `plan` streams) from an ExpertStore of
    `slots` experts (a total split over MoE layers by the scheme, or a list per MoE
    layer)."""
    args = ckpt.args
    units = expert_units(ckpt)
    if isinstance(slots, int):
        slots = allocate(slots, len(units), args.n_experts, opts.scheme)
    if len(slots) != len(units):
        raise InferError(f"{len(slots)} slot counts for {len(units)} MoE layers")
    refine = args.n_experts_per_tok if opts.refine is None else opts.refine
    for name, n in (("width", opts.width), ("refine", refine)):
        if n is not None and not 0 <= n <= args.n_experts:
            raise InferError(f"{name} {n}: must be 0 to {args.n_experts} experts")
    streamed = [int(u.split(".")[1]) for u in plan.dense.streamed] if plan else []
    drop_cached(ckpt, [u for us in units for u in us] + [f"layers.{i}" for i in streamed])
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
            stream = _dense_stream(model, ckpt, plan.dense, streamed, placeholders)
        store = ExpertStore(
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
    return store


def _dense_stream(model, ckpt, plan: Plan, streamed, placeholders) -> LayerStream:
    """Stream the dense units of `streamed` layers as offload/stream.py does, with their
    routers and MoE-input norms kept resident (mapped): the predictions read them while
    the layer is not bound."""
    n = ckpt.args.n_layers
    groups = [[f"layers.{i}"] for i in range(n)]
    targets = {}
    for i in streamed:
        keep = []
        for tg in tensor_slots(model, ckpt, groups[i], placeholders):
            if tg.name.endswith(ALWAYS_RESIDENT):
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
