"""Routing traces: what a run routed, saved to a file and replayed through any cache policy.

A trace holds, for each token and each MoE layer (layers are numbered by their order
among the MoE layers; `meta["layer_ids"]` names their model layers):

    experts    (T, L, k) int16    the experts the router chose
    weights    (T, L, k) float32  their routing weights
    predicted  (T, L, P) int16    the experts predicted at layer l for layer l + 1 (Fate:
                                  layer l+1's router on layer l's hidden state); -1 pads,
                                  the last layer's row is all -1; P may be 0
    refined    (T, L, R) int16    the experts predicted for layer l on entering it, before
                                  its attention (layer l's router on the residual stream
                                  there), added to the prediction; -1 pads; R may be 0
    ahead      (T, L, A) int16    the experts predicted at layer l for layer l + 2 (layer
                                  l+2's router on layer l's hidden state); -1 pads (the
                                  last two layers' rows); A may be 0

A visit's predictions accumulate, from the first made for it until the visit ends.
    probs      (T, L, E) float32  the router's probabilities over all experts (optional)

It is one .npz file (`save` writes a temp name, then renames). `visit` is the order a
MoE layer drives the cache in; the live run and `replay` both go through it, so replaying
a recorded trace gives the counters the live run had (tokens of a prompt replay one at a
time, as decoding would see them).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import InferError
from .expert_cache import CacheStats, ExpertCache, Policy, allocate, make_policy


@dataclasses.dataclass
class Trace:
    experts: np.ndarray
    weights: np.ndarray
    predicted: np.ndarray
    probs: np.ndarray | None
    n_experts: int
    meta: dict = dataclasses.field(default_factory=dict)
    refined: np.ndarray | None = None  # None: (T, L, 0)
    ahead: np.ndarray | None = None  # None: (T, L, 0)

    def __post_init__(self):
        if self.refined is None:
            self.refined = np.full((*self.experts.shape[:2], 0), -1, np.int16)
        if self.ahead is None:
            self.ahead = np.full((*self.experts.shape[:2], 0), -1, np.int16)

    @property
    def n_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def n_layers(self) -> int:
        return self.experts.shape[1]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        arrays = {
            "experts": self.experts,
            "weights": self.weights,
            "predicted": self.predicted,
            "refined": self.refined,
            "ahead": self.ahead,
        }
        if self.probs is not None:
            arrays["probs"] = self.probs
        meta = dict(self.meta, n_experts=self.n_experts)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                probs = z["probs"] if "probs" in z.files else None
                refined = z["refined"] if "refined" in z.files else None
                ahead = z["ahead"] if "ahead" in z.files else None
                return cls(
                    z["experts"],
                    z["weights"],
                    z["predicted"],
                    probs,
                    meta.pop("n_experts"),
                    meta,
                    refined,
                    ahead,
                )
        except FileNotFoundError:
            raise InferError(f"no trace file {path}") from None
        except (OSError, ValueError, KeyError) as exc:
            raise InferError(f"{path} is not a routing trace: {exc}") from None

    def scores(self, t: int, layer: int) -> np.ndarray:
        """What the router told a cache at token t, layer `layer`: its probabilities if
        recorded, else the chosen experts' weights (0 for the rest)."""
        if self.probs is not None:
            return self.probs[t, layer].astype(np.float32)
        s = np.zeros(self.n_experts, dtype=np.float32)
        s[self.experts[t, layer]] = self.weights[t, layer]
        return s


class TraceRecorder:
    """Collects what each MoE layer routed, a batch of N tokens per call, in layer order."""

    def __init__(self, n_layers: int, n_experts: int, meta: dict | None = None):
        self.n_experts, self.meta = n_experts, dict(meta or {})
        self._rows: list[list[tuple]] = [[] for _ in range(n_layers)]

    def record(
        self,
        layer: int,
        experts,
        weights,
        probs=None,
        predicted=None,
        refined=None,
        ahead=None,
    ) -> None:
        """experts, weights (N, k); probs (N, E) or None; predicted (N, P), refined (N, R),
        ahead (N, A) or None."""
        experts = np.asarray(experts, dtype=np.int16).reshape(len(experts), -1)
        n = len(experts)
        weights = np.asarray(weights, dtype=np.float32).reshape(n, -1)

        def ids(a):
            a = np.full((n, 0), -1, np.int16) if a is None else a
            return np.asarray(a, dtype=np.int16).reshape(n, -1)

        probs = None if probs is None else np.asarray(probs, dtype=np.float32).reshape(n, -1)
        row = (experts, weights, ids(predicted), probs, ids(refined), ids(ahead))
        self._rows[layer].append(row)

    @property
    def tokens(self) -> int:
        """Tokens recorded so far (by the first MoE layer)."""
        return sum(len(r[0]) for r in self._rows[0])

    def trace(self) -> Trace:
        """The rows so far; a forward pass cut short (Ctrl-C) leaves its first layers a
        batch ahead of the rest: that batch is left out."""
        cols = []
        for layer, rows in enumerate(self._rows):
            if not rows:
                raise InferError(f"trace has nothing for MoE layer {layer}")
            cols.append([np.concatenate(c) if c[0] is not None else None for c in zip(*rows)])
        n = min(c[0].shape[0] for c in cols)
        cols = [[None if a is None else a[:n] for a in c] for c in cols]

        # The last layer predicts nothing; pad every layer to the widest prediction.
        def padded(i):
            width = max(c[i].shape[1] for c in cols)
            return [
                np.pad(c[i], ((0, 0), (0, width - c[i].shape[1])), constant_values=-1) for c in cols
            ]

        pred = padded(2)
        pred[-1][:] = -1
        ahead = padded(5)
        for a in ahead[-2:]:
            a[:] = -1
        has_probs = all(c[3] is not None for c in cols)
        return Trace(
            experts=np.stack([c[0] for c in cols], axis=1),
            weights=np.stack([c[1] for c in cols], axis=1),
            predicted=np.stack(pred, axis=1),
            probs=np.stack([c[3] for c in cols], axis=1) if has_probs else None,
            n_experts=self.n_experts,
            meta=self.meta,
            refined=np.stack(padded(4), axis=1),
            ahead=np.stack(ahead, axis=1),
        )


def visit(
    cache: ExpertCache, layer: int, experts, scores, predicted_next=(), refined=(), ahead=()
) -> dict:
    """One MoE layer, one token (or a batch: the experts any of its tokens chose), in the
    order the live run drives the cache: on entering the layer, add the `refined`
    prediction for it; at its MoE block, tell the cache the router's scores, start
    reading this visit's experts, start reading layer + 1's and layer + 2's (`ahead`)
    predicted experts, then get this layer's in ascending id order (the order the MoE
    block adds them in, so the order a trace stores them in does not matter). Returns
    {expert: value}."""
    ref = [int(e) for e in refined if e >= 0]
    if ref:
        cache.prefetch(layer, ref, refine=True)
    cache.observe(layer, scores)
    used = sorted({int(e) for e in experts})
    cache.start(layer, used)
    for d, pred in ((1, predicted_next), (2, ahead)):
        nxt = [int(e) for e in pred if e >= 0]
        if nxt and layer + d < len(cache.slots):
            cache.prefetch(layer + d, nxt, refine=True)
    return {e: cache.get(layer, e) for e in used}


def replay(
    trace: Trace,
    policy: str | Policy,
    slots: int | Sequence[int],
    expert_bytes: int = 0,
    prefetch: bool = True,
    scheme: str = "uniform",
) -> ExpertCache:
    """Run `trace` through a cache (loads are free); return it, with its counters.

    `slots` is a total (split by `allocate(.., scheme)`) or a list per layer; `policy` a
    name (a fresh policy) or a Policy. prefetch=False ignores the predictions (both).
    """
    if isinstance(slots, int):
        slots = allocate(slots, trace.n_layers, trace.n_experts, scheme)
    if len(slots) != trace.n_layers:
        raise InferError(f"{len(slots)} slot counts for a trace of {trace.n_layers} layers")
    policy = make_policy(policy) if isinstance(policy, str) else policy
    k = trace.experts.shape[2]  # a visit's experts read without a slot, as live
    cache = ExpertCache(lambda layer, e: (layer, e), slots, policy, expert_bytes, unslotted=k)
    none = np.zeros(0, np.int16)
    for t in range(trace.n_tokens):
        for layer in range(trace.n_layers):
            preds = (
                (trace.predicted[t, layer], trace.refined[t, layer], trace.ahead[t, layer])
                if prefetch
                else (none, none, none)
            )
            visit(cache, layer, trace.experts[t, layer], trace.scores(t, layer), *preds)
    return cache


CACHE_FRACTIONS = (0.25, 0.5, 0.75)


def compare(
    trace: Trace,
    policies: Sequence[str] = ("lru", "lfu", "score"),
    fractions: Sequence[float] = CACHE_FRACTIONS,
    scheme: str = "shallow",
) -> list[dict]:
    """Replay `trace` through each policy and cache size (a share of all experts), with
    its predictions and without: one row of counters each (`infer bench --replay`).
    Precision and recall cover the layers that had predictions."""
    L, E = trace.n_layers, trace.n_experts
    has_pred = any((a >= 0).any() for a in (trace.predicted, trace.refined, trace.ahead))
    rows = []
    for frac in fractions:
        slots = allocate(round(frac * L * E), L, E, scheme)
        for prefetch in (False, True) if has_pred else (False,):
            for policy in policies:
                cache = replay(trace, policy, slots, prefetch=prefetch)
                t = cache.totals()
                p = sum((s for s in cache.stats if s.predicted), CacheStats())
                n = max(trace.n_tokens, 1)
                rows.append(
                    {
                        "policy": policy,
                        "cached": frac,
                        "slots": slots,
                        "prefetch": prefetch,
                        "hit_rate": t.hit_rate,
                        "precision": p.precision,
                        "recall": p.recall,
                        "reads_per_token": (t.misses + t.prefetched) / n,
                        "misses_per_token": t.misses / n,
                    }
                )
    return rows
