"""Layer streaming under a memory budget (offload/): streamed equals resident, the budget
arithmetic, the reader's faults and shutdown, the footprint, the CLI."""

import _thread
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import transformers
from tiny import ARCHS, COMMON, make_hf_model, write_tokenizer

from infer import InferError
from infer.offload.budget import LayerCost, Overheads, minimum_bytes, parse_size, plan_memory
from infer.offload.footprint import cached_bytes, footprint
from infer.offload.reader import UnitReader, alloc_buffer
from infer.offload.stream import layer_costs, layer_units, load_streamed, overheads
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.files.build import build
from infer.runtime.files.checkpoint import read_checkpoint, save_checkpoint
from infer.runtime.files.sources import CheckpointSource, open_source
from infer.runtime.loader import load_model
from infer.runtime.session import Session

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200]
SOURCE = {"path": "/src", "sha256": {}, "format": "safetensors"}
INFER = [sys.executable, "-c", "from infer.cli.main import main; main()"]


def make_hf(path, n_layers=4, **overrides):
    """A random Llama HF directory with `n_layers` (tiny.py's are 2: too few to stream)."""
    config = transformers.LlamaConfig(
        **{**COMMON, **ARCHS["llama"][1], "num_hidden_layers": n_layers, **overrides}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def convert(src, dest, recipe=None, dtype=torch.float32):
    """Our checkpoint of HF dir `src`: float (stored as `dtype`) or quantized by `recipe`."""
    info = open_source(src)
    model = build(info, torch.float32, 64)
    if recipe:
        quantize_model(model, get_recipe(recipe, n_layers=info.args.n_layers))
    else:
        model.to(dtype)
    save_checkpoint(model, info.config, info.tokenizer(), dest, source=SOURCE)
    return dest


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("offload") / "hf")


@pytest.fixture(scope="module")
def ckpts(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpts")
    return {
        "f32": convert(hf, out / "f32"),
        "bf16": convert(hf, out / "bf16", dtype=torch.bfloat16),  # converted when bound
        "int8": convert(hf, out / "int8", "int8"),
        "int4": convert(hf, out / "int4", "int4"),
    }


def min_budget(ckpt, dtype=torch.float32, ctx=64):
    """The smallest budget load_streamed accepts, with the process counted as 0 bytes."""
    costs = layer_costs(ckpt, layer_units(ckpt, ckpt.args.n_layers), dtype)
    return minimum_bytes(costs, overheads(ckpt, ckpt.args, dtype, ctx, 0)), costs


def run(model, steps=3, fused=True):
    """Prefill logits of PROMPT, then greedy decode logits one token at a time.
    fused=False: decode block by block, as a streamed model does."""
    session = Session(model)
    if not fused:
        session.fused = None
    out = [session.forward(PROMPT, 0, all_logits=True)]
    pos = len(PROMPT)
    for _ in range(steps):
        token = int(out[-1][-1].argmax())
        out.append(session.step(token)[None])
        pos += 1
    return out


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def resident(ckpt, dtype=torch.float32):
    return build(CheckpointSource(ckpt), dtype, 64)


def stop_threads(stream):
    threads = stream.reader._threads
    stream.close()
    assert not any(t.is_alive() for t in threads)


# -- sizes and the budget arithmetic ------------------------------------------------------


def test_parse_size():
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("800MB") == 800_000_000
    assert parse_size("2g") == 2 * 2**30 and parse_size(" 512 M ") == 512 * 2**20
    assert parse_size("123456") == 123456
    for bad in ("", "GB", "2XB", "-1GB", "0MB", "1.2.3GB"):
        with pytest.raises(InferError, match="invalid size"):
            parse_size(bad)


FIXED = Overheads(process=300, globals=50, kv_cache=20, scratch=30)  # total 400


def layers(n, size=100, convert=0):
    return [LayerCost(f"layers.{i}", size, size + convert, convert) for i in range(n)]


@pytest.mark.parametrize(
    "budget, pinned, slots",
    [
        (400 + 1000, 10, 0),  # everything fits: nothing streams
        (400 + 999, 5, 4),  # the window first (4 slots), then the most pins beside it
        (400 + 900, 5, 4),
        (400 + 400, 0, 4),
        (400 + 399, 0, 3),  # a smaller window before refusing
        (400 + 299, 0, 2),  # the minimum: nothing pinned, one layer read ahead
        (400 + 200, 0, 2),
    ],
)
def test_plan_uniform_layers(budget, pinned, slots):
    plan = plan_memory(layers(10), FIXED, budget)
    assert plan.pinned == tuple(f"layers.{i}" for i in range(pinned))  # a prefix
    assert plan.streamed == tuple(f"layers.{i}" for i in range(pinned, 10))
    assert plan.slots == slots and plan.window == max(slots - 1, 0)
    assert plan.streamed_bytes == 100 * (10 - pinned)
    assert plan.footprint <= budget


def test_plan_conversion_and_few_layers():
    # Converted layers: pinned they cost their bytes and the converted copy (250 here);
    # streamed, a slot of their bytes plus one shared conversion buffer (150).
    plan = plan_memory(layers(10, size=100, convert=150), FIXED, 400 + 1100)
    assert len(plan.pinned) == 2 and plan.slots == 4 and plan.convert_bytes == 150
    assert plan.footprint == 400 + 2 * 250 + 4 * 100 + 150 <= plan.budget
    # Never more slots than streamed layers.
    few = plan_memory(layers(3), FIXED, 400 + 299)  # all three would fit at 700
    assert len(few.pinned) == 0 and few.slots == 2
    assert plan_memory(layers(3), FIXED, 400 + 250, max_slots=8).slots == 2


def test_plan_uneven_layers_slots_fit_the_largest_streamed():
    costs = layers(10)
    costs[9] = LayerCost("layers.9", 300, 300, 0)  # 1200 in all
    plan = plan_memory(costs, FIXED, 400 + 650)  # 1 pinned + 2 x 300 would be 700
    assert plan.pinned == () and plan.slots == 2 and plan.slot_bytes == 300
    # Pinning a large first layer costs less than two buffers its size.
    costs = [LayerCost("layers.0", 500, 500, 0)] + layers(6)[1:]
    assert minimum_bytes(costs, FIXED) == 400 + 500 + 2 * 100
    plan = plan_memory(costs, FIXED, 400 + 700)
    assert plan.pinned == ("layers.0",) and plan.slot_bytes == 100


def test_plan_refuses_below_minimum_and_names_it():
    assert minimum_bytes(layers(10), FIXED) == 600
    with pytest.raises(InferError) as e:
        plan_memory(layers(10), FIXED, 599)
    msg = str(e.value)
    assert "minimum working set of 600 B" in msg and "\n" not in msg
    big = [LayerCost(f"layers.{i}", 10**8, 10**8, 0) for i in range(4)]
    fixed = Overheads(process=3 * 10**8, globals=10**8, kv_cache=0, scratch=0)
    with pytest.raises(InferError, match=r"minimum working set of 600.00 MB.*--max-memory 600MB"):
        plan_memory(big, fixed, 10**8)


# -- streamed equals resident ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["f32", "bf16", "int8", "int4"])
def test_streamed_equals_resident_one_layer_window(ckpts, kind):
    ckpt = read_checkpoint(ckpts[kind])
    budget, _ = min_budget(ckpt)
    model, stream, plan = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    assert plan.pinned == () and plan.slots == 2 and plan.window == 1
    assert Session(model).fused is None
    try:
        expected = run(resident(ckpt), fused=False)
        for _ in range(2):  # twice: the window wraps round to the first layer again
            got = run(model)
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
        # The fused C decode step (resident only) agrees to rounding.
        fused = run(resident(ckpt))
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fused, got))
        s = stream.snapshot()
        assert s.passes == 8 and s.bytes_read >= 8 * plan.streamed_bytes
        # Streamed layers are meta between uses: nothing of them stays bound.
        assert all(p.is_meta for p in model.layers[1].parameters())
    finally:
        stop_threads(stream)


@pytest.mark.parametrize("kind", ["f32", "int8"])
def test_streamed_equals_resident_in_bfloat16(ckpts, kind):
    # float32 tensors in the file, bfloat16 compute: streamed layers are converted into
    # one preallocated buffer when bound (the norms of int8, every weight of f32).
    ckpt = read_checkpoint(ckpts[kind])
    budget, _ = min_budget(ckpt, torch.bfloat16)
    model, stream, plan = load_streamed(ckpt, torch.bfloat16, 64, budget, process_bytes=0)
    assert plan.convert_bytes > 0 and plan.streamed
    try:
        expected = run(resident(ckpt, torch.bfloat16), fused=False)
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model)))
        assert model.layers[1].input_layernorm.weight.is_meta
    finally:
        stop_threads(stream)


@pytest.mark.parametrize("recipe", [None, "int8"])
def test_moe_layers_stream_with_their_experts(tmp_path, recipe):
    # Each expert is its own unit ("layers.N.mlp.experts.E"): a streamed layer is read
    # as its units into one buffer, back to back.
    src = tmp_path / "hf"
    make_hf_model("qwen3_moe", src)
    ckpt = read_checkpoint(convert(src, tmp_path / "ck", recipe))
    assert "layers.1.mlp.experts.7" in ckpt.ranges
    budget, _ = min_budget(ckpt)
    model, stream, plan = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    assert len(plan.streamed) >= 3
    try:
        expected = run(resident(ckpt), fused=False)
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(expected, run(model)))
    finally:
        stop_threads(stream)


def test_pinned_prefix_and_naive_mode_equal_resident(ckpts):
    ckpt = read_checkpoint(ckpts["int8"])
    base, costs = min_budget(ckpt)
    expected = run(resident(ckpt), fused=False)
    budget = base + costs[0].resident_bytes  # one pinned layer (a third slot is larger)
    model, stream, plan = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    assert plan.pinned == ("layers.0",) and len(plan.streamed) == 3
    assert not model.layers[0].mlp.up_proj.qweight.is_meta
    assert ckpt.is_mapped(model.layers[0].mlp.up_proj.qweight)  # pinned: the file map
    try:
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model)))
    finally:
        stop_threads(stream)
    naive, stream, plan = load_streamed(
        ckpt, torch.float32, 64, base, process_bytes=0, prefetch=False
    )
    assert plan.slots == 1 and plan.pinned == ()
    try:
        assert all(torch.equal(a, b) for a, b in zip(expected, run(naive)))
        # Every layer once per pass (prefill + 3 steps); the file's last unit reads short.
        read = stream.snapshot().bytes_read
        assert 4 * (plan.streamed_bytes - 4096) < read <= 4 * plan.streamed_bytes
    finally:
        stop_threads(stream)


def test_budget_for_everything_is_a_resident_load(ckpts):
    ckpt = read_checkpoint(ckpts["int8"])
    model, stream, plan = load_streamed(ckpt, torch.float32, 64, 10**12, process_bytes=0)
    assert stream is None and plan.streamed == ()
    assert Session(model).fused is not None  # over the real tensors
    expected = run(resident(ckpt))
    assert all(torch.equal(a, b) for a, b in zip(expected, run(model)))


# -- faults: Ctrl-C, errors, a file changing ---------------------------------------------


def test_interrupted_pass_resyncs(ckpts):
    ckpt = read_checkpoint(ckpts["int8"])
    budget, _ = min_budget(ckpt)
    model, stream, _ = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    expected = run(resident(ckpt), fused=False)
    calls = []

    def interrupt(module, args):
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt

    handle = model.layers[2].mlp.register_forward_pre_hook(interrupt)  # mid-layer
    try:
        with pytest.raises(KeyboardInterrupt), torch.inference_mode():
            model(torch.tensor([PROMPT]), 0, model.new_cache())
        handle.remove()
        # The next pass starts the window again at the first layer.
        assert all(torch.equal(a, b) for a, b in zip(expected, run(model)))
        assert all(p.is_meta for p in model.layers[2].parameters())
        assert stream.reader.alive()
    finally:
        stop_threads(stream)


def test_ctrl_c_while_waiting_for_a_read(ckpts, monkeypatch):
    ckpt = read_checkpoint(ckpts["int8"])
    budget, _ = min_budget(ckpt)
    model, stream, _ = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    read = stream.reader._read
    monkeypatch.setattr(stream.reader, "_read", lambda u, b: (time.sleep(0.3), read(u, b)))
    timer = threading.Timer(0.1, _thread.interrupt_main)  # Ctrl-C in the main thread
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), torch.inference_mode():
        model(torch.tensor([PROMPT]), 0, model.new_cache())
    assert time.monotonic() - t0 < 2
    stop_threads(stream)  # reads in flight finish, the workers exit
    with pytest.raises(InferError, match="closed"), torch.inference_mode():
        model(torch.tensor([PROMPT]), 0, model.new_cache())


def test_corrupt_unit_is_an_error_not_a_hang(hf, tmp_path):
    dest = convert(hf, tmp_path / "bad", "int8")
    ckpt = read_checkpoint(dest)
    b, e = ckpt.ranges["layers.3"]
    with open(ckpt.file, "r+b") as f:
        f.seek((b + e) // 2)
        byte = f.read(1)
        f.seek((b + e) // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    ckpt = read_checkpoint(dest)  # the identity the reader checks is the changed file's
    budget, _ = min_budget(ckpt)
    model, stream, _ = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    try:
        for _ in range(2):  # again after the failed pass: the same clear error
            with pytest.raises(InferError, match=r"unit 'layers.3' is corrupt \(crc32"):
                run(model)
        assert stream.reader.alive()
    finally:
        stop_threads(stream)


@pytest.mark.parametrize("change", ["rewrite", "replace", "truncate", "delete"])
def test_file_changing_under_the_stream_is_detected(hf, tmp_path, change):
    dest = convert(hf, tmp_path / "ck", "int8")
    ckpt = read_checkpoint(dest)
    budget, _ = min_budget(ckpt)
    model, stream, _ = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    try:
        run(model, steps=1)
        file = ckpt.file
        if change == "rewrite":  # same bytes, written again in place: a new mtime
            data = file.read_bytes()
            time.sleep(0.01)
            file.write_bytes(data)
        elif change == "replace":  # a new file renamed over the old one: a new inode
            tmp = file.with_suffix(".new")
            tmp.write_bytes(file.read_bytes())
            os.replace(tmp, file)
        elif change == "truncate":
            os.truncate(file, ckpt.ranges["layers.2"][0])
        else:
            file.unlink()
        word = "vanished" if change == "delete" else "changed"
        with pytest.raises(InferError, match=f"model file {word} while streaming"):
            run(model, steps=1)
    finally:
        stop_threads(stream)


def test_reader_times_out_instead_of_hanging(ckpts, monkeypatch):
    ckpt = read_checkpoint(ckpts["int8"])
    reader = UnitReader(ckpt.file, ckpt.ranges, ckpt.crc32, timeout=0.3)
    release = threading.Event()
    read = reader._read
    monkeypatch.setattr(reader, "_read", lambda u, b: (release.wait(5), read(u, b)))
    buf = alloc_buffer(ckpt.ranges["layers.0"][1] - ckpt.ranges["layers.0"][0])
    t0 = time.monotonic()
    with pytest.raises(InferError, match=r"reading 'layers.0' took more than 0 s"):
        reader.read("layers.0", buf)
    assert time.monotonic() - t0 < 2
    release.set()
    reader.close()
    assert not any(t.is_alive() for t in reader._threads)


def test_crc_on_first_read_or_every_read(hf, tmp_path):
    # "first" checks a unit's first read; later changes are caught by the file's identity
    # (mtime, size, inode). A byte changed in place with the mtime put back is caught
    # only by "always".
    ckpt = read_checkpoint(convert(hf, tmp_path / "ck", "int8"))
    b, e = ckpt.ranges["layers.1"]
    buf = alloc_buffer(e - b)

    def flip():
        st = os.stat(ckpt.file)
        with open(ckpt.file, "r+b") as f:
            f.seek(b + 100)
            byte = f.read(1)
            f.seek(b + 100)
            f.write(bytes([byte[0] ^ 1]))
        os.utime(ckpt.file, ns=(st.st_atime_ns, st.st_mtime_ns))

    for check in ("first", "always"):
        with UnitReader(ckpt.file, ckpt.ranges, ckpt.crc32, check=check) as reader:
            reader.read("layers.1", buf)
            flip()
            try:
                if check == "always":
                    with pytest.raises(InferError, match="'layers.1' is corrupt"):
                        reader.read("layers.1", buf)
                else:
                    reader.read("layers.1", buf)
            finally:
                flip()


@pytest.mark.parametrize("direct", [True, False])
def test_reader_reads_units_exactly(ckpts, direct):
    ckpt = read_checkpoint(ckpts["int4"])
    data = ckpt.file.read_bytes()
    with UnitReader(ckpt.file, ckpt.ranges, ckpt.crc32, direct=direct) as reader:
        assert reader.method == ("O_DIRECT" if direct else "pread+DONTNEED")
        t0 = time.perf_counter()
        for unit, (b, e) in ckpt.ranges.items():
            buf = alloc_buffer(e - b)
            reader.read(unit, buf)
            assert buf[: e - b] == data[b:e]
        assert 0 < reader.stats.busy_s <= time.perf_counter() - t0
        assert reader.stats.reads == len(ckpt.ranges)
        assert reader.stats.bytes >= sum(e - b for b, e in ckpt.ranges.values())


# -- the footprint -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A float32 model with 2.6 MB layers: large enough to see where its bytes go."""
    out = tmp_path_factory.mktemp("wide")
    make_hf(out / "hf", n_layers=8, hidden_size=256, intermediate_size=640)
    return convert(out / "hf", out / "f32")


def test_freed_activations_are_kept_only_without_a_budget(wide, monkeypatch):
    # a budget's plan counts what is in use: its freed blocks go back at once
    from infer.runtime import loader

    asked = []
    monkeypatch.setattr(loader, "reuse_freed_heap", lambda keep: asked.append(keep))
    load_model(wide, torch.float32, 64)
    load_model(wide, torch.float32, 64, max_memory=1 << 40)
    assert asked == [True, False]


def test_footprint_stays_under_the_budget(wide):
    ckpt = read_checkpoint(wide)
    drop_cache(ckpt.file)  # left by writing it
    _, costs = min_budget(ckpt)
    layer = costs[0].read_bytes
    before = footprint(ckpt.file)
    # Room for the fixed costs, four read buffers and two pinned layers (one if the
    # process grew by a layer's size since `before`).
    base = minimum_bytes(costs, overheads(ckpt, ckpt.args, torch.float32, 64, before))
    budget = base + 4 * layer + layer // 2
    lm = load_model(wide, torch.float32, 64, max_memory=budget)
    pinned = len(lm.plan.pinned)
    assert pinned in (1, 2) and lm.plan.slots == 4, lm.plan
    assert lm.plan.footprint <= budget
    try:
        for _ in range(3):
            run(lm.model)
        now = footprint(ckpt.file)
        assert now <= budget, (now, lm.plan)
        # Streamed reads bypass the page cache: only resident units' pages are cached.
        resident = ckpt.ranges["globals"][1] - ckpt.ranges["globals"][0] + pinned * layer
        assert cached_bytes(ckpt.file) <= resident + 2**20, lm.plan
        assert lm.stream.snapshot().bytes_read >= 3 * 4 * (8 - pinned) * layer
    finally:
        stop_threads(lm.stream)


def test_auto_stream_when_the_model_does_not_fit(wide, monkeypatch, capsys):
    import psutil

    real = psutil.virtual_memory()
    ckpt = read_checkpoint(wide)
    _, costs = min_budget(ckpt)
    fake = real._replace(available=int(sum(c.resident_bytes for c in costs) * 0.9))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    lm = load_model(wide, torch.float32, 64)
    assert lm.auto_budget and lm.stream is not None
    assert "does not fit in available memory" in capsys.readouterr().err
    stop_threads(lm.stream)


# -- the command line ----------------------------------------------------------------------


def infer(*args):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([*INFER, *args], capture_output=True, text=True, env=env, check=False)


@pytest.mark.slow
def test_cli_max_memory_end_to_end(wide):
    common = ["--no-chat", "-n", "6", "--temperature", "0", "--ctx", "64", "--json"]
    too_small = infer("run", str(wide), "hello", *common, "--max-memory", "50MB")
    assert too_small.returncode == 2
    lines = too_small.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory budget 50.00 MB is below")
    minimum = int(lines[0].rsplit("--max-memory ", 1)[1].removesuffix("MB")) * 10**6

    plain = infer("run", str(wide), "hello", *common)
    budget = f"{(minimum + 2 * 10**6) // 10**6}MB"  # at most one of 8 layers pinned
    streamed = infer("run", str(wide), "hello", *common, "--max-memory", budget, "-v")
    assert plain.returncode == 0 and streamed.returncode == 0, streamed.stderr
    assert json.loads(streamed.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert "streamed" in streamed.stderr and "stream: " in streamed.stderr

    bench = infer("bench", str(wide), "-p", "8", "-n", "4", "-r", "1", "--json",
                  "--max-memory", budget)  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    off = json.loads(bench.stdout)["offload"]
    assert off["layers_streamed"] >= 6 and off["read_method"] in ("O_DIRECT", "pread+DONTNEED")
    assert off["bytes_read_per_token"] >= off["streamed_bytes"] * 0.9


def test_other_formats_must_be_converted_to_stream(hf):
    """A Hugging Face directory (or a GGUF file) loads resident under a budget it fits in;
    under one it does not fit in, it cannot stream, and says what to do."""
    with pytest.raises(InferError, match="directory that needs about .* over the budget of "
                       "1.00 MB: .* convert it first: infer"):  # fmt: skip
        load_model(hf, torch.float32, 64, max_memory=10**6)
    lm = load_model(hf, torch.float32, 64, max_memory=100 * 10**9)
    assert lm.stream is None and lm.plan is None


def test_budget_module_is_torch_free():
    # The CLI parses --max-memory before torch is imported.
    code = "import sys, infer.offload.budget; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "False", out.stderr
