"""runtime/bench.py: the byte counting on toy models, the figures on tiny and real ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from infer.runtime.bench import BENCH_TEXT, bench_prompt, run_bench, weight_bytes_per_token
from infer.runtime.config import ModelArgs
from infer.runtime.errors import InferError
from infer.runtime.llama import Transformer

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
    model.setup_caches(32, dtype)  # KV caches and rope tables are not weights
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


def test_run_bench_bfloat16_halves_the_bytes(tiny_smollm):
    r = run_bench(tiny_smollm, n_prompt=4, n_gen=2, repeats=1, dtype=torch.bfloat16)
    assert r.dtype == "bfloat16"
    assert r.weight_bytes_per_token == r.n_params * 2


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
    assert (data["n_prompt"], data["n_gen"], data["repeats"]) == (16, 4, 1)
    assert data["quantization"] == "Q4_1" and data["dtype"] == "float32"
    assert data["weight_bytes_per_token"] == data["n_params"] * 4  # dequantized to float32
    assert 0 < data["load_s"] < 120 and 0 < data["ttft_s"] < 60
    assert data["prefill_tok_s"] > 1 and data["decode_tok_s"] > 0.5
    assert data["decode_gb_s"] > 0
    assert data["peak_rss_bytes"] > data["weight_bytes_per_token"]
