"""The expert cache (offload/expert_cache.py) and routing traces (offload/trace.py).

Policies are checked on hand-made access sequences; the live-versus-replay test drives a
cache from a tiny random Qwen3-MoE (transformers, decoding token by token), computes the
MoE layers from the cached experts, and replays the recorded trace offline.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from infer import InferError
from infer.offload.expert_cache import (
    CacheStats,
    ExpertCache,
    LFUPolicy,
    LRUPolicy,
    ScorePolicy,
    allocate,
    make_policy,
)
from infer.offload.trace import Trace, TraceRecorder, replay, visit
from infer.runtime.session import Session


def make_cache(policy, slots, expert_bytes=10, **kw):
    loads = []

    def load(layer, e):
        loads.append((layer, e))
        return f"L{layer}E{e}"

    return ExpertCache(load, slots, policy, expert_bytes, **kw), loads


def gets(cache, layer, experts):
    return [cache.get(layer, e) for e in experts]


# ---------------------------------------------------------------------------------------
# Eviction order
# ---------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used():
    cache, loads = make_cache(LRUPolicy(), [2])
    assert gets(cache, 0, [0, 1, 0, 2]) == ["L0E0", "L0E1", "L0E0", "L0E2"]
    assert cache.resident(0) == [0, 2]  # 1 was older than 0
    cache.get(0, 1)  # evicts 0 (2 was used after it)
    assert cache.resident(0) == [1, 2]
    st = cache.stats[0]
    assert (st.hits, st.misses, st.evictions, st.bytes_read) == (1, 4, 2, 40)
    assert loads == [(0, 0), (0, 1), (0, 2), (0, 1)]


def test_lfu_evicts_least_frequent_and_remembers_evicted_counts():
    cache, _ = make_cache(LFUPolicy(), [2])
    gets(cache, 0, [0, 0, 1, 2])  # at 2: counts 0->2, 1->1
    assert cache.resident(0) == [0, 2]
    gets(cache, 0, [1])  # 1's count survives its eviction: 1->2 now, 2->1
    assert cache.resident(0) == [0, 1]


def test_lfu_ties_go_to_least_recent():
    cache, _ = make_cache(LFUPolicy(), [2])
    gets(cache, 0, [0, 1, 2])  # all counts 1: 0 is least recent
    assert cache.resident(0) == [1, 2]


def score_sequence(cache):
    # single-expert visits; the router's probabilities rate expert 0 highly all along
    for probs, e in [([0.7, 0.2, 0.1, 0], 0), ([0.2, 0.5, 0.3, 0], 1), ([0.3, 0.1, 0.6, 0], 2)]:
        cache.observe(0, np.array(probs))
        cache.get(0, e)


def test_score_evicts_lowest_decayed_score_not_oldest():
    cache, _ = make_cache(ScorePolicy(alpha=0.5), [2])
    score_sequence(cache)
    # S = .5 p + .5 S: [.35 .1 .05 0] -> [.275 .3 .175 0] -> [.2875 .2 .3875 0]
    assert cache.resident(0) == [0, 2]  # 1 (0.2) goes although 0 is older
    lru, _ = make_cache(LRUPolicy(), [2])
    score_sequence(lru)
    assert lru.resident(0) == [1, 2]


def test_score_ties_go_to_least_recent():
    cache, _ = make_cache(ScorePolicy(), [2])
    gets(cache, 0, [3, 1, 2])  # nothing observed: all scores 0
    assert cache.resident(0) == [1, 2]


@pytest.mark.parametrize("name", ["lru", "lfu", "score"])
def test_capacity_one_and_zero(name):
    cache, loads = make_cache(make_policy(name), [1, 0])
    gets(cache, 0, [0, 1, 1, 0])
    assert cache.resident(0) == [0]
    assert (cache.stats[0].hits, cache.stats[0].misses) == (1, 3)
    gets(cache, 1, [5, 5])  # no slots: every use reads
    assert cache.resident(1) == [] and cache.stats[1].misses == 2
    assert len(loads) == 5


def test_layers_are_separate():
    cache, _ = make_cache(LRUPolicy(), [1, 1])
    cache.get(0, 3)
    cache.get(1, 3)
    assert cache.resident(0) == [3] and cache.resident(1) == [3]


def test_unknown_policy():
    with pytest.raises(InferError, match="lru, lfu, score"):
        make_policy("fifo")


# ---------------------------------------------------------------------------------------
# Slots across layers
# ---------------------------------------------------------------------------------------


def test_allocate_uniform():
    assert allocate(64, 6, 32) == [11, 11, 11, 11, 10, 10]
    assert allocate(1000, 4, 8) == [8, 8, 8, 8]
    assert allocate(0, 3, 8) == [0, 0, 0]


def test_allocate_shallow_favouring():
    a = allocate(64, 6, 32, "shallow")
    assert sum(a) == 64 and a == sorted(a, reverse=True)
    assert a[0] == 2 * a[-1]
    # the first layer is capped at n_experts; its excess moves deeper
    a = allocate(120, 4, 32, "shallow")
    assert a == [32, 32, 32, 24]
    assert allocate(10, 1, 32, "shallow") == [10]
    with pytest.raises(InferError, match="uniform or shallow"):
        allocate(10, 2, 4, "deep")


# ---------------------------------------------------------------------------------------
# Prefetch
# ---------------------------------------------------------------------------------------


def test_prefetch_precision_recall_arithmetic():
    cache, loads = make_cache(LRUPolicy(), [4, 4])
    cache.prefetch(1, [0, 1, 2])
    assert cache.resident(1) == [0, 1, 2]
    gets(cache, 1, [0, 3])
    st = cache.stats[1]
    assert (st.predicted, st.predicted_used, st.prefetched, st.prefetch_used) == (3, 1, 3, 1)
    assert (st.hits, st.misses, st.bytes_read) == (1, 1, 40)
    assert st.precision == pytest.approx(1 / 3) and st.recall == pytest.approx(1 / 2)
    # next visit: both predictions are resident already, so nothing is read
    cache.prefetch(1, [0, 3])
    cache.get(1, 3)
    assert (st.predicted, st.predicted_used, st.prefetched, st.uses) == (5, 2, 3, 3)
    assert st.precision == pytest.approx(2 / 5) and st.recall == pytest.approx(2 / 3)
    assert len(loads) == 4
    tot = cache.totals()
    assert isinstance(tot, CacheStats) and tot.predicted == 5 and cache.stats[0].uses == 0


def test_prefetch_never_evicts_the_current_layers_experts():
    cache, _ = make_cache(LRUPolicy(), [2])
    gets(cache, 0, [0, 1])
    cache.prefetch(0, [2])  # both slots are in use by this layer: no room
    assert cache.resident(0) == [0, 1] and cache.stats[0].prefetched == 0
    cache.release()
    cache.prefetch(0, [2])
    assert cache.resident(0) == [1, 2]


def test_prefetch_keeps_its_own_predictions():
    cache, _ = make_cache(LRUPolicy(), [2])
    cache.prefetch(0, [5, 6, 7])  # 7 would have to evict 5 or 6, predicted in the same call
    assert cache.resident(0) == [5, 6] and cache.stats[0].prefetched == 2


def test_get_waits_for_a_prefetch_in_flight():
    gate, started, calls = threading.Event(), threading.Event(), []

    def load(layer, e):
        calls.append((layer, e))
        started.set()
        assert gate.wait(5)
        return e * 10

    with ThreadPoolExecutor(1) as pool:
        cache = ExpertCache(load, [2], LRUPolicy(), 8, submit=pool.submit)
        cache.prefetch(0, [3])
        assert started.wait(5)
        threading.Timer(0.05, gate.set).start()
        assert cache.get(0, 3) == 30
    st = cache.stats[0]
    assert calls == [(0, 3)] and st.hits == 1 and st.prefetch_used == 1
    assert st.stall_s > 0 and st.bytes_read == 8


def test_ready_says_whether_get_would_wait_and_counts_nothing():
    gate = threading.Event()

    def load(layer, e):
        assert gate.wait(5)
        return e

    with ThreadPoolExecutor(1) as pool:
        cache = ExpertCache(load, [2], LRUPolicy(), 8, submit=pool.submit)
        assert not cache.ready(0, 3)  # not in memory, not being read
        cache.prefetch(0, [3])
        assert not cache.ready(0, 3)  # being read
        gate.set()
        pool.submit(lambda: None).result()  # the read is done
        assert cache.ready(0, 3)
        assert cache.totals().uses == 0
        assert cache.get(0, 3) == 3 and cache.ready(0, 3)


def test_failed_read_raises_and_frees_the_slot():
    fail = {3}

    def load(layer, e):
        if e in fail:
            raise OSError(f"bad read {e}")
        return e

    with ThreadPoolExecutor(1) as pool:
        cache = ExpertCache(load, [2], LRUPolicy(), 8, submit=pool.submit)
        cache.prefetch(0, [3])
        with pytest.raises(OSError, match="bad read 3"):
            cache.get(0, 3)
    assert cache.resident(0) == []
    fail.clear()
    assert cache.get(0, 3) == 3 and cache.resident(0) == [3]
    with pytest.raises(OSError):
        fail.add(4)
        cache.get(0, 4)
    assert cache.resident(0) == [3] and cache.stats[0].bytes_read == 8


def test_prefetch_after_the_reader_shut_down():
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    cache = ExpertCache(lambda layer, e: e, [2], LRUPolicy(), submit=pool.submit)
    with pytest.raises(RuntimeError, match="shutdown"):
        cache.prefetch(0, [1, 2])
    assert cache.resident(0) == []  # no slot left waiting for a read that never comes
    assert cache.get(0, 1) == 1


# ---------------------------------------------------------------------------------------
# Traces: live run versus replay
# ---------------------------------------------------------------------------------------

LAYERS, EXPERTS, TOP_K, HIDDEN, WIDTH = 3, 8, 2, 32, 16


def tiny_moe():
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # routers initialised near zero route almost uniformly: sharpen
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20)
    return model


def decode_with_cache(model, cache, recorder, prompt, n_new):
    """Greedy decoding, one token per forward; each MoE layer computes from cache.get()."""
    layers = model.model.layers

    def router(layer, x):  # (1, H) -> (E,) probabilities
        return torch.softmax(x @ layers[layer].mlp.gate.weight.T, -1)[0]

    def moe_hook(mod, args, out):
        x = args[0].reshape(-1, HIDDEN)  # (1, H): one token
        layer = mod.layer_id
        probs = router(layer, x)
        w, ids = probs.topk(TOP_K)
        w = w / w.sum()
        pred = router(layer + 1, x).topk(TOP_K).indices if layer + 1 < LAYERS else None
        recorder.record(
            layer, ids[None], w[None], probs[None], None if pred is None else pred[None]
        )
        values = visit(cache, layer, ids, probs.numpy(), () if pred is None else pred)
        y = torch.zeros_like(x)
        for e, (g, u, d) in values.items():  # ascending ids, as transformers adds them
            y += w[ids.tolist().index(e)] * (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
        return y.reshape(out.shape)

    handles = []
    for i, layer in enumerate(layers):
        layer.mlp.layer_id = i
        handles.append(layer.mlp.register_forward_hook(moe_hook))
    ids, logits, past = list(prompt), [], None
    try:
        with torch.no_grad():
            for t in range(len(prompt) + n_new - 1):
                step = torch.tensor([[ids[t]]])
                out = model(input_ids=step, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits.append(out.logits[0, -1])
                if t >= len(prompt) - 1:
                    ids.append(int(out.logits[0, -1].argmax()))
    finally:
        for h in handles:
            h.remove()
    return ids, torch.stack(logits)


def expert_loader(model):
    def load(layer, e):  # (gate, up, down) of one expert, copied as a disk read would be
        ex = model.model.layers[layer].mlp.experts
        gate, up = ex.gate_up_proj[e].detach().clone().chunk(2, dim=0)
        return gate, up, ex.down_proj[e].detach().clone()

    return load, 3 * WIDTH * HIDDEN * 4


@pytest.mark.parametrize("name", ["lru", "lfu", "score"])
def test_live_run_equals_resident_and_replay(tmp_path, name):
    model = tiny_moe()
    load, nbytes = expert_loader(model)
    slots = allocate(9, LAYERS, EXPERTS, "shallow")
    cache = ExpertCache(load, slots, make_policy(name), nbytes, unslotted=TOP_K)
    rec = TraceRecorder(LAYERS, EXPERTS, meta={"policy": name})
    prompt = [5, 17, 33, 2, 60, 41]
    ids, logits = decode_with_cache(model, cache, rec, prompt, 14)

    # the cached run computes what the resident model computes
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    live = cache.totals()
    assert live.evictions > 0 and live.hits > 0 and live.prefetched > 0

    path = tmp_path / "trace.npz"
    rec.trace().save(path)
    trace = Trace.load(path)
    assert trace.experts.shape == (len(ids) - 1, LAYERS, TOP_K)
    assert (trace.predicted[:, -1] == -1).all() and trace.meta == {"policy": name}
    again = replay(trace, name, slots, expert_bytes=nbytes)
    for mine, theirs in zip(again.stats, cache.stats):
        assert mine == CacheStats(**{**vars(theirs), "stall_s": mine.stall_s})


def test_replay_without_prefetch_and_from_weights_only():
    rng = np.random.default_rng(0)
    rec = TraceRecorder(2, 6)
    for _ in range(50):
        for layer in range(2):
            e = rng.choice(6, 2, replace=False)
            rec.record(layer, e[None], [[0.6, 0.4]], predicted=e[None])
    trace = rec.trace()
    assert trace.probs is None
    assert trace.scores(0, 0)[trace.experts[0, 0]].tolist() == pytest.approx([0.6, 0.4])
    no = replay(trace, "score", 6, prefetch=False).totals()
    assert no.predicted == 0 and no.prefetched == 0 and no.uses == 200
    full = replay(trace, "lru", 12, prefetch=False).totals()
    assert full.misses == 12  # all experts fit: only cold misses


def test_bad_trace_files(tmp_path):
    with pytest.raises(InferError, match="no trace file"):
        Trace.load(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InferError, match="not a routing trace"):
        Trace.load(tmp_path / "bad.npz")


# ---------------------------------------------------------------------------------------
# Experts served from disk through the cache (offload/experts.py)
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE (MoE layers 1 and 3 of 4, 8 experts, top 2) in our format, int8."""
    root = tmp_path_factory.mktemp("moe")
    return int8_checkpoint("qwen3_moe", root)


def int8_checkpoint(arch: str, root):
    import subprocess
    import sys

    from tiny import make_hf_model

    make_hf_model(arch, root / "hf")
    cmd = [sys.executable, "-m", "infer.cli.main", "quantize", root / "hf", "-o", root / "q"]
    r = subprocess.run([*cmd, "--to", "int8"], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return root / "q"


def run_tokens(model, tokens, prompt_len):
    """Logits of a prompt in one forward, then one token at a time."""
    session = Session(model)
    out = [session.forward(tokens[:prompt_len], 0, all_logits=True)]
    for pos in range(prompt_len, len(tokens)):
        out.append(session.step(tokens[pos])[None])
    return torch.cat(out)


TOKENS = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140, 8, 8, 300, 41, 12, 190, 77, 6]


@pytest.mark.parametrize(("name", "slots", "prefetch"), [("lfu", 5, True), ("lru", 4, False)])
def test_expert_cached_model_equals_resident(moe_checkpoint, name, slots, prefetch):
    from infer.offload.experts import load_expert_cached
    from infer.runtime.files.checkpoint import read_checkpoint
    from infer.runtime.loader import load_model

    resident = load_model(moe_checkpoint, max_seq_len=64).model
    expected = run_tokens(resident, TOKENS, 6)
    rec = TraceRecorder(2, 8)
    ckpt = read_checkpoint(moe_checkpoint)
    model, off = load_expert_cached(
        ckpt,
        torch.float32,
        64,
        slots,
        policy=name,
        prefetch=prefetch,
        recorder=rec,
        refine=0,
        ahead=1,  # Fate's next-layer guess alone: its arithmetic below
    )
    try:
        assert off.layer_ids == [1, 3]
        # nothing of the experts is in the model until a block runs one
        assert all(p.is_meta for n, p in model.named_parameters() if ".experts." in n)
        got = run_tokens(model, TOKENS, 6)
    finally:
        off.close()
    assert torch.equal(got, expected)  # the same tensors, read instead of mapped
    live = off.cache.stats
    tot = off.cache.totals()
    assert tot.misses > 0 and tot.hits > 0 and tot.evictions > 0
    assert tot.bytes_read == (tot.misses + tot.prefetched) * off.expert_bytes
    # The trace has a row per token, the prompt's too; the live run predicted the union
    # of the prompt's rows once, then each decoded token's top 2.
    trace = rec.trace()
    assert trace.n_tokens == len(TOKENS)
    assert (trace.predicted[:, 0] >= 0).all() and (trace.predicted[:, 1] == -1).all()
    n_predicted = len(set(trace.predicted[:6, 0].ravel().tolist())) + 2 * (len(TOKENS) - 6)
    assert (tot.prefetched > 0) == prefetch
    assert live[1].predicted == (n_predicted if prefetch else 0)


def test_expert_cached_decode_replays_exactly(moe_checkpoint, tmp_path):
    from infer.offload.experts import load_expert_cached
    from infer.runtime.files.checkpoint import read_checkpoint

    rec = TraceRecorder(2, 8)
    model, off = load_expert_cached(
        read_checkpoint(moe_checkpoint), torch.float32, 64, 6, policy="score", recorder=rec,
        cancel=False,
    )  # fmt: skip
    try:
        run_tokens(model, TOKENS, 1)  # every token alone: visits as a replay makes them
    finally:
        off.close()
    rec.trace().save(tmp_path / "t.npz")
    again = replay(Trace.load(tmp_path / "t.npz"), "score", off.cache.slots, off.expert_bytes)
    for mine, theirs in zip(again.stats, off.cache.stats):
        assert mine == CacheStats(**{**vars(theirs), "stall_s": mine.stall_s})


def test_expert_cache_needs_one_unit_per_expert(moe_checkpoint):
    import dataclasses

    from infer.offload.experts import load_expert_cached
    from infer.runtime.files.checkpoint import read_checkpoint

    ckpt = read_checkpoint(moe_checkpoint)
    units = {u: n for u, n in ckpt.units.items() if u != "layers.3.mlp.experts.5"}
    with pytest.raises(InferError, match="no unit 'layers.3.mlp.experts.5'"):
        load_expert_cached(dataclasses.replace(ckpt, units=units), torch.float32, 64, 4)
    with pytest.raises(InferError, match="3 slot counts for 2 MoE layers"):
        load_expert_cached(ckpt, torch.float32, 64, [1, 1, 1])


def test_start_cancels_wrong_predictions_not_yet_begun():
    queued = []

    class Handle:
        def __init__(self, fn, args):
            self.fn, self.args, self.state = fn, args, "queued"

        def cancel(self):
            if self.state == "queued":
                self.state = "cancelled"
            return self.state == "cancelled"

    def submit(fn, *args):
        queued.append(Handle(fn, args))
        return queued[-1]

    cache, loads = make_cache(LRUPolicy(), [4, 4], submit=submit, cancel=True)
    cache.prefetch(1, [0, 1, 2])
    queued[0].state = "running"  # a reader took expert 0's read: it cannot be cancelled
    queued[0].fn(*queued[0].args)
    cache.start(1, [1, 3])  # 2 is dropped; 1 is used; 3 is a miss: queued as a read
    st = cache.stats[1]
    assert (st.prefetched, st.cancelled) == (2, 1) and cache.resident(1) == [0, 1, 3]
    for h in queued[1:]:
        if h.state == "queued":
            h.state = "running"
            h.fn(*h.args)
    assert [cache.get(1, e) for e in (1, 3)] == ["L1E1", "L1E3"]
    assert (st.hits, st.misses, st.prefetch_used, st.predicted_used) == (1, 1, 1, 1)
    assert sorted(loads) == [(1, 0), (1, 1), (1, 3)]  # 2 was never read


def test_read_queue_runs_urgent_reads_first_and_cancels():
    from infer.offload.expert_io import ReadQueue

    gate, order = threading.Event(), []
    q = ReadQueue(1)
    try:
        q.submit(gate.wait, 5)  # occupies the only thread
        a = q.submit(order.append, "prefetch a")
        b = q.submit(order.append, "prefetch b")
        q.urgent(order.append, "urgent")
        assert b.cancel() and b.cancel()
        gate.set()
        deadline = time.monotonic() + 5
        while len(order) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["urgent", "prefetch a"] and not a.cancel()
    finally:
        q.shutdown()
    with pytest.raises(InferError, match="closed"):
        q.submit(order.append, "late")
