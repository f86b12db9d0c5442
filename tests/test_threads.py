"""Who runs on the cores: the kernels' pool, or torch's threads (ops.kernel_threads).

A model whose matmuls run on the C kernels runs its forward passes and its sampler with
torch on one thread and the kernels on the thread count set outside; a long prompt's
attention gets the threads back; a float model leaves torch's threads alone.
"""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tiny import make_hf_model

from infer.kernels_cpu import ops
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.generate import generate
from infer.runtime.loader import load_model
from infer.runtime.model import llama

pytestmark = pytest.mark.skipif(not ops.available(), reason="C extension not built")


@pytest.fixture
def three_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(saved)


def test_kernel_threads_nest_and_restore(three_threads):
    n = three_threads
    assert ops._num_threads is None
    with ops.kernel_threads():
        assert (torch.get_num_threads(), ops.get_num_threads()) == (1, n)
        with ops.kernel_threads():  # nested: the outer counts stay
            assert (torch.get_num_threads(), ops.get_num_threads()) == (1, n)
        with ops.torch_threads():
            assert (torch.get_num_threads(), ops.get_num_threads()) == (n, n)
        assert (torch.get_num_threads(), ops.get_num_threads()) == (1, n)
    assert (torch.get_num_threads(), ops._num_threads) == (n, None)
    with ops.torch_threads():  # outside kernel_threads: nothing changes
        assert torch.get_num_threads() == n
    with pytest.raises(KeyError), ops.kernel_threads():
        raise KeyError  # an error inside still restores both counts
    assert (torch.get_num_threads(), ops._num_threads) == (n, None)


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
    assert model.threads is not ops.kernel_threads  # float linears: torch's threads do them
    quantize_model(model, get_recipe("int4", n_layers=model.args.n_layers))
    assert model.threads is ops.kernel_threads  # the MoE's float routers do not count
    seen, note = watch(model, monkeypatch)

    def sampler(logits):
        note("sampler")
        return int(logits.argmax())

    tokens = list(generate(model, [5, 77, 123, 9], sampler, 3))
    assert len(tokens) == 3
    wheres = {w for w, _, _ in seen}
    assert wheres == {"block", "attention", "sampler"}
    assert {(t, k) for _, t, k in seen} == {(1, 3)}, seen
    assert torch.get_num_threads() == 3 and ops._num_threads is None

    seen.clear()  # a long prompt's attention gets every thread back
    monkeypatch.setattr(llama, "LARGE_ATTENTION", 4 * 4 * model.args.n_heads * model.args.head_dim)
    model.cached_tokens.clear()
    with torch.inference_mode():
        model(torch.tensor([[5, 77, 123, 9]]), 0)
    assert {(t, k) for w, t, k in seen if w == "attention"} == {(3, 3)}
    assert {(t, k) for w, t, k in seen if w == "block"} == {(1, 3)}


def test_float_model_keeps_torch_threads(tmp_path, three_threads, monkeypatch):
    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, max_seq_len=64).model
    seen, _ = watch(model, monkeypatch)
    with torch.inference_mode():
        model(torch.tensor([[5, 77, 123, 9]]), 0)
    assert seen and {(t, k) for _, t, k in seen} == {(3, 3)}


def test_float_matmuls_keep_torch_threads(tmp_path):
    """Where torch does a matmul (a float output layer, quant/tune.py's trainable
    stand-ins while they train), its threads stay; they go back to the kernels after."""
    from infer.quant.tune import _differentiable

    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, max_seq_len=64).model
    int8 = {"format": "int8", "group_size": 32}
    quantize_model(model, lambda name: None if name == "lm_head" else int8)
    assert model.threads is not ops.kernel_threads
    quantize_model(model, get_recipe("int4", n_layers=model.args.n_layers))
    assert model.threads is ops.kernel_threads
    with _differentiable(model, {"layers.0.mlp.up_proj"}):
        assert model.threads is not ops.kernel_threads and model.fused_decode is None
    assert model.threads is ops.kernel_threads and model.fused_decode is not None
