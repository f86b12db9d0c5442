"""An expert cache for mixture-of-experts layers: which experts stay in memory, and counters.

A model whose experts do not fit in RAM keeps some of them here and reads the rest from
disk when routed to. Keys are (layer, expert); each layer owns a fixed number of slots
(`allocate` splits a total across layers, evenly or favouring shallow layers as Fate
does); a policy picks the victim when a layer's slots are full:

    LRUPolicy    least recently used (mixtral-offloading's expert cache)
    LFUPolicy    least frequently used over the whole run (counts survive eviction)
    ScorePolicy  lowest decayed router score, in the spirit of HybriMoE's Minus Recent
                 Score: each visit of a layer, S = a * scores + (1 - a) * S over all of
                 its experts, so an expert the router keeps rating highly stays even when
                 it was not among the top k this time
    Ties go to the least recently used, then to the lower expert id.

The cache has four verbs, called by the MoE block (and by `trace.replay`, in the same
order, so offline figures equal live ones):

    observe(layer, scores)     the router's probabilities over the layer's experts on this
                               visit (only ScorePolicy uses them)
    start(layer, experts)      the experts this visit will use (the router's exact choice,
                               known before the first of them runs): those not in memory
                               start reading now, all at once, through `submit`, so misses
                               are read side by side instead of one after another; they
                               still count as misses, and `get` waits for them ("stall").
                               Experts that get no slot (all protected) are still read, at
                               most `k` of them (the rest on demand): they live until used
    get(layer, expert)         the expert's value, from memory or read now by
                               `load(layer, expert)` (a miss: the caller waits, "stall");
                               a miss never evicts an expert predicted for this visit
                               and not yet used, nor one `start` is reading
    prefetch(layer, experts)   the experts predicted for `layer`'s next visit: those not
                               in memory are read, through `submit` when given (a reader
                               thread), else at once; they take slots through the same
                               eviction path, but never evict an expert the current layer
                               is using (got since `get` last moved to another layer) or
                               one predicted in the same call. refine=True adds to the
                               visit's prediction instead of replacing it (a second,
                               later guess, e.g. from the state entering the layer)

Loads run outside the lock; a slot holds a Future, so a `get` of an expert whose
prefetch is still reading waits for that read instead of issuing a second one. A read
that fails raises in whoever waits for it and leaves its slot empty.

Counters (CacheStats, per layer; `totals()` sums them): hits and misses of `get`,
evictions, bytes read, seconds stalled in `get`, and the prefetch bookkeeping:
predicted (experts named by prefetch), predicted_used (of those, used at that layer's
next visit), prefetched (reads prefetch issued) and prefetch_used (of those, used before
eviction). precision = predicted_used / predicted, recall = predicted_used / uses.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from .. import InferError

Key = tuple[int, int]  # (layer, expert)


# ---------------------------------------------------------------------------------------
# Counters
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    stall_s: float = 0.0
    predicted: int = 0
    predicted_used: int = 0
    prefetched: int = 0
    prefetch_used: int = 0
    cancelled: int = 0  # prefetch reads dropped before they started (not in prefetched)

    @property
    def uses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0

    @property
    def precision(self) -> float:
        """Of the experts prefetch() was told about, the share used at the next visit."""
        return self.predicted_used / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        """Of the experts used, the share that had been predicted for that visit."""
        return self.predicted_used / self.uses if self.uses else 0.0

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def __sub__(self, other: CacheStats) -> CacheStats:
        """The counters since `other` was copied (e.g. one phase of a run)."""
        return CacheStats(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )


# ---------------------------------------------------------------------------------------
# Policies: the cache calls them under its lock
# ---------------------------------------------------------------------------------------


class Policy:
    """Chooses which resident expert of a layer to evict.

    `touch` is a use (a get), `insert` a new resident, `observe` the router's scores of a
    visit. Subclasses give `priority(key)`: the lowest is evicted, ties by recency.
    """

    name = ""

    def __init__(self):
        self._tick = 0
        self._last: dict[Key, int] = {}

    def _stamp(self, key: Key) -> None:
        self._tick += 1
        self._last[key] = self._tick

    def touch(self, key: Key) -> None:
        self._stamp(key)

    def insert(self, key: Key) -> None:
        self._stamp(key)

    def observe(self, layer: int, scores: np.ndarray) -> None:
        pass

    def priority(self, key: Key) -> float:
        return 0.0

    def victim(self, candidates: Sequence[Key]) -> Key:
        return min(candidates, key=lambda k: (self.priority(k), self._last.get(k, 0), k[1]))


class LRUPolicy(Policy):
    name = "lru"

    def victim(self, candidates: Sequence[Key]) -> Key:
        last = self._last.get  # priority 0 for all: by recency (see LFUPolicy.victim)
        return min(candidates, key=lambda k: (last(k, 0), k[1]))


class LFUPolicy(Policy):
    name = "lfu"

    def __init__(self):
        super().__init__()
        self._count: dict[Key, int] = {}

    def touch(self, key: Key) -> None:
        super().touch(key)
        self._count[key] = self._count.get(key, 0) + 1

    def priority(self, key: Key) -> float:
        return self._count.get(key, 0)

    def victim(self, candidates: Sequence[Key]) -> Key:
        # Policy.victim's order with the lookups bound once: it runs for every prefetch
        # that evicts, over a layer's slots (~100 times a token on a 128-expert model)
        count, last = self._count.get, self._last.get
        return min(candidates, key=lambda k: (count(k, 0), last(k, 0), k[1]))


class ScorePolicy(Policy):
    name = "score"

    # alpha: one visit's weight against the decayed past (chosen on the trained MoE,
    # benchmarks/README.md)
    def __init__(self, alpha: float = 0.03):
        super().__init__()
        self.alpha = alpha
        self._score: dict[int, np.ndarray] = {}  # layer -> (n_experts,) decayed scores

    def observe(self, layer: int, scores: np.ndarray) -> None:
        s = np.asarray(scores, dtype=np.float64)
        old = self._score.get(layer)
        self._score[layer] = self.alpha * s + (1 - self.alpha) * (0.0 if old is None else old)

    def priority(self, key: Key) -> float:
        s = self._score.get(key[0])
        return float(s[key[1]]) if s is not None and key[1] < len(s) else 0.0


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRUPolicy, LFUPolicy, ScorePolicy)}
DEFAULT_POLICY = "lfu"  # the best hit rates on the trained MoE (benchmarks/README.md)


def make_policy(name: str, **kwargs) -> Policy:
    if name not in POLICIES:
        raise InferError(f"unknown expert policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name](**kwargs)


# ---------------------------------------------------------------------------------------
# Slots per layer
# ---------------------------------------------------------------------------------------


def allocate(total: int, n_layers: int, n_experts: int, scheme: str = "uniform") -> list[int]:
    """Split `total` expert slots over layers, at most n_experts each.

    uniform: equal shares, the remainder to the shallowest layers. shallow (Fate): shares
    fall linearly with depth, the first layer's twice the last's, since the cross-layer
    predictor is least accurate in shallow layers and the cache must cover for it. Shares
    above n_experts spill to the next layers. A budget in bytes is `budget // expert_bytes`.
    """
    if scheme == "uniform":
        weights = np.ones(n_layers)
    elif scheme == "shallow":
        weights = np.linspace(2.0, 1.0, n_layers) if n_layers > 1 else np.ones(1)
    else:
        raise InferError(f"unknown slot allocation {scheme!r}; choose uniform or shallow")
    total = max(0, min(total, n_layers * n_experts))
    slots = [0] * n_layers
    left, free = total, list(range(n_layers))
    while left and free:  # capped layers drop out; their excess is re-split among the rest
        w = weights[free] / weights[free].sum()
        share = np.floor(w * left).astype(int)
        # the remainder by largest fraction, ties to the shallower layer
        for i in sorted(range(len(free)), key=lambda i: (-(w[i] * left - share[i]), i))[
            : left - share.sum()
        ]:
            share[i] += 1
        for i, layer in enumerate(free):
            slots[layer] += int(share[i])
        left = sum(max(0, s - n_experts) for s in slots)
        slots = [min(s, n_experts) for s in slots]
        free = [layer for layer in free if slots[layer] < n_experts]
    return slots


# ---------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------


class ExpertCache:
    def __init__(
        self,
        load: Callable[[int, int], object],
        slots: Sequence[int],
        policy: Policy,
        expert_bytes: int = 0,
        submit: Callable[..., Future] | None = None,
        unslotted: int = 0,
        urgent: Callable[..., Future] | None = None,
        cancel: bool = False,
    ):
        """`load(layer, expert)` reads one expert; `slots[layer]` experts stay per layer;
        `expert_bytes` is what one read costs (for bytes_read); `submit(fn, *args)`, e.g.
        a ThreadPoolExecutor's, runs prefetch reads in the background (None: at once);
        `urgent(fn, *args)` the same for `start`'s reads, ahead of queued prefetches
        (default: submit); `unslotted`: how many of a visit's experts `start` reads
        without a slot. cancel: `start` drops the layer's prefetch reads that have not
        begun and that this visit does not use (their handles' cancel()), freeing their
        slots; how many depends on timing, so a replay then differs from the live run."""
        self._load = load
        self.slots = list(slots)
        self.policy = policy
        self.expert_bytes = expert_bytes
        self.unslotted = unslotted
        self._submit = submit
        self._urgent = urgent or submit
        self._cancel = cancel
        self._queued: dict[Key, tuple[Future, object]] = {}  # prefetch reads not begun
        self._lock = threading.Lock()
        n = len(self.slots)
        self._entries: list[dict[int, Future]] = [{} for _ in range(n)]  # expert -> its value
        self._pending: dict[int, Future] = {}  # the visit's started reads that have no slot
        self._demand: set[Key] = set()  # started by `start`: a miss when got
        self._predicted: list[set[int]] = [set() for _ in range(n)]  # not yet used
        self._from_prefetch: set[Key] = set()  # read by prefetch, not yet used
        self._in_use_layer, self._in_use = -1, set()
        self.stats = [CacheStats() for _ in range(n)]

    def totals(self) -> CacheStats:
        return sum(self.stats, CacheStats())

    def resident(self, layer: int) -> list[int]:
        """Expert ids of `layer` in memory or being read, ascending."""
        with self._lock:
            return sorted(self._entries[layer])

    def observe(self, layer: int, scores) -> None:
        with self._lock:
            self.policy.observe(layer, scores)

    def release(self) -> None:
        """The current layer is done with its experts (optional: moving on does it too)."""
        with self._lock:
            self._enter(-1)

    def _enter(self, layer: int) -> None:
        """Under the lock: `layer` becomes the one whose experts are in use; the visit
        of the layer before it is over, and so is what was predicted for that visit."""
        if layer != self._in_use_layer:
            if self._in_use_layer >= 0:
                self._predicted[self._in_use_layer] = set()
            self._in_use_layer, self._in_use = layer, set()
            self._pending.clear()  # an interrupted visit's leftovers

    def start(self, layer: int, experts: Sequence[int]) -> None:
        experts = sorted({int(e) for e in experts})
        todo = []
        if self._cancel:
            self._drop_queued(layer, set(experts))
        with self._lock:
            self._enter(layer)
            self._in_use.update(experts)
            protect = self._predicted[layer] | self._in_use
            entries, spare = self._entries[layer], self.unslotted
            for e in experts:
                if e in entries or e in self._pending:
                    continue
                fut = Future()
                if not self._admit(layer, e, fut, protect):
                    if spare <= 0:
                        continue  # read by get, on demand
                    spare -= 1
                    self._pending[e] = fut
                self._demand.add((layer, e))
                todo.append((e, fut))
        self._read_all(layer, todo, self._urgent)

    def _drop_queued(self, layer: int, used: set[int]) -> None:
        """Cancel `layer`'s prefetch reads that have not begun and are not in `used`."""
        with self._lock:
            drop = [k for k in self._queued if k[0] == layer and k[1] not in used]
            for key in drop:
                fut, handle = self._queued[key]
                if not handle.cancel():
                    continue  # a reader has it: it completes
                del self._queued[key]
                if self._entries[layer].get(key[1]) is fut:
                    del self._entries[layer][key[1]]
                self._from_prefetch.discard(key)
                st = self.stats[layer]
                st.prefetched -= 1
                st.cancelled += 1
                fut.cancel()

    def ready(self, layer: int, expert: int) -> bool:
        """Whether get(layer, expert) would return at once: the expert is in memory (a
        hint: it counts nothing, and a read may finish just after it answers)."""
        fut = self._entries[layer].get(expert) or self._pending.get(expert)
        return fut is not None and fut.done()

    def get(self, layer: int, expert: int):
        key, st = (layer, expert), self.stats[layer]
        with self._lock:
            self._enter(layer)
            self._in_use.add(expert)
            if expert in self._predicted[layer]:
                self._predicted[layer].discard(expert)
                st.predicted_used += 1
            self.policy.touch(key)
            fut = self._entries[layer].get(expert) or self._pending.pop(expert, None)
            started = fut is not None and key in self._demand
            self._demand.discard(key)
            if fut is not None and not started:
                st.hits += 1
                if key in self._from_prefetch:
                    self._from_prefetch.discard(key)
                    st.prefetch_used += 1
            else:
                st.misses += 1
            miss = fut is None
            if miss:
                fut = Future()
                waiting = {e for lay, e in self._demand if lay == layer}  # started, not got
                self._admit(layer, expert, fut, self._predicted[layer] | waiting)
        if miss:  # ours to read, on this thread
            t0 = time.perf_counter()
            self._fill(layer, expert, fut)
            with self._lock:
                st.stall_s += time.perf_counter() - t0
        elif not fut.done():  # a read still in flight
            t0 = time.perf_counter()
            fut.exception()
            with self._lock:
                st.stall_s += time.perf_counter() - t0
        return fut.result()

    def prefetch(self, layer: int, experts: Sequence[int], refine: bool = False) -> None:
        experts = list(dict.fromkeys(int(e) for e in experts))
        st, todo = self.stats[layer], []
        with self._lock:
            before = self._predicted[layer] if refine else set()
            new = [e for e in experts if e not in before]
            self._predicted[layer] = before | set(new)
            st.predicted += len(new)
            protect = set(self._predicted[layer])
            if layer == self._in_use_layer:
                protect |= self._in_use
            for e in new:
                if e in self._entries[layer]:
                    continue
                fut = Future()
                if not self._admit(layer, e, fut, protect):
                    break
                self._from_prefetch.add((layer, e))
                st.prefetched += 1
                todo.append((e, fut))
        self._read_all(layer, todo, self._submit, queued=self._cancel)

    def _read_all(self, layer: int, todo: list[tuple[int, Future]], submit, queued=False):
        """Read each (expert, future) of `todo`: in the background through `submit`, if
        any (queued: remember the handles, to cancel), else now."""
        for i, (e, fut) in enumerate(todo):
            if submit is None:
                self._fill(layer, e, fut)
                continue
            try:
                with self._lock:  # before _fill can run and forget it
                    handle = submit(self._fill, layer, e, fut)
                    if queued:
                        self._queued[layer, e] = (fut, handle)
            except BaseException as exc:  # e.g. the reader was shut down: fail, then re-raise
                for e2, fut2 in todo[i:]:
                    self._fail(layer, e2, fut2, exc)
                raise

    def _admit(self, layer: int, expert: int, fut: Future, protect) -> bool:
        """Give `fut` a slot of `layer`, evicting if full; False if no slot can be had.

        A miss with no slot still reads (into `fut`, which then lives only with the caller).
        Called under the lock. A slot still being read may be the victim: its read
        finishes unused (whoever waits on it still gets it), and the choice does not depend
        on how fast reads are, so a replayed trace evicts as the live run did.
        """
        entries = self._entries[layer]
        if len(entries) >= self.slots[layer]:
            candidates = [(layer, e) for e in entries if e not in protect]
            if not candidates:
                return False
            victim = self.policy.victim(candidates)
            del entries[victim[1]]
            self._from_prefetch.discard(victim)
            self._demand.discard(victim)
            self.stats[layer].evictions += 1
        entries[expert] = fut
        self.policy.insert((layer, expert))
        return True

    def _fill(self, layer: int, expert: int, fut: Future) -> None:
        """Read one expert into `fut` (on the caller's thread or a reader's)."""
        if self._cancel:
            with self._lock:
                if self._queued.get((layer, expert), (None,))[0] is fut:
                    del self._queued[layer, expert]
        try:
            value = self._load(layer, expert)
        except BaseException as exc:  # noqa: BLE001 - Ctrl-C too: a slot must never stay pending
            self._fail(layer, expert, fut, exc)
            return
        with self._lock:
            self.stats[layer].bytes_read += self.expert_bytes
        fut.set_result(value)

    def _fail(self, layer: int, expert: int, fut: Future, exc: BaseException) -> None:
        """A read that will not happen: free its slot; whoever waits on it gets `exc`."""
        with self._lock:
            if self._entries[layer].get(expert) is fut:
                del self._entries[layer][expert]
            if self._pending.get(expert) is fut:
                del self._pending[expert]
            self._from_prefetch.discard((layer, expert))
            self._demand.discard((layer, expert))
        fut.set_exception(exc)
