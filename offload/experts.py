"""A MoE model whose routed experts stay on disk and run from an expert cache.

`load_expert_cached` builds the model from our checkpoint (runtime/checkpoint.py) with
every expert left out: each expert is one unit, "layers.N.mlp.experts.E", one read.
Dense parts (attention, routers, shared experts, norms, embeddings) are mapped as a
normal load maps them. Each MoE block's `run_expert(e, x)` becomes: get the expert from
the ExpertCache (offload/expert_cache.py; a miss reads it now through the background
UnitReader), bind its tensors, run it, unbind. A pre-hook on each MoE block drives the
cache the way `trace.visit` does, so a recorded trace replays to the same counters:

    observe(j, router probabilities of the block's tokens, averaged)
    prefetch(j + 1, the next MoE block's router on this block's input)  (Fate)
    get(j, e) for the experts the tokens chose, ascending (MoE.forward's order)

Caches, slots and traces number MoE blocks 0..n-1 in model order (`layer_ids` maps them
to model layers). Prefetch reads run on a small thread pool that waits on the reader, so
layer j+1's experts are read while layer j computes; a wrong prediction costs a read,
never a different output: every expert used is the one the router chose.

One read buffer per loaded expert, allocated when read and freed with the last
reference to it (the cache's, or the block's while the expert runs); so expert memory is
about (slots + experts in flight) * expert bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from ..runtime.checkpoint import Checkpoint, build_model, unit_views
from ..runtime.errors import InferError
from ..runtime.llama import Transformer
from .expert_cache import DEFAULT_POLICY, ExpertCache, allocate, make_policy
from .reader import UnitReader, alloc_buffer, round_up
from .stream import _drop_cached, _placeholder, _Target, _targets
from .trace import TraceRecorder


@dataclasses.dataclass
class _Loaded:
    """One expert read into its own buffer: (target, tensor) pairs ready to bind."""

    tensors: list[tuple[_Target, torch.Tensor]]
    buf: object  # the page-aligned buffer the tensors view; kept alive with them


class ExpertOffload:
    """The hooks and the cache serving one model's experts; `close()` undoes nothing in
    the model but stops the reader and the prefetch threads."""

    def __init__(
        self,
        model: Transformer,
        ckpt: Checkpoint,
        dtype: torch.dtype,
        slots: list[int],
        policy: str,
        *,
        prefetch: bool,
        recorder: TraceRecorder | None,
        reader: UnitReader,
        placeholders: dict[str, torch.Tensor],
    ):
        args = ckpt.args
        self.layer_ids = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
        self.blocks = [model.layers[i].mlp for i in self.layer_ids]
        self.units = [
            [f"layers.{i}.mlp.experts.{e}" for e in range(args.n_experts)] for i in self.layer_ids
        ]
        self.targets = [[_targets(model, ckpt, [u], placeholders) for u in us] for us in self.units]
        for per_layer in self.targets:
            for targets in per_layer:
                for tg in targets:
                    tg.set(tg.unbound)
        self.ckpt, self.dtype, self.reader = ckpt, dtype, reader
        self.expert_bytes = max(
            round_up(end - b) for us in self.units for b, end in map(ckpt.ranges.get, us)
        )
        self.prefetch, self.recorder = prefetch, recorder
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="expert-prefetch")
        self.cache = ExpertCache(
            self._load, slots, make_policy(policy), self.expert_bytes, submit=self._pool.submit
        )
        self._handles = []
        for j, block in enumerate(self.blocks):
            block.run_expert = functools.partial(self._run, j, block)
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._visit, j)))

    def _load(self, j: int, e: int) -> _Loaded:
        unit = self.units[j][e]
        b, end = self.ckpt.ranges[unit]
        buf = alloc_buffer(end - b)
        self.reader.read(unit, buf)
        views = unit_views(self.ckpt, unit, torch.frombuffer(buf, dtype=torch.uint8)[: end - b])
        tensors = []
        for tg in self.targets[j][e]:
            t = views[tg.name]
            tensors.append((tg, t if t.dtype == tg.dtype else t.to(tg.dtype)))
        return _Loaded(tensors, buf)

    def _run(self, j: int, block, e: int, x: torch.Tensor) -> torch.Tensor:
        loaded = self.cache.get(j, e)
        for tg, t in loaded.tensors:
            tg.set(t)
        try:
            return block.experts[e](x)
        finally:
            for tg, _ in loaded.tensors:
                tg.set(tg.unbound)

    @torch.no_grad()
    def _visit(self, j: int, block, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])  # (N, dim): the MoE block's input
        probs = block.probs(x)  # (N, E)
        self.cache.observe(j, probs.mean(0).numpy())
        pred = None
        if j + 1 < len(self.blocks):
            pred = self.blocks[j + 1].route(x)[0]  # (N, k), each row by falling weight
            if self.prefetch:
                self.cache.prefetch(j + 1, pred.flatten().tolist())
        if self.recorder is not None:
            ids, weights = block.route(x)
            self.recorder.record(j, ids, weights.float(), probs, pred)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pool.shutdown(wait=True)
        self.reader.close()


def load_expert_cached(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    max_seq_len: int,
    slots: int | list[int],
    *,
    policy: str = DEFAULT_POLICY,
    scheme: str = "shallow",
    prefetch: bool = True,
    recorder: TraceRecorder | None = None,
    check: bool = True,
    direct: bool = True,
    workers: int = 2,
) -> tuple[Transformer, ExpertOffload]:
    """`ckpt`'s model with its experts served from an ExpertCache of `slots` experts (a
    total split over MoE layers by `scheme`, or a list per MoE layer). A byte budget for
    experts is `budget // offload.expert_bytes` slots. The defaults (LFU, shallow-favouring
    slots, prefetch) measured best on the trained MoE (benchmarks/README.md)."""
    args = ckpt.args
    moe = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
    units = [f"layers.{i}.mlp.experts.{e}" for i in moe for e in range(args.n_experts)]
    if not moe:
        raise InferError(f"{ckpt.file}: not a mixture-of-experts model")
    missing = [u for u in units if u not in ckpt.units]
    if missing:
        raise InferError(
            f"{ckpt.file}: no unit '{missing[0]}': experts must be stored one per unit "
            "(infer quantize writes them so)"
        )
    if isinstance(slots, int):
        slots = allocate(slots, len(moe), args.n_experts, scheme)
    if len(slots) != len(moe):
        raise InferError(f"{len(slots)} slot counts for {len(moe)} MoE layers")
    names = [n for u in units for n in ckpt.units[u]]
    placeholders = {n: _placeholder(ckpt, n, dtype) for n in names}
    model = build_model(
        dataclasses.replace(ckpt, tensors={**ckpt.tensors, **placeholders}), dtype, max_seq_len
    )
    # The fused decode step holds pointers to every weight; experts move between buffers.
    model.fused_decode = None
    _drop_cached(ckpt, units)
    reader = UnitReader(
        ckpt.file, ckpt.ranges, ckpt.crc32 if check else None, workers=workers, direct=direct
    )
    try:
        offload = ExpertOffload(
            model,
            ckpt,
            dtype,
            list(slots),
            policy,
            prefetch=prefetch,
            recorder=recorder,
            reader=reader,
            placeholders=placeholders,
        )
    except BaseException:
        reader.close()
        raise
    return model, offload
