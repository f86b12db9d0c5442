"""Who runs on the cores: the kernels' pool, or torch's threads (threads.ThreadPolicy).

A session over a model whose matmuls run on the C kernels runs its forward passes and
its sampler with torch on one thread and the kernels on the policy's count; a long
prompt's attention gets the threads back; a float model leaves torch's threads alone.
"""

import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tiny import make_hf_model

from infer.kernels_cpu import ops, threads
from infer.kernels_cpu.threads import ThreadPolicy
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.generate import generate
from infer.runtime.loader import load_model
from infer.runtime.model import llama
from infer.runtime.session import Session

pytestmark = pytest.mark.skipif(not ops.available(), reason="C extension not built")


@pytest.fixture
def three_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(saved)


def test_policy_nests_and_restores(three_threads):
    n = three_threads
    policy = ThreadPolicy()
    assert ops.get_num_threads() == n  # outside a pass: torch's count
    with policy.forward():
        assert (torch.get_num_threads(), ops.get_num_threads()) == (1, n)
        with ThreadPolicy(2).forward():  # nested: the outer counts stay
            assert (torch.get_num_threads(), ops.get_num_threads()) == (1, n)
        with threads.wide():
            assert (torch.get_num_threads(), ops.get_num_threads()) == (n, n)
        assert (torch.get_num_threads(), ops.get_num_threads()) == (1, n)
    assert (torch.get_num_threads(), ops.get_num_threads()) == (n, n)
    with threads.wide():  # outside a pass: nothing changes
        assert torch.get_num_threads() == n
    with pytest.raises(KeyError), policy.forward():
        raise KeyError  # an error inside still restores both counts
    assert (torch.get_num_threads(), ops.get_num_threads()) == (n, n)
    with ThreadPolicy(2).forward():  # its own count for the kernels
        assert (torch.get_num_threads(), ops.get_num_threads()) == (1, 2)
    with ThreadPolicy(2, kernels=False).forward():  # torch's matmuls: nothing changes
        assert (torch.get_num_threads(), ops.get_num_threads()) == (n, n)
    with pytest.raises(ValueError, match="at least 1"):
        ThreadPolicy(0)


def test_sessions_keep_their_own_counts(three_threads):
    """A pass's count is its own (a context variable): another thread outside any pass
    follows torch's count, which this pass has set to 1."""
    seen = []
    with ThreadPolicy(2).forward():
        worker = threading.Thread(target=lambda: seen.append(ops.get_num_threads()))
        worker.start()
        worker.join()
        assert ops.get_num_threads() == 2
    assert seen == [1]


def watch(model, monkeypatch) -> tuple[list, Callable[[str], None]]:
    """(where, torch threads, kernel threads) at each block, attention and sampler call."""
    seen = []

    def note(where):
        seen.append((where, torch.get_num_threads(), ops.get_num_threads()))

    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: note("block"))
    sdpa = F.scaled_dot_product_attention

    def attention(*args, **kwargs):
        note("attention")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)
    return seen, note


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_quantized_model_gives_the_cores_to_the_kernels(tmp_path, arch, three_threads, monkeypatch):
    make_hf_model(arch, tmp_path)
    model = load_model(tmp_path, max_seq_len=64).model
    assert not Session(model).threads.kernels  # float linears: torch's threads do them
    quantize_model(model, get_recipe("int4", n_layers=model.args.n_layers))
    session = Session(model)
    assert session.threads.kernels  # the MoE's float routers do not count
    seen, note = watch(model, monkeypatch)

    def sampler(logits):
        note("sampler")
        return int(logits.argmax())

    tokens = list(generate(session, [5, 77, 123, 9], sampler, 3))
    assert len(tokens) == 3
    wheres = {w for w, _, _ in seen}
    assert wheres == {"block", "attention", "sampler"}
    assert {(t, k) for _, t, k in seen} == {(1, 3)}, seen
    assert torch.get_num_threads() == 3 and ops.get_num_threads() == 3

    seen.clear()  # a long prompt's attention gets every thread back
    monkeypatch.setattr(llama, "LARGE_ATTENTION", 4 * 4 * model.args.n_heads * model.args.head_dim)
    session.reset()
    session.prefill([5, 77, 123, 9])
    assert {(t, k) for w, t, k in seen if w == "attention"} == {(3, 3)}
    assert {(t, k) for w, t, k in seen if w == "block"} == {(1, 3)}


def test_float_model_keeps_torch_threads(tmp_path, three_threads, monkeypatch):
    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, max_seq_len=64).model
    seen, _ = watch(model, monkeypatch)
    Session(model).prefill([5, 77, 123, 9])
    assert seen and {(t, k) for _, t, k in seen} == {(3, 3)}


def test_float_matmuls_keep_torch_threads(tmp_path):
    """Where torch does a matmul (a float output layer, quant/tune.py's trainable
    stand-ins while they train), its threads stay; they go back to the kernels after."""
    from infer.quant.tune import _differentiable

    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, max_seq_len=64).model
    int8 = {"format": "int8", "group_size": 32}
    quantize_model(model, lambda name: None if name == "lm_head" else int8)
    assert not Session(model).threads.kernels
    quantize_model(model, get_recipe("int4", n_layers=model.args.n_layers))
    session = Session(model)
    assert session.threads.kernels
    with _differentiable(model, {"layers.0.mlp.up_proj"}):
        session.rebuild()  # the trainable stand-ins: torch's matmuls, no fused step
        assert not session.threads.kernels and session.fused is None
    session.rebuild()
    assert session.threads.kernels and session.fused is not None
