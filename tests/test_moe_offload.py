"""A mixture-of-experts model under a memory budget (offload/experts.py, expert_plan.py,
expert_store.py): the plan, outputs equal to the resident run at every cache size, the
footprint, traces, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from tiny import COMMON, MOE_ARCHS, write_tokenizer

from infer import InferError
from infer.offload.budget import Overheads
from infer.offload.expert_cache import CacheStats
from infer.offload.expert_plan import (
    ExpertCosts,
    budget_inputs,
    expert_costs,
    in_flight_buffers,
    minimum_budget,
    plan_experts,
)
from infer.offload.experts import load_expert_cached, load_moe_budgeted, prediction_options
from infer.offload.footprint import footprint
from infer.offload.stream import layer_costs, overheads
from infer.offload.trace import Trace, TraceRecorder, replay
from infer.runtime.files.checkpoint import read_checkpoint
from infer.runtime.loader import load_model
from infer.runtime.session import Session

INFER = [sys.executable, "-c", "from infer.cli.main import main; main()"]
TOKENS = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140, 8, 8, 300, 41, 12, 190, 77, 6]


def make_moe(root, name="qwen3_moe", quant="int8", **overrides):
    """A random Qwen3-MoE HF directory (router weights sharpened so routing varies from
    token to token), converted to our format by `infer quantize`."""
    cls_name, extra = MOE_ARCHS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("mlp.gate.weight"):
                p.mul_(20)
    model.save_pretrained(root / "hf")
    write_tokenizer(root / "hf")
    cmd = [*INFER, "quantize", str(root / "hf"), "-o", str(root / "q"), "--to", quant]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return root / "q"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """MoE layers 1 and 3 of 4, 8 experts each, top 2, int8."""
    return make_moe(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    """Every layer MoE, 16 experts of 256 x 512 (int8, 400 KB each, 25 MB in all): large
    enough for the footprint to show where expert bytes go."""
    return make_moe(
        tmp_path_factory.mktemp("wide_moe"),
        name="qwen3_moe_nonorm",
        hidden_size=256,
        moe_intermediate_size=512,
        num_experts=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=64,
    )


def run_tokens(model, tokens=TOKENS, prompt_len=6, fused=True, session=None):
    """Logits of a prompt in one forward, then one token at a time. fused=False decodes
    block by block, as a model whose dense layers stream does (the fused C step agrees
    with that to rounding)."""
    session = session or Session(model)
    if not fused:
        session.fused = None
    out = [session.forward(tokens[:prompt_len], 0, all_logits=True)]
    for pos in range(prompt_len, len(tokens)):
        out.append(session.step(tokens[pos])[None])
    return torch.cat(out)


def resident_logits(path, fused=True):
    """The resident model's logits (see run_tokens)."""
    return run_tokens(load_model(path, max_seq_len=64).model, fused=fused)


def fixed_costs(ckpt, process=0):
    args = ckpt.args
    fixed = overheads(ckpt, args, torch.float32, 64, process)
    dense = layer_costs(ckpt, [[f"layers.{i}"] for i in range(args.n_layers)], torch.float32)
    return fixed, dense


# -- the plan ------------------------------------------------------------------------------


def plan_inputs():
    fixed = Overheads(process=100, globals=50, kv_cache=20, scratch=30)  # total 200
    from infer.offload.budget import LayerCost

    dense = [LayerCost(f"layers.{i}", 40, 40, 0) for i in range(4)]  # 160 resident
    experts = ExpertCosts(read_bytes=10, memory_bytes=10, n_layers=4, n_experts=8, top_k=2)
    return fixed, dense, experts


def test_plan_gives_what_dense_leaves_to_expert_slots():
    fixed, dense, experts = plan_inputs()
    in_flight = in_flight_buffers(2, workers=3)  # 2 + 3 + 1
    assert in_flight == 6
    base = 200 + 160 + 6 * 10
    for extra, slots in ((0, 0), (9, 0), (10, 1), (125, 12), (10**6, 32)):
        plan = plan_experts(dense, fixed, experts, base + extra, workers=3, scheme="uniform")
        assert sum(plan.slots) == slots and not plan.dense.streamed
        assert plan.buffers == slots + 6 and plan.footprint <= base + extra
    plan = plan_experts(dense, fixed, experts, base + 125, workers=3, scheme="shallow")
    assert plan.slots == (4, 3, 3, 2)
    assert "12 of 32 experts cached" in plan.describe()


def test_plan_streams_dense_layers_when_even_they_do_not_fit():
    fixed, dense, experts = plan_inputs()
    plan = plan_experts(dense, fixed, experts, 200 + 60 + 120, workers=3)
    assert sum(plan.slots) == 0 and plan.dense.streamed and plan.footprint <= 380
    # the minimum: two of the 40-byte layers streamed (nothing pinned) and the 6 in flight
    minimum = 200 + 2 * 40 + 6 * 10
    with pytest.raises(InferError) as e:
        plan_experts(dense, fixed, experts, minimum - 1, workers=3)
    msg = str(e.value)
    assert "below this model's minimum working set" in msg and "6 experts in flight" in msg
    assert msg.endswith(f"--max-memory {-(-minimum // 10**6)}MB")
    plan_experts(dense, fixed, experts, minimum, workers=3)


def test_budget_sets_the_slots(moe):
    ckpt = read_checkpoint(moe)
    fixed, dense = fixed_costs(ckpt, process=10**8)
    costs = expert_costs(ckpt, torch.float32)
    assert costs.read_bytes % 4096 == 0 and costs.total == 16 and costs.top_k == 2
    base = fixed.total + sum(c.resident_bytes for c in dense)
    floor = in_flight_buffers(2, 4) * costs.memory_bytes
    budget = base + floor + 5 * costs.memory_bytes + costs.memory_bytes // 2
    _, off = load_moe_budgeted(ckpt, torch.float32, 64, budget, process_bytes=10**8)
    try:
        assert sum(off.cache.slots) == 5 and off.pool.n == 5 + in_flight_buffers(2, 4)
        assert off.plan.footprint <= budget and not off.plan.dense.streamed
    finally:
        off.close()
    with pytest.raises(InferError, match="minimum working set"):
        load_moe_budgeted(ckpt, torch.float32, 64, base // 2, process_bytes=10**8)


# -- outputs equal the resident run ----------------------------------------------------


@pytest.mark.slow
def test_every_cache_size_equals_resident(moe):
    expected = resident_logits(moe)
    ckpt = read_checkpoint(moe)
    for slots in range(17):
        model, off = load_expert_cached(ckpt, torch.float32, 64, slots, refine=2, workers=2)
        try:
            assert Session(model).fused is not None  # experts bound per visit (CachedExperts.bound)
            got = run_tokens(model)
        finally:
            off.close()
        assert torch.equal(got, expected), slots
        tot = off.cache.totals()
        assert tot.uses > 0 and (tot.hits == 0) == (slots == 0)
        assert off.pool.peak <= off.pool.n


@pytest.mark.parametrize("pattern", ["never", "always", "alternate"])
def test_experts_in_memory_run_in_one_call(moe, monkeypatch, pattern):
    """The fused step runs a visit's next expert together with those after it that are
    already in memory (its provider's ready), in one C call: the same sum, bit for bit."""
    expected = resident_logits(moe)
    ckpt = read_checkpoint(moe)
    model, off = load_expert_cached(ckpt, torch.float32, 64, 16, workers=2)
    session = Session(model)
    step, sizes = session.fused, []
    run = step._run_experts

    def counted(table, ids, *args, **kwargs):
        sizes.append(ids.shape[1])
        return run(table, ids, *args, **kwargs)

    monkeypatch.setattr(step, "_run_experts", counted)
    asked = []
    for block in off.blocks:
        ready = {"never": lambda e: False, "always": lambda e: True,
                 "alternate": lambda e: asked.append(e) or len(asked) % 2 == 0}[pattern]  # fmt: skip
        monkeypatch.setattr(block.provider, "ready", ready)
    try:
        assert torch.equal(run_tokens(model, session=session), expected)
    finally:
        off.close()
    visits = 2 * (len(TOKENS) - 6)  # 2 MoE layers, one token a step; k = 2
    assert sum(sizes) == 2 * visits
    assert sizes == {"never": [1] * 2 * visits, "always": [2] * visits}.get(pattern, sizes)
    if pattern == "alternate":  # asked about the second expert only: ready every other time
        assert sorted(set(sizes)) == [1, 2] and len(asked) == visits


def test_route_takes_the_visits_router_output(moe, monkeypatch):
    """An expert cache's hook runs each MoE block's router on its input for the
    prefetch; route() then takes that output instead of running the router again."""
    from infer.runtime.model.moe import MoE

    expected = resident_logits(moe)
    ckpt = read_checkpoint(moe)
    model, off = load_expert_cached(ckpt, torch.float32, 64, 6, workers=2)
    calls = []
    probs = MoE.probs
    monkeypatch.setattr(MoE, "probs", lambda self, x: calls.append(x.shape[0]) or probs(self, x))
    try:
        assert torch.equal(run_tokens(model), expected)
    finally:
        off.close()
    # once per visit: 2 MoE layers, the prompt once, then one token a step
    assert calls == [6, 6] + [1, 1] * (len(TOKENS) - 6)


def test_predictions_rank_as_the_router_does(moe):
    """guess() takes the router's logits' top k, and router_input drops the norm's
    1 / rms: neither changes which experts the router's softmax ranks first."""
    from infer.offload.routing import guess, guess_router, router_input

    model = load_model(moe, max_seq_len=64).model
    torch.manual_seed(1)
    for i in (1, 3):
        layer, block = model.layers[i], model.layers[i].mlp
        x = torch.randn(32, model.args.dim)
        want = block.probs(x).topk(4, dim=-1).indices
        assert torch.equal(guess(block, x, 4), want)
        # the int8 copy predictions use: the same top k (k = 2 here) for these inputs
        copy = guess_router(block)
        assert copy is not None and copy.qweight.dtype == torch.int8
        assert torch.equal(copy(x).topk(2).indices, want[:, :2])
        want = block.probs(layer.post_attention_layernorm(x)).topk(4, dim=-1).indices
        assert torch.equal(guess(block, router_input(layer, x), 4), want)


def test_budget_counts_the_routers_int8_copies(moe):
    from infer.offload.expert_plan import guess_router_bytes

    ckpt = read_checkpoint(moe)
    args = ckpt.args
    fixed, _ = fixed_costs(ckpt)
    got = budget_inputs(ckpt, torch.float32, 64, 0)[0]
    copies = guess_router_bytes(2, args.n_experts, args.dim)  # MoE layers 1 and 3
    assert copies == 2 * args.n_experts * (args.dim + 4)
    assert got.globals == fixed.globals + copies and got.total == fixed.total + copies
    _, off = load_expert_cached(ckpt, torch.float32, 64, 4)
    try:
        made = [g for g in off._guessers if g is not None]
        assert len(made) == 2
        assert sum(t.nbytes for g in made for t in g.tensors().values()) == copies
    finally:
        off.close()


@pytest.mark.slow
def test_shared_expert_and_dense_layer_equal_resident(tmp_path):
    """Qwen2-MoE: a shared expert beside the cached ones, and a dense layer between MoE
    layers; the fused step binds experts one at a time around them."""
    path = make_moe(tmp_path, name="qwen2_moe")
    expected = resident_logits(path)
    ckpt = read_checkpoint(path)
    for slots in (0, 5, 16):
        model, off = load_expert_cached(ckpt, torch.float32, 64, slots, workers=2)
        try:
            assert Session(model).fused is not None
            assert torch.equal(run_tokens(model), expected), slots
        finally:
            off.close()


def test_naive_and_streamed_dense_equal_resident(moe):
    expected = resident_logits(moe)
    ckpt = read_checkpoint(moe)
    model, off = load_expert_cached(ckpt, torch.float32, 64, 0, prefetch=False)
    try:
        assert torch.equal(run_tokens(model), expected)
        tot = off.cache.totals()
        assert tot.hits == 0 and tot.prefetched == 0 and tot.predicted == 0
    finally:
        off.close()
    # a budget below the dense parts: layers stream too (routers and norms stay resident),
    # and decode runs block by block
    fixed, dense, costs, routers = budget_inputs(ckpt, torch.float32, 64, 10**8)
    budget = minimum_budget(dense, fixed, costs, 4, routers) + 2**13
    model, off = load_moe_budgeted(ckpt, torch.float32, 64, budget, process_bytes=10**8)
    try:
        assert off.plan.dense.streamed and off.stream is not None
        assert Session(model).fused is None
        got = run_tokens(model)
        assert torch.equal(got, resident_logits(moe, fused=False))
        torch.testing.assert_close(
            got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item()
        )
        assert off.snapshot().dense_bytes_read > 0
    finally:
        off.close()


def test_float_experts_beside_quantized_attention(moe, tmp_path):
    """Offloaded experts the C cannot run (float) keep the whole model block by block,
    even where its attention could run fused."""
    from infer.quant.quantize import quantize_model
    from infer.runtime.files.build import build
    from infer.runtime.files.checkpoint import save_checkpoint
    from infer.runtime.files.sources import open_source

    info = open_source(moe.parent / "hf")
    model = build(info, torch.float32, 64)
    quantize_model(model, lambda name: {"format": "int8"} if ".self_attn." in name else None)
    source = {"path": "/src", "sha256": {}, "format": "safetensors"}
    dest = save_checkpoint(model, info.config, info.tokenizer(), tmp_path / "m", source=source)
    expected = resident_logits(dest)
    model, off = load_expert_cached(read_checkpoint(dest), torch.float32, 64, 5)
    try:
        assert Session(model).fused is None
        assert torch.equal(run_tokens(model), expected)
    finally:
        off.close()


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_float_experts_equal_resident(moe, tmp_path, stored):
    """Float experts are parameters (quantized ones buffers); bfloat16 ones are converted
    to the compute dtype as they are read."""
    from infer.runtime.files.build import build
    from infer.runtime.files.checkpoint import save_checkpoint
    from infer.runtime.files.sources import open_source

    info = open_source(moe.parent / "hf")
    model = build(info, torch.float32, 64).to(stored)
    source = {"path": "/src", "sha256": {}, "format": "safetensors"}
    dest = save_checkpoint(model, info.config, info.tokenizer(), tmp_path / "f", source=source)
    expected = resident_logits(dest)
    model, off = load_expert_cached(read_checkpoint(dest), torch.float32, 64, 5)
    try:
        assert torch.equal(run_tokens(model), expected)
        assert off.costs.memory_bytes > off.costs.read_bytes or stored == torch.float32
    finally:
        off.close()


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [1, 2])
def test_live_run_replays_to_the_same_counters(wide_moe, tmp_path, ahead):
    ckpt = read_checkpoint(wide_moe)
    rec = TraceRecorder(4, 16)
    model, off = load_expert_cached(
        ckpt, torch.float32, 64, 20, policy="lru", refine=2, width=3, ahead=ahead,
        recorder=rec, cancel=False,
    )  # fmt: skip
    try:
        run_tokens(model, prompt_len=1)  # one token per forward, as a replay visits
    finally:
        off.close()
    rec.trace().save(tmp_path / "t.npz")
    trace = Trace.load(tmp_path / "t.npz")
    assert trace.refined.shape == (len(TOKENS), 4, 2) and trace.predicted.shape[2] == 3
    assert trace.ahead.shape[2] == (3 if ahead == 2 else 0)
    assert (trace.ahead[:, :2] >= 0).all() and (trace.ahead[:, 2:] < 0).all()
    again = replay(trace, "lru", off.cache.slots, off.expert_bytes)
    for mine, theirs in zip(again.stats, off.cache.stats):
        assert mine == CacheStats(**{**vars(theirs), "stall_s": mine.stall_s})
    assert off.cache.stats[0].predicted > 0  # layer 0 is predicted on entry


def test_corrupt_expert_is_an_error_and_threads_stop(moe, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(moe, bad)
    ckpt = read_checkpoint(bad)
    b, _ = ckpt.ranges["layers.1.mlp.experts.3"]
    with open(ckpt.file, "r+b") as f:
        f.seek(b + 10)
        byte = f.read(1)
        f.seek(b + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    model, off = load_expert_cached(read_checkpoint(bad), torch.float32, 64, 4)
    threads = off.reader._threads
    cache = model.new_cache()
    with pytest.raises(InferError, match="'layers.1.mlp.experts.3' is corrupt"), torch.no_grad():
        for t in range(40):  # until expert 3 of layer 1 is routed to
            model(torch.tensor([[t * 7 % 300]]), t % 60, cache)
    off.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(InferError, match="closed"):
        model(torch.tensor([[1]]), 0, cache)


# -- the footprint ---------------------------------------------------------------------------


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


@pytest.mark.slow
def test_footprint_stays_under_the_budget(wide_moe):
    ckpt = read_checkpoint(wide_moe)
    drop_cache(ckpt.file)
    before = footprint(ckpt.file)
    fixed, dense = fixed_costs(ckpt, process=before)
    costs = expert_costs(ckpt, torch.float32)
    floor = in_flight_buffers(costs.top_k, 4) * costs.memory_bytes
    budget = fixed.total + sum(c.resident_bytes for c in dense) + floor + 16 * costs.memory_bytes
    lm = load_model(wide_moe, torch.float32, 64, max_memory=budget)
    off = lm.experts
    try:
        # about 16: the process's RSS at load differs a little from `before` (it grows
        # with imports, shrinks when the allocator returns memory), by a few experts
        slots = sum(off.cache.slots)
        assert off is not None and 10 <= slots <= 20 and off.plan.footprint <= budget
        for _ in range(2):
            run_tokens(lm.model)
        assert footprint(ckpt.file) <= budget
        t = off.cache.totals()
        assert t.misses > slots and t.bytes_read > slots * costs.read_bytes  # came and went
        assert off.pool.peak <= off.pool.n
    finally:
        off.close()


@pytest.mark.parametrize(
    "prediction,width,refine",
    [("all", 2, 2), ("entry", 0, 2), ("next", 2, 0), ("none", 0, 0)],  # the tiny model: k = 2
)
def test_each_prediction_equals_resident(moe, prediction, width, refine):
    expected = resident_logits(moe)
    ckpt = read_checkpoint(moe)
    assert ckpt.args.n_experts_per_tok == 2
    model, off = load_expert_cached(ckpt, torch.float32, 64, 6, **prediction_options(prediction))
    try:
        assert torch.equal(run_tokens(model), expected)
        assert (off.width, off.refine) == (width, refine)
        assert (off.cache.totals().predicted > 0) == (prediction != "none")
    finally:
        off.close()
    with pytest.raises(InferError, match="unknown expert prediction 'fate'"):
        prediction_options("fate")


# -- the command line ---------------------------------------------------------------------


def infer(*args):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([*INFER, *args], capture_output=True, text=True, env=env, check=False)


@pytest.mark.slow
def test_cli_budget_policy_trace_and_replay(wide_moe, tmp_path):
    model = str(wide_moe)
    common = ["--no-chat", "-n", "8", "--temperature", "0", "--ctx", "64", "--json"]
    too_small = infer("run", model, "hi", *common, "--max-memory", "1MB")
    assert too_small.returncode == 2
    lines = too_small.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory budget 1.00 MB is below")
    minimum = int(lines[0].rsplit("--max-memory ", 1)[1].removesuffix("MB"))
    budget = f"{minimum + 8}MB"  # ~20 of 64 experts of 0.4 MB cached

    plain = infer("run", model, "hello there", *common)
    assert plain.returncode == 0, plain.stderr
    trace = tmp_path / "run.npz"
    run = infer(
        "run", model, "hello there", *common, "--max-memory", budget,
        "--expert-policy", "lru", "--trace", str(trace), "-v",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert "experts cached" in run.stderr and "experts: lru" in run.stderr
    assert "hit rate" in run.stderr and "precision" in run.stderr
    entry = infer(
        "run", model, "hello there", *common, "--max-memory", budget,
        "--expert-prediction", "entry",
    )  # fmt: skip
    assert entry.returncode == 0, entry.stderr
    assert json.loads(entry.stdout)["text"] == json.loads(plain.stdout)["text"]
    bad = infer("run", model, "hi", *common, "--max-memory", budget, "--expert-prediction", "x")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    t = Trace.load(trace)
    assert t.n_layers == 4 and t.n_experts == 16 and t.n_tokens >= 8
    assert not list(tmp_path.glob("*.tmp"))

    rep = infer("bench", "--replay", str(trace), "--json")
    assert rep.returncode == 0, rep.stderr
    rows = json.loads(rep.stdout)["rows"]
    assert {r["policy"] for r in rows} == {"lru", "lfu", "score"} and len(rows) == 18
    assert all(0 <= r["hit_rate"] <= 1 for r in rows)
    table = infer("bench", "--replay", str(trace))
    assert table.returncode == 0 and "PRECISION / RECALL" in table.stdout

    bench = infer(
        "bench", model, "-p", "8", "-n", "6", "-r", "1", "--json",
        "--max-memory", budget, "--expert-policy", "score",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    ex = json.loads(bench.stdout)["experts"]
    assert ex["policy"] == "score" and ex["phase"] == "decode" and ex["tokens"] == 6
    assert len(ex["hit_rate_per_layer"]) == 4 and 0 <= ex["hit_rate"] <= 1
    assert ex["budget_bytes"] == (minimum + 8) * 10**6 and 10 <= sum(ex["slots"]) < 64
    assert ex["footprint_bytes"] <= ex["budget_bytes"]
    assert ex["bytes_read_per_token"] > 0 and ex["stall_s"] >= 0 and ex["read_gb_s"] > 0
    assert 0 <= ex["precision"] <= 1 and 0 <= ex["recall"] <= 1
    text = infer("bench", model, "-p", "8", "-n", "4", "-r", "1", "--max-memory", budget)
    assert text.returncode == 0 and "expert hit rate" in text.stdout


@pytest.mark.slow
def test_trace_of_a_resident_model_and_not_of_a_dense_one(moe, tmp_path):
    from tiny import make_hf_model

    out = tmp_path / "res.npz"
    r = infer("run", str(moe), "hi", "--no-chat", "-n", "4", "--temperature", "0", "--ctx", "32",
              "--trace", str(out), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    t = Trace.load(out)
    assert t.n_tokens >= 4 and t.probs is not None and (t.predicted[:, 0] >= 0).all()
    make_hf_model("llama", tmp_path / "dense")
    with pytest.raises(InferError, match="--trace needs a mixture-of-experts model"):
        load_model(tmp_path / "dense", max_seq_len=32, record_routing=True)
