"""Pipeline stages over worker processes on loopback (runtime/pipeline/): greedy output
over 2 and 3 stages equals the single-process run for a dense and a MoE model, float
(torch blocks) and quantized (each stage's decode on the fused C step) and the default
model's real file, so does the batched step of several sequences, and `infer serve
--workers` answers concurrent requests as one process does; a killed worker, a wrong
token and a differing model file each end with a one-line error. Every worker is killed
at the end."""

import hashlib
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from test_cli import assert_one_line_error
from test_server import Server
from tiny import make_hf_model

from infer.runtime.files.sources import open_source
from infer.runtime.generate import generate, make_sampler
from infer.runtime.loader import load_model
from infer.runtime.pipeline import handshake
from infer.runtime.pipeline.coordinator import assign_layers, load_pipelined
from infer.runtime.pipeline.link import Op, Pass
from infer.runtime.pipeline.stage import load_stage, stage_bytes
from infer.runtime.session import Session, decode, prefill_together, start_decode
from infer.runtime.speculative import LookupDrafter

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]
TOKEN = b"a shared secret of the test, 32B"
TIMEOUT = 60  # seconds for any one subprocess or wait
STARTUP = 180  # seconds for a process to start (torch's import, on a busy shared box)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "INFER_DEBUG"}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _infer(*args) -> list[str]:
    return [sys.executable, "-m", "infer.cli.main", *map(str, args)]


# Run argv[1:] with SIGKILL set to come when the test process ends, however it ends
# (PR_SET_PDEATHSIG, Linux; kept across exec): no worker outlives the tests.
DIE_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); os.execv(sys.executable, sys.argv[1:])"
)


class Worker:
    """An `infer worker` subprocess on a free loopback port; its stderr lines collected.
    Workers on one machine count at one speed (the split then follows memory alone)
    unless `speed` is None: then each measures its own."""

    def __init__(self, token_file, *args, speed: str | None = "10"):
        speed_args = ("--speed", speed) if speed is not None else ()
        cmd = _infer(
            "worker", "--port", 0, "--token-file", token_file, "--threads", 1, *speed_args, *args
        )
        cmd = [sys.executable, "-c", DIE_WITH_PARENT, *cmd]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env=_env(),
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.wait_for("listening on", STARTUP).rpartition(":")[2])

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, f"worker exited: {self.log}"
                continue
            self.log.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} from the worker in {timeout} s: {self.log}")

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(TIMEOUT)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_bytes(TOKEN)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A dense and a MoE model of 3 layers (one to three stages), each also quantized to
    int4 (decode on the fused C step), and the dense one's twin of another seed."""
    root = tmp_path_factory.mktemp("models")
    make_hf_model("llama", root / "dense", num_hidden_layers=3)
    make_hf_model("mixtral", root / "moe", num_hidden_layers=3)
    make_hf_model("llama", root / "other", seed=1, num_hidden_layers=3)
    for arch in ("dense", "moe"):
        cmd = _infer("quantize", root / arch, "-o", root / f"{arch}-int4", "--to", "int4")
        r = subprocess.run(
            cmd, check=False, capture_output=True, text=True, env=_env(), timeout=STARTUP
        )
        assert r.returncode == 0, r.stderr
    return root


def _start(n: int, token_file, *args) -> list[Worker]:
    workers = []
    try:
        for _ in range(n):
            workers.append(Worker(token_file, *args))
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers


@pytest.fixture(scope="module")
def workers(token_file):
    """Three workers that find each model by the path the coordinator names."""
    started = _start(3, token_file)
    yield started
    for w in started:
        w.kill()


def _greedy_alone(path, n: int) -> list[int]:
    lm = load_model(path, max_seq_len=128)
    return list(generate(Session(lm.model), PROMPT, make_sampler(temperature=0), n))


def _pipelined(path, workers):
    addresses = [w.address for w in workers]
    return load_pipelined(str(path), path, addresses, TOKEN, torch.float32, 128, timeout=TIMEOUT)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("arch", ["dense", "moe", "dense-int4", "moe-int4"])
def test_greedy_over_stages_equals_one_process(models, workers, arch, stages):
    path = models / arch
    ranges = assign_layers(3, [1] * stages)
    lm = _pipelined(path, workers[:stages])
    try:
        assert [w.layers for w in lm.stages.workers] == ranges
        session = Session(lm.model, stages=lm.stages)
        got = list(generate(session, PROMPT, make_sampler(temperature=0), 24))
    finally:
        lm.stages.close()
    assert got == _greedy_alone(path, 24)
    # Each worker loaded its blocks for this run, and decodes as one process does.
    step = "the fused C step" if arch.endswith("int4") else "torch blocks"
    for w, layers in zip(workers, ranges):
        line = w.wait_for(f"loaded layers {layers.start}-{layers.stop - 1} of {arch}")
        assert f"(decode: {step})" in line


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_default_model_over_stages_equals_one_process(smollm2_gguf, workers, stages):
    """The real Q4_1 file: each stage's fused step over its blocks, token for token the
    single process's greedy output."""
    lm = _pipelined(smollm2_gguf, workers[:stages])
    try:
        session = Session(lm.model, stages=lm.stages)
        got = list(generate(session, PROMPT, make_sampler(temperature=0), 32))
    finally:
        lm.stages.close()
    assert got == _greedy_alone(smollm2_gguf, 32)
    for w in workers[:stages]:
        assert "(decode: the fused C step)" in w.wait_for(f"of {smollm2_gguf.name}")


def test_int8_cache_and_lookup_over_stages_equal_one_process(models, workers):
    """The workers' caches in the coordinator's format (int8), and speculative decoding's
    verify passes (several rows of one sequence) through two stages: greedy, the tokens
    one process gives with the same cache."""
    path = models / "dense-int4"
    addresses = [w.address for w in workers[:2]]
    lm = load_pipelined(str(path), path, addresses, TOKEN, torch.float32, 128, TIMEOUT, "int8")
    prompt = PROMPT * 3  # repeats for prompt lookup to guess from
    try:
        session = Session(lm.model, stages=lm.stages)
        got = list(generate(session, prompt, make_sampler(0), 24, drafter=LookupDrafter()))
    finally:
        lm.stages.close()
    alone = load_model(path, max_seq_len=128, kv_cache="int8")
    want = list(generate(Session(alone.model), prompt, make_sampler(0), 24))
    assert got == want
    for w in workers[:2]:
        w.wait_for("KV cache int8")


def test_stage_rows_on_the_fused_step_equal_its_torch_blocks(models):
    """A stage of a quantized model plans the fused step over its own blocks (numbered
    from 0, its caches only); a pass of more rows than the C takes a call gives the
    states of the stage's torch blocks."""
    stage = load_stage(models / "dense-int4", torch.float32, 128, range(1, 3))
    assert stage.fused is not None and stage.fused.max_rows < 20
    x = torch.randn(1, 20, stage.model.args.dim, generator=torch.Generator().manual_seed(0))
    p = Pass(Op.ROWS, [(1, 0, 13), (2, 0, 7)], x)  # two sequences' first rows
    got = stage.forward(p)
    stage.forget()
    stage.fused = None
    want = stage.forward(p)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_batched_step_over_stages(models, workers):
    """Several sequences in one pass give each sequence's logits of the single-process
    batched step, on the fused step on both sides; their prompts too, in one pass."""
    path = models / "moe-int4"
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:]]
    guesses = [list(range(10, 19)), [3], list(range(30, 40))]  # more rows than a C call's

    def run(model, stages=None):
        sessions = [Session(model, 128, stages=stages) for _ in prompts]
        firsts = [int(x.argmax()) for x in prefill_together(sessions, prompts, 128)]
        steps = decode(sessions, [[t] for t in firsts]) + decode(sessions, [[1, 2], [3], [4, 5]])
        return steps + decode(sessions, guesses)

    want = run(load_model(path, max_seq_len=128).model)
    lm = _pipelined(path, workers)
    try:
        got = run(lm.model, lm.stages)
    finally:
        lm.stages.close()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["dense", "moe-int4"])
def test_passes_in_flight_equal_one_at_a_time(models, workers, arch):
    """Two groups' passes on the ring at once (a server keeps one a stage), a prompt's
    chunk sent behind them, the passes taken in the other order: each sequence's
    logits are those of the single process."""
    path = models / arch
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:], PROMPT[7:]]

    def run(model, stages=None):
        sessions = [Session(model, 128, stages=stages) for _ in prompts]
        firsts = [int(s.prefill(p).argmax()) for s, p in zip(sessions, prompts[:3])]
        a = start_decode(sessions[:2], [[firsts[0]], [firsts[1], 7, 8]])
        b = start_decode(sessions[2:3], [[firsts[2], 5]])
        late = sessions[3].prefill(prompts[3])
        return [late[None], *b.wait(), *a.wait()]

    want = run(load_model(path, max_seq_len=128).model)
    lm = _pipelined(path, workers[:2])
    try:
        got = run(lm.model, lm.stages)
        assert not lm.stages._flying
    finally:
        lm.stages.close()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "stages"), [("llama", 2), ("llama", 3), ("mixtral", 2)])
def test_workers_stream_the_layers_their_memory_does_not_hold(token_file, tmp_path, arch, stages):
    """Workers each offered less memory than its share of the layers: each streams what
    does not fit from its own copy (its log says so), and the greedy output over the
    stages is the single process's on the same (torch) blocks."""
    hf, path = tmp_path / "hf", tmp_path / "int8"
    layers = 8 * stages if arch == "llama" else 4 * stages
    make_hf_model(arch, hf, num_hidden_layers=layers, hidden_size=256, intermediate_size=768)
    cmd = _infer("quantize", hf, "-o", path, "--to", "int8")
    r = subprocess.run(
        cmd, check=False, capture_output=True, text=True, env=_env(), timeout=STARTUP
    )
    assert r.returncode == 0, r.stderr
    share = stage_bytes(path, torch.float32, 128, range(layers // stages))
    budget = share - share * stages // layers  # a layer's worth short of holding all
    workers = _start(stages, token_file, "--max-memory", f"{budget}B")
    try:
        lm = _pipelined(path, workers)
        try:
            got = list(generate(Session(lm.model, stages=lm.stages), PROMPT, make_sampler(0), 12))
        finally:
            lm.stages.close()
        logs = [w.wait_for("loaded layers") for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert all("streamed from disk" in line for line in logs), logs
    alone = Session(load_model(path, max_seq_len=128).model)
    alone.fused = None  # the blocks a streamed stage runs
    assert got == list(generate(alone, PROMPT, make_sampler(0), 12))


def test_a_stage_of_a_checkpoint_needs_its_blocks_as_stored(models):
    """A worker's budget check counts a quantized checkpoint's blocks at their bytes in
    the file, not at float32 (a stage of int4 blocks fits a budget a quarter the size)."""
    path = models / "moe-int4"
    source = open_source(path)
    ranges = source.checkpoint.ranges
    blocks = sum(e - b for u, (b, e) in ranges.items() if u.startswith("layers."))
    assert source.layers_bytes(torch.float32, range(3)) == blocks
    one = source.layers_bytes(torch.float32, range(1, 2))
    assert 0 < one < source.held_bytes(torch.float32) // 3 // 4
    a = source.args
    kv = 2 * a.n_kv_heads * 128 * a.head_dim * 4
    assert stage_bytes(path, torch.float32, 128, range(1, 2)) == one + kv


def test_assign_layers_follows_memory():
    assert assign_layers(8, [1, 1]) == [range(4), range(4, 8)]
    assert assign_layers(8, [3, 1]) == [range(6), range(6, 8)]
    assert assign_layers(3, [100, 1, 1]) == [range(1), range(1, 2), range(2, 3)]


def test_assign_layers_follows_speed_within_memory():
    gb = 10**9
    assert assign_layers(24, [16 * gb, 16 * gb], [20, 10], gb) == [range(16), range(16, 24)]
    # the fast one holds 10 layers at most: the rest go to the other
    assert assign_layers(24, [10 * gb, 16 * gb], [30, 10], gb) == [range(10), range(10, 24)]
    # 5 on the first (its memory), the other 23 split 1:2 by speed
    three = assign_layers(28, [5 * gb, 30 * gb, 30 * gb], [10, 10, 20], gb)
    assert three == [range(5), range(5, 13), range(13, 28)]
    # memory too small in sum: by memory, and the workers refuse what does not fit
    assert assign_layers(24, [10 * gb, 10 * gb], [30, 10], gb) == [range(12), range(12, 24)]
    # a worker that says no speed: by memory
    assert assign_layers(8, [3 * gb, gb], [0, 5], gb) == [range(6), range(6, 8)]


def _run(path, token_file, addresses, *args) -> subprocess.Popen:
    workers = ",".join(f"{h}:{p}" for h, p in addresses)
    cmd = _infer("run", path, "--no-chat", "--temp", 0, "--workers", workers,
                 "--token-file", token_file, *args)  # fmt: skip
    return subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_env(),
    )  # fmt: skip


def test_killed_worker_ends_the_run_with_one_line(models, token_file):
    pair = _start(2, token_file)
    try:
        # Until the context is full: long enough to be killed in the middle.
        proc = _run(models / "dense", token_file, [w.address for w in pair], "Hello", "-n", -1)
        try:
            # the first piece of the answer (bounded: a coordinator that hangs fails here)
            assert select.select([proc.stdout], [], [], STARTUP)[0], "no answer began"
            assert proc.stdout.read(1)
            pair[1].kill()
            _, err = proc.communicate(timeout=STARTUP)
        finally:
            proc.kill()
        r = subprocess.CompletedProcess(proc.args, proc.returncode, "", err.decode())
        assert_one_line_error(r, 2, "pipeline stage failed")
        pair[0].wait_for("coordinator")  # the other worker left the group, and waits
    finally:
        for w in pair:
            w.kill()


def test_wrong_token_is_refused_on_both_sides(models, workers, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"not the secret the workers hold")
    wrong.chmod(0o600)
    proc = _run(models / "dense", wrong, [workers[0].address], "Hello", "-n", 2)
    out, err = proc.communicate(timeout=STARTUP)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())
    assert_one_line_error(r, 2, "wrong token")
    assert "wrong token" in workers[0].wait_for("wrong token")


def test_a_differing_model_file_is_refused(models, token_file):
    worker = Worker(token_file, "--model", models / "other", speed=None)
    try:
        assert any("memory read bandwidth" in line for line in worker.log)  # before listening
        proc = _run(models / "dense", token_file, [worker.address], "Hello", "-n", 2)
        out, err = proc.communicate(timeout=STARTUP)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())
        assert_one_line_error(r, 2, "model refused", "sha256")
        worker.wait_for("model refused")
    finally:
        worker.kill()


def test_layers_that_do_not_fit_and_cannot_stream_are_refused(models, token_file):
    """A Hugging Face directory (or a GGUF file) does not stream: a worker whose memory
    does not hold its layers says so, and the run ends with that one line."""
    worker = Worker(token_file, "--max-memory", "1KB")
    try:
        proc = _run(models / "dense", token_file, [worker.address], "Hello", "-n", 2)
        out, err = proc.communicate(timeout=STARTUP)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())
        assert_one_line_error(r, 2, "do not fit", "infer quantize")
    finally:
        worker.kill()


def test_a_model_sha256_is_read_once_a_version_of_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_HOME", str(tmp_path / "home"))
    reads = []
    hashed = handshake.file_sha256
    monkeypatch.setattr(handshake, "file_sha256", lambda p: reads.append(p) or hashed(p))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    first = handshake.model_sha256(model)
    assert first == hashlib.sha256(b"weights").hexdigest()
    assert handshake.model_sha256(model) == first and len(reads) == 1  # remembered
    model.write_bytes(b"other weights")  # a new size and time: read again
    os.utime(model, ns=(1, 1))
    assert handshake.model_sha256(model) == hashlib.sha256(b"other weights").hexdigest()
    assert len(reads) == 2
    (tmp_path / "home/sha256.json").write_text("not json")  # a damaged memo: read again
    assert handshake.model_sha256(model) == hashlib.sha256(b"other weights").hexdigest()
    assert len(reads) == 3
    assert not [p for p in (tmp_path / "home").iterdir() if p.name != "sha256.json"]


def test_serve_answers_concurrent_requests_through_the_stages(
    models, workers, token_file, tmp_path
):
    """Three greedy completions at once (the batched step, micro-batches over two
    stages): each the answer one process gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    from infer.runtime.answer import stream_answer

    path = models / "dense"
    addresses = ",".join(f"{h}:{p}" for h, p in (w.address for w in workers[:2]))
    args = [str(path), "--workers", addresses, "--token-file", str(token_file), "--parallel", "3"]
    server = Server(args, tmp_path, tmp_path / "serve.log").ready(STARTUP)
    prompts = ["Once upon", "The capital of", "1, 2, 3,"]
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:

            def complete(prompt: str) -> str:
                body = {"model": str(path), "prompt": prompt, "max_tokens": 12, "temperature": 0}
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(complete, prompts))
    finally:
        code, _ = server.stop()
    assert code == 0, server.log.read_text()
    lm = load_model(path, max_seq_len=128)
    for prompt, text in zip(prompts, got):
        ids = lm.tokenizer.encode(prompt)
        want = stream_answer(Session(lm.model), lm.tokenizer, ids, make_sampler(0), 12, print)
        assert text == want.text


def test_serve_over_stages_with_a_draft_model_and_an_int8_cache(
    models, workers, token_file, tmp_path
):
    """`serve --workers` with --draft (verified through the stages) and --kv-cache
    int8 (the workers' caches): greedy, the answer one process gives with that cache."""
    from infer.runtime.answer import stream_answer

    path = models / "dense-int4"
    addresses = ",".join(f"{h}:{p}" for h, p in (w.address for w in workers[:2]))
    args = [str(path), "--workers", addresses, "--token-file", str(token_file),
            "--draft", str(models / "dense"), "--kv-cache", "int8"]  # fmt: skip
    server = Server(args, tmp_path, tmp_path / "serve.log").ready(STARTUP)
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            body = {"model": str(path), "prompt": "Once upon", "max_tokens": 16, "temperature": 0}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
    finally:
        code, _ = server.stop()
    assert code == 0, server.log.read_text()
    lm = load_model(path, max_seq_len=128, kv_cache="int8")
    ids = lm.tokenizer.encode("Once upon")
    want = stream_answer(Session(lm.model), lm.tokenizer, ids, make_sampler(0), 16, print)
    assert text == want.text
    for w in workers[:2]:
        w.wait_for("KV cache int8")


def test_serve_forms_the_pipeline_again_without_a_dead_worker(models, token_file, tmp_path):
    """A worker killed between requests: the next request fails with the stage's error,
    the server stays up, and the one after runs every block on the worker left (it has
    the memory), giving one process's answer."""
    from infer.runtime.answer import stream_answer

    path = models / "dense-int4"
    pair = _start(2, token_file)
    addresses = ",".join(f"{h}:{p}" for h, p in (w.address for w in pair))
    args = [str(path), "--workers", addresses, "--token-file", str(token_file)]
    server = Server(args, tmp_path, tmp_path / "serve.log").ready(STARTUP)
    body = {"model": str(path), "prompt": "Once upon", "max_tokens": 8, "temperature": 0}
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            assert http.post("/v1/completions", json=body).status_code == 200
            pair[1].kill()
            r = http.post("/v1/completions", json=body)
            assert r.status_code >= 500 and "pipeline stage failed" in r.text, r.text
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
    finally:
        code, _ = server.stop()
        for w in pair:
            w.kill()
    assert code == 0, server.log.read_text()
    assert "its layers go to the others" in server.log.read_text()
    pair[0].wait_for("loaded layers 0-2 of dense-int4")
    lm = load_model(path, max_seq_len=128)
    ids = lm.tokenizer.encode("Once upon")
    want = stream_answer(Session(lm.model), lm.tokenizer, ids, make_sampler(0), 8, print)
    assert text == want.text
