"""Embeddings (runtime/embedding.py): the final norm's states pooled as the file says,
against transformers' last_hidden_state; the pooling type and add_eos_token of a GGUF."""

from __future__ import annotations

import pytest
import torch
from test_gguf import tiny_model
from tiny import make_hf_model

from infer.runtime.embedding import embed, pool, pooling_of
from infer.runtime.files.gguf import GGUFFile
from infer.runtime.files.model_file import open_model_file
from infer.runtime.loader import load_model
from infer.runtime.model.tokenizer import Tokenizer
from infer.runtime.session import Session


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed") / "qwen2"
    model = make_hf_model("qwen2", path, seed=2)
    return path, model


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_states_equal_transformers(hf, pooling):
    """Each pooling of our states equals the same of transformers' last_hidden_state (the
    base model's output after its final norm), at unit length; a prompt longer than one
    pass (chunks of 8 here) gives the same as one pass."""
    path, model = hf
    lm = load_model(path)
    ids = lm.tokenizer.encode_embedded("The cat sat on the mat, and then it slept.")
    with torch.no_grad():
        states = model.model(torch.tensor([ids])).last_hidden_state[0]
    want = pool(states, pooling)
    session = Session(lm.model)
    got = embed(session, ids, pooling)
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=2e-5)
    assert abs(torch.tensor(got).norm().item() - 1) < 1e-5
    assert session.tokens == ids  # the cache holds them
    chunked = pool(Session(lm.model).states(ids, chunk=8), pooling)
    assert torch.allclose(torch.tensor(chunked), torch.tensor(got), atol=2e-5)
    raw = pool(states, pooling, normalize=False)
    assert abs(torch.tensor(raw).norm().item() - 1) > 1e-3  # normalize did something


def test_gguf_pooling_and_eos(tmp_path, smollm2_gguf):
    """A GGUF embedding model's pooling type and add_eos_token are read: its text gets
    EOS after it; a model that says nothing pools the mean and adds no EOS."""
    path, _ = tiny_model(
        tmp_path / "e.gguf", "llama", False, [("add_uint32", "llama.pooling_type", 3)]
    )
    assert pooling_of(open_model_file(path).config) == "last"
    plain, _ = tiny_model(tmp_path / "p.gguf", "llama", False)
    assert pooling_of(open_model_file(plain).config) == "mean"
    md = GGUFFile(smollm2_gguf).metadata
    tok = Tokenizer.from_gguf_metadata(md)
    assert not tok.add_eos and tok.encode_embedded("Hi") == tok.encode("Hi")
    tok = Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.add_eos_token": True})
    assert tok.encode_embedded("Hi") == tok.encode("Hi") + [tok.eos_id]


def test_sentence_transformers_directory(hf, tmp_path):
    """A sentence-transformers model directory says how it pools (1_Pooling/config.json);
    a tokenizer.json whose post-processor appends EOS makes encode_embedded append it."""
    import json
    import shutil

    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    path = tmp_path / "st"
    shutil.copytree(hf[0], path)
    assert pooling_of(open_model_file(path).config) == "mean"
    (path / "1_Pooling").mkdir()
    modes = {"pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    assert pooling_of(open_model_file(path).config) == "last"
    assert not Tokenizer.from_hf_dir(path).add_eos
    backend = Backend.from_file(str(path / "tokenizer.json"))
    eos = "<|im_end|>"
    backend.post_processor = TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, backend.token_to_id(eos))]
    )
    backend.save(str(path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(path)
    assert tok.encode_embedded("Hi") == tok.encode("Hi") + [tok.eos_id]
