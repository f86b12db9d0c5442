"""runtime/bench.py: the byte counting on toy models, the figures on tiny and real ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from infer import InferError
from infer.runtime.bench import BENCH_TEXT, bench_prompt, run_bench, weight_bytes_per_token
from infer.runtime.files.gguf import GGUFFile
from infer.runtime.files.hugepages import HUGE_PAGE
from infer.runtime.model.config import ModelArgs
from infer.runtime.model.llama import Transformer
from infer.runtime.session import Session

CONFIG = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _toy(tied: bool, dtype=torch.float32) -> Transformer:
    args = ModelArgs.from_dict({**CONFIG, "tie_word_embeddings": tied})
    model = Transformer(args).to(dtype)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.setup_rope(32, dtype)  # rope tables are not weights
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_untied_reads_one_embedding_row(dtype):
    model = _toy(tied=False, dtype=dtype)
    size = dtype.itemsize
    every = sum(p.numel() for p in model.parameters()) * size
    embed = 100 * 16 * size
    assert weight_bytes_per_token(model) == every - embed + 16 * size


def test_weight_bytes_tied_counts_the_shared_matrix_once():
    model = _toy(tied=True)
    # parameters() yields a shared tensor once; as lm_head it is read whole.
    expected = sum(p.numel() for p in model.parameters()) * 4
    assert weight_bytes_per_token(model) == expected
    assert expected == model.args.n_params * 4


def _quantize_table(model, tied: bool):
    """Replace lm_head (and, if tied, the embedding) by int8 per-channel, as a load does."""
    from infer.quant.formats.base import QuantEmbedding
    from infer.quant.formats.int8 import Int8Linear

    q = Int8Linear.from_float(model.lm_head.weight.detach(), group_size=0)
    model.lm_head = q
    if tied:
        model.embed_tokens = QuantEmbedding(q)  # the table reachable twice
    else:
        e = Int8Linear.from_float(model.embed_tokens.weight.detach(), group_size=0)
        model.embed_tokens = QuantEmbedding(e)
    return q


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_with_a_quantized_table(tied):
    model = _toy(tied=tied)
    q = _quantize_table(model, tied)
    floats = sum(p.numel() for n, p in model.named_parameters()) * 4  # blocks and norms
    expected = floats + q.nbytes  # lm_head: whole
    if not tied:
        table = model.embed_tokens.table
        expected += table.nbytes // 100  # one row of 100
    assert weight_bytes_per_token(model) == expected


class _ByteTokenizer:
    def encode(self, text, add_special=True):
        return list(text.encode())


def test_bench_prompt_cycles_real_text():
    ids = bench_prompt(_ByteTokenizer(), 1000)
    assert len(ids) == 1000
    assert bytes(ids[: len(BENCH_TEXT)]).decode() == BENCH_TEXT
    assert ids[len(BENCH_TEXT)] == ids[0]


@pytest.fixture(scope="module")
def tiny_smollm(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny import make_hf_model

    path = tmp_path_factory.mktemp("tiny") / "smollm2"
    make_hf_model("smollm2", path)
    return path


def test_run_bench_on_a_tiny_model(tiny_smollm):
    r = run_bench(tiny_smollm, n_prompt=16, n_gen=8, repeats=2)
    assert (r.n_prompt, r.n_gen, r.repeats, r.format) == (16, 8, 2, "safetensors")
    assert r.threads == torch.get_num_threads()
    assert r.load_s > 0 and r.ttft_s > 0
    assert r.prefill_tok_s > 0 and r.decode_tok_s > 0
    assert r.weight_bytes_per_token == r.n_params * 4  # float32, tied embeddings
    assert r.decode_gb_s == pytest.approx(r.weight_bytes_per_token * r.decode_tok_s / 1e9)
    assert r.peak_rss_bytes > r.weight_bytes_per_token
    assert len(r.rows()) >= 8


@pytest.mark.slow  # a child process per case
def test_bench_names_the_kernel_path():
    from infer.kernels_cpu import ops
    from infer.runtime.bench import kernel_path

    if not ops.available():
        assert kernel_path() == "torch reference (C extension not built)"
        return
    how = "integer dot products" if ops.integer_gemm() else "float32"
    assert kernel_path() == f"{ops.isa()} (prompts: {how})"
    # A path without the integer GEMM; the variable is read once, so in a child.
    code = "from infer.runtime.bench import kernel_path; print(kernel_path())"
    env = {**os.environ, ops.ENV_ISA: "scalar"}
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert r.stdout == "scalar (prompts: float32)\n", r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_peak_rss_is_the_processs_own_not_its_parents():
    # exec carries the parent's peak into ru_maxrss; the child must report its own
    import numpy as np

    held = np.ones(768 * 2**20, dtype=np.uint8)  # 768 MiB resident in this process
    code = "from infer.runtime.bench import peak_rss_bytes; print(peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < held.nbytes  # the child imports torch: ~250 MB


def test_run_bench_bfloat16_halves_the_bytes(tiny_smollm):
    r = run_bench(tiny_smollm, n_prompt=4, n_gen=2, repeats=1, dtype=torch.bfloat16)
    assert r.dtype == "bfloat16"
    assert r.weight_bytes_per_token == r.n_params * 2
    assert r.kv_cache == "bf16"  # the compute dtype's cache by default


def test_run_bench_int8_kv_cache(tiny_smollm):
    f32 = run_bench(tiny_smollm, n_prompt=4, n_gen=2, repeats=1)
    r = run_bench(tiny_smollm, n_prompt=4, n_gen=2, repeats=1, kv_cache="int8")
    assert (f32.kv_cache, r.kv_cache) == ("f32", "int8")
    assert 3.5 < f32.kv_cache_bytes / r.kv_cache_bytes < 4
    assert "int8" in dict(r.rows())["KV cache"]


def test_run_bench_parallel(tiny_smollm):
    r = run_bench(tiny_smollm, n_prompt=8, n_gen=4, repeats=1, parallel=3)
    assert r.parallel == 3 and r.parallel_decode_tok_s > 0
    assert "x one sequence" in dict(r.rows())["decode, 3 sequences at once"]
    one = run_bench(tiny_smollm, n_prompt=8, n_gen=4, repeats=1)
    assert one.parallel_decode_tok_s is None
    assert not any("at once" in name for name, _ in one.rows())


def test_timed_batch_decodes_each_sequence_as_alone(tiny_smollm):
    """The batched run decodes sequences of their own (the prompt rotated), each the
    greedy continuation it has alone."""
    from infer.runtime.bench import _timed_batch
    from infer.runtime.generate import generate, make_sampler
    from infer.runtime.loader import load_model

    model = load_model(tiny_smollm, max_seq_len=64).model
    prompt = list(range(10, 22))
    sessions = [Session(model) for _ in range(3)]
    assert _timed_batch(sessions, prompt, 5) > 0
    for i, s in enumerate(sessions):
        mine = prompt[i:] + prompt[:i]
        alone = list(generate(Session(model), mine, make_sampler(temperature=0), max_tokens=5))
        assert s.tokens == mine + alone


def test_run_bench_rejects_more_than_the_context(tiny_smollm):
    with pytest.raises(InferError, match="context"):
        run_bench(tiny_smollm, n_prompt=250, n_gen=10, repeats=1)  # context is 256


def test_bench_cli_json(smollm2_gguf):
    cmd = [sys.executable, "-m", "infer.cli.main", "bench", str(smollm2_gguf)]
    cmd += ["-p", "16", "-n", "4", "-r", "1", "-t", "1", "--json"]
    r = subprocess.run(
        cmd, check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["threads"] == 1
    assert data["kernels"].startswith(("avx", "neon", "scalar", "torch reference"))
    assert (data["n_prompt"], data["n_gen"], data["repeats"]) == (16, 4, 1)
    assert data["quantization"] == "Q4_1" and data["dtype"] == "float32"
    # The file's blocks run as they are (int4 layers, an int8 table), norms in float32.
    tensors = GGUFFile(smollm2_gguf).tensors.values()
    assert data["weight_bytes_per_token"] == sum(t.nbytes for t in tensors)
    assert 0 < data["load_s"] < 120 and 0 < data["ttft_s"] < 60
    assert data["prefill_tok_s"] > 1 and data["decode_tok_s"] > 0.5
    assert data["decode_gb_s"] > 0
    assert data["peak_rss_bytes"] > data["weight_bytes_per_token"]
    # What the kernel granted (runtime/files/hugepages.py): a count, not a promise, in
    # whole huge pages; None where /proc/self/smaps_rollup is missing (not Linux).
    if sys.platform.startswith("linux"):
        assert data["huge_page_bytes"] % HUGE_PAGE == 0
    else:
        assert data["huge_page_bytes"] is None


# ------------------------------------------------------------------ --roofline, breakdown


def test_read_bandwidth_small_buffer_restores_threads():
    from infer.runtime.membw import read_bandwidth

    before = torch.get_num_threads()
    bw = read_bandwidth(threads=2, nbytes=8 << 20, repeats=1)
    assert torch.get_num_threads() == before
    assert bw.threads == 2 and bw.buffer_bytes == 8 << 20
    assert set(bw.by_method) == {"torch.sum", "numpy.sum", "torch.mv"}
    assert bw.bytes_per_s == max(bw.by_method.values()) == bw.by_method[bw.method] > 0
    assert bw.gb_s == bw.bytes_per_s / 1e9


def test_linear_modules_names_a_tied_quantized_table_lm_head():
    from infer.runtime.bench import linear_modules

    model = _toy(tied=True)
    names = linear_modules(model)
    assert len(names) == 2 * 7 + 1 and "lm_head" in names
    q = _quantize_table(model, tied=True)
    names = linear_modules(model)
    assert names["lm_head"] is q and "embed_tokens.table" not in names


def test_decode_breakdown_splits_linear_time_and_removes_its_hooks():
    from infer.runtime.bench import decode_breakdown

    model = _toy(tied=False)
    session = Session(model)
    b = decode_breakdown(session, prompt=[1, 2, 3], n_gen=5)
    assert b.n_tokens == 5
    names = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(b.linear_ms_by_name) == names | {"lm_head"}
    assert b.linear_ms_per_token == pytest.approx(sum(b.linear_ms_by_name.values()))
    assert b.linear_ms_per_token + b.other_ms_per_token == pytest.approx(b.ms_per_token)
    assert 0 < b.linear_fraction < 1 and b.linear_gb_s > 0
    matrices = sum(p.numel() for n, p in model.named_parameters() if "proj" in n or "lm_head" in n)
    assert b.linear_weight_bytes == matrices * 4
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert session.tokens[:3] == [1, 2, 3] and len(session.tokens) == 3 + 5


def test_run_bench_roofline(tiny_smollm):
    r = run_bench(
        tiny_smollm, n_prompt=8, n_gen=4, repeats=1, roofline=True, bandwidth_bytes=8 << 20
    )
    ceiling = r.roofline
    assert ceiling.bandwidth_gb_s > 0 and ceiling.bandwidth_1thread_gb_s > 0
    assert ceiling.bandwidth_method in ceiling.bandwidth_by_method
    assert ceiling.ceiling_tok_s == pytest.approx(
        ceiling.bandwidth_gb_s * 1e9 / r.weight_bytes_per_token
    )
    assert ceiling.ratio == pytest.approx(r.decode_tok_s / ceiling.ceiling_tok_s)
    assert r.breakdown.n_tokens == 4 and "lm_head" in r.breakdown.linear_ms_by_name
    text = dict(r.rows())
    assert "decode ceiling" in text and "  linear layers" in text
    assert run_bench(tiny_smollm, n_prompt=4, n_gen=2, repeats=1).roofline is None


def test_bench_cli_roofline_json(tiny_smollm, monkeypatch):
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.runtime import membw

    monkeypatch.setattr(membw, "DEFAULT_BUFFER_BYTES", 8 << 20)  # a fast, not a true, figure
    threads = torch.get_num_threads()
    try:
        args = ["bench", str(tiny_smollm), "-p", "8", "-n", "4", "-r", "1", "-t", "2"]
        r = CliRunner().invoke(app, [*args, "--roofline", "--json"])
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    roof, parts = data["roofline"], data["breakdown"]
    assert roof["ceiling_tok_s"] > 0 and roof["ratio"] > 0
    assert set(roof["bandwidth_by_method"]) == {"torch.sum", "numpy.sum", "torch.mv"}
    assert parts["linear_ms_per_token"] > 0 and parts["other_ms_per_token"] > 0
    assert data["threads"] == 2
