"""Turn a model path (a GGUF file, a Hugging Face directory or our own checkpoint
directory) into a ready model: inspect (open its source, runtime/files/sources.py),
plan (does it fit, or which parts stream from disk), build (runtime/files/build.py),
attach (a layer stream or an expert cache from offload/ for the parts that do not fit).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import InferError
from ..offload.budget import Plan, format_size
from ..offload.expert_cache import DEFAULT_POLICY
from ..offload.expert_plan import stores_experts_apart
from ..offload.expert_store import ExpertStore
from ..offload.experts import load_moe_budgeted, prediction_options
from ..offload.routing import RoutingRecorder, new_recorder
from ..offload.stream import (
    LayerStream,
    layer_costs,
    layer_units,
    load_streamed,
    overheads,
    process_rss,
)
from ..offload.trace import TraceRecorder
from .files.build import build
from .files.checkpoint import Checkpoint, verify
from .files.hugepages import give_back_freed_heap, reuse_freed_heap
from .files.sources import CheckpointSource, Source, open_source
from .model.config import ModelArgs
from .model.kvcache import KINDS, cache_bytes, float_kind
from .model.llama import Transformer
from .model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from .pipeline.coordinator import Pipeline


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    source: Source
    dtype: torch.dtype
    load_seconds: float
    # Under a memory budget (offload/): what stays resident, and the stream that reads
    # the rest (None when every layer fits).
    plan: Plan | None = None
    stream: LayerStream | None = None
    auto_budget: bool = False  # the budget was chosen because the model does not fit
    # A mixture-of-experts model under a budget: its experts served from an expert cache
    # (offload/expert_store.py; its plan covers the dense parts too, `plan` is then None).
    experts: ExpertStore | None = None
    # What the MoE blocks routed, when asked for (--trace): save with .trace().save(path).
    routing: TraceRecorder | None = None
    # The blocks held by workers on other machines (pipeline/coordinator.py): `model`
    # then holds the embeddings and the output layer only.
    stages: Pipeline | None = None

    @property
    def args(self) -> ModelArgs:
        return self.model.args


# Without --max-memory a model streams when its estimated footprint exceeds this share
# of the memory available now; the budget it then gets is a smaller share, leaving room
# for the page cache and the rest of the system.
FITS_SHARE = 0.9
AUTO_BUDGET_SHARE = 0.8


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    max_seq_len: int | None = None,
    max_memory: int | None = None,
    *,
    expert_policy: str | None = None,
    record_routing: bool = False,
    expert_prediction: str | None = None,
    dequantize: bool = False,
    kv_cache: str | None = None,
) -> LoadedModel:
    """Load weights, tokenizer and caches. `max_seq_len` defaults to the model's context.

    `max_memory`: the process's footprint budget in bytes (RSS plus the page cache it
    holds); layers that do not fit stream from disk (offload/). Without it, a model
    too large for the available memory streams on its own, and says so on stderr.
    A mixture-of-experts model that does not fit keeps its dense parts resident and its
    experts in an expert cache of policy `expert_policy` (default: expert_cache's), read
    ahead as `expert_prediction` says (offload/experts.py PREDICTIONS; default "all").
    record_routing: record what its MoE blocks route (`LoadedModel.routing`).
    dequantize: a GGUF file's weights all in `dtype` (see Source.weights).
    kv_cache: the format of the KV caches its sessions make (model/kvcache.py KINDS;
    default the compute dtype's float), which the memory plans count.
    """
    if kv_cache is not None and kv_cache not in KINDS:
        raise InferError(f"unknown KV cache {kv_cache!r}: one of {', '.join(KINDS)}")
    t0 = time.perf_counter()
    process = process_rss()  # before anything of this model: torch and all
    source = open_source(path)  # inspect
    args = source.args
    ctx = min(max_seq_len or args.max_seq_len, args.max_seq_len)
    budget, auto = _budget(source, dtype, ctx, max_memory, process, kv_cache)  # plan
    now = process_rss()  # what the plans count as the process (the tokenizer is small)
    ckpt = source.checkpoint if isinstance(source, CheckpointSource) else None
    experts = budget is not None and _offloads_experts(ckpt, dtype, ctx, budget, now, kv_cache)
    tokenizer = source.tokenizer()
    give_back_freed_heap()  # before the weights: what building the tokenizer freed
    recorder = new_recorder(args, {"model": str(source.path)}) if record_routing else None
    stream = plan = offload = None
    if experts:  # build and attach an expert cache
        model, offload = load_moe_budgeted(
            ckpt,
            dtype,
            ctx,
            budget,
            process_bytes=now,
            raise_to_minimum=auto,
            kv_cache=kv_cache,
            policy=expert_policy or DEFAULT_POLICY,
            recorder=recorder,
            **prediction_options(expert_prediction),
        )
        if auto:
            _say_auto_budget(source, offload.plan)
    elif budget is not None:  # build and attach a layer stream
        model, stream, plan = load_streamed(
            ckpt, dtype, ctx, budget, process_bytes=now, raise_to_minimum=auto, kv_cache=kv_cache
        )
        if auto:
            _say_auto_budget(source, plan)
    else:
        if ckpt is not None:
            # crc32 of every unit: the first forward pass faults these pages in anyway,
            # and a corrupt byte fails here, naming its unit.
            verify(ckpt)
        model = build(source, dtype, ctx, dequantize=dequantize)
    if recorder is not None and not experts:  # resident experts: hooks that only record
        RoutingRecorder(model, recorder)
    model.kv_cache = kv_cache  # what Session(model) makes
    give_back_freed_heap()  # what the weights' temporaries freed
    reuse_freed_heap(keep=budget is None and not auto)  # from now on: activations
    load_s = time.perf_counter() - t0
    return LoadedModel(
        model, tokenizer, source, dtype, load_s, plan, stream, auto, offload, recorder
    )


def _budget(
    source: Source,
    dtype: torch.dtype,
    ctx: int,
    max_memory: int | None,
    process: int,
    kv_cache: str | None,
) -> tuple[int | None, bool]:
    """(The footprint budget, or None to load resident; whether it was chosen for a
    model that does not fit). Only our checkpoints stream; another file loads resident
    under a budget it fits in."""
    budget, auto = max_memory, False
    if budget is None:
        budget = _auto_budget(source, dtype, ctx, process, kv_cache)
        auto = budget is not None
    if budget is not None and not isinstance(source, CheckpointSource):
        resident = process + estimated_bytes(source, dtype, ctx, 1, kv_cache)
        if not auto and resident <= budget:
            return None, False
        what = "a GGUF file" if source.format == "gguf" else "a Hugging Face directory"
        advice = (
            f"streaming layers from disk needs infer's own format; convert it first: "
            f"infer quantize {source.path} -o DIR --to int8 (or int4)"
        )
        if not auto:
            raise InferError(
                f"{source.path} is {what} that needs about {format_size(resident)} resident, "
                f"over the budget of {format_size(budget)}: {advice}"
            )
        print(f"note: {source.path} may not fit in available memory; {advice}", file=sys.stderr)
        budget = None
    return budget, auto


def _say_auto_budget(source: Source, plan) -> None:
    """The stderr note of a model streamed because it does not fit (no --max-memory)."""
    print(
        f"note: {source.path.name} does not fit in available memory: "
        f"{plan.describe()} (--max-memory sets the budget)",
        file=sys.stderr,
    )


def _offloads_experts(
    ckpt: Checkpoint | None,
    dtype: torch.dtype,
    ctx: int,
    budget: int,
    process: int,
    kv_cache: str | None,
) -> bool:
    """Whether a budgeted load caches experts: a MoE checkpoint storing each expert apart
    that does not fit whole (a model that fits loads resident, as any other)."""
    if ckpt is None or not stores_experts_apart(ckpt):
        return False
    costs = layer_costs(ckpt, layer_units(ckpt, ckpt.args.n_layers), dtype)
    need = overheads(ckpt, ckpt.args, dtype, ctx, process, kv_cache).total
    return need + sum(c.resident_bytes for c in costs) > budget


def estimated_bytes(
    source: Source, dtype: torch.dtype, ctx: int, sessions: int = 1, kv_cache: str | None = None
) -> int:
    """What loading `source` resident would add to the process: its weights, `sessions`
    KV caches of `ctx` positions in `kv_cache`'s format (default the compute dtype's), and
    for our checkpoints the buffers the plans count."""
    args = source.args
    ctx = min(ctx, args.max_seq_len)
    kv = kv_cache_bytes(args, dtype, ctx, kv_cache)
    if isinstance(source, CheckpointSource):
        ckpt = source.checkpoint
        costs = layer_costs(ckpt, layer_units(ckpt, args.n_layers), dtype)
        fixed = overheads(ckpt, args, dtype, ctx, 0, kv_cache)  # with one KV cache
        return fixed.total + (sessions - 1) * kv + sum(c.resident_bytes for c in costs)
    return source.held_bytes(dtype) + sessions * kv


def kv_cache_bytes(
    args: ModelArgs, dtype: torch.dtype, ctx: int, kv_cache: str | None = None
) -> int:
    """One session's KV cache (Transformer.new_cache): keys and values of every layer at
    `ctx` positions, in `kv_cache`'s format (default the compute dtype's float)."""
    return cache_bytes(args, ctx, kv_cache or float_kind(dtype))


def _auto_budget(
    source: Source, dtype: torch.dtype, ctx: int, process: int, kv_cache: str | None
) -> int | None:
    """A budget when the model's estimated footprint exceeds the memory available now;
    None when it fits."""
    import psutil

    available = psutil.virtual_memory().available
    if estimated_bytes(source, dtype, ctx, kv_cache=kv_cache) <= FITS_SHARE * available:
        return None
    return process + int(AUTO_BUDGET_SHARE * available)
