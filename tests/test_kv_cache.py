"""KV cache formats (runtime/model/kvcache.py): the fused step writes the bytes the torch
reference writes, attends over bf16 and int8 caches as Block.forward does, computes each
row as alone and the same on any thread count; what the formats cost in memory and in
quality."""

import pytest
import torch
from tiny import make_hf_model

from infer.kernels_cpu import decode as kernels
from infer.kernels_cpu import ops
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.loader import estimated_bytes, load_model
from infer.runtime.model.kvcache import Int8KVCache, KVCache, cache_bytes, quantize_int8
from infer.runtime.session import Session, decode

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]  # past a window of 8
NEXT = [41, 7, 233, 18, 90]
KINDS = {"f32": 0, "bf16": 1, "int8": 2}  # decode.c's KV_*

pytestmark = pytest.mark.skipif(not ops.available(), reason="C extension not built")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    for arch in ("llama", "qwen3", "gemma3", "mistral_window"):
        make_hf_model(arch, root / arch)
    return root


def int8_model(path, **kw):
    model = load_model(path, **kw).model
    quantize_model(model, get_recipe("int8", n_layers=model.args.n_layers))
    return model


def decode_logits(model, kind: str, fused: bool, prompt=PROMPT, threads=None) -> torch.Tensor:
    """Prefill `prompt`, then decode NEXT one at a time: the steps' logits."""
    session = Session(model, threads=threads, kv_cache=kind)
    assert session.fused is not None
    if not fused:
        session.fused = None  # Block.forward over the cache's update: the definition
    session.forward(prompt, 0)
    return torch.stack([session.step(t) for t in NEXT])


def test_fused_step_writes_the_reference_bytes():
    """decode.c's kv_store against kvcache.py: int8 codes and float16 scales over eleven
    decades of magnitude (subnormal scales included), zeros and ties; bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    g = 32
    x = torch.cat([torch.randn(512 * g, generator=gen) * 10.0**e for e in range(-9, 8, 2)])
    x[:g] = 0
    x[g : 2 * g] = torch.arange(g) - 16.0  # x / d lands on halves
    n = x.numel()
    q, d = torch.empty(n, dtype=torch.int8), torch.empty(n // g, dtype=torch.float16)
    kernels.kv_store(x.data_ptr(), n, KINDS["int8"], g, q.data_ptr(), d.data_ptr())
    ref_q, ref_d = quantize_int8(x, g)
    assert torch.equal(q, ref_q)
    assert torch.equal(d.view(torch.int16), ref_d.view(torch.int16))
    b = torch.empty(n, dtype=torch.bfloat16)
    kernels.kv_store(x.data_ptr(), n, KINDS["bf16"], 0, b.data_ptr(), 0)
    assert torch.equal(b.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "mistral_window"])
def test_fused_attends_the_cache_as_blocks_do(hf_dirs, arch, kind):
    """The C step reads bf16 and int8 caches as torch's attention over their update().
    The two compute a step's keys and values a float32 ulp or so apart, and such a value
    may round to the next bf16 one (about one in a thousand): 1e-5 of the logits' scale each."""
    model = int8_model(hf_dirs / arch, max_seq_len=64)
    ref = decode_logits(model, kind, fused=False)
    got = decode_logits(model, kind, fused=True)
    atol = (5e-5 if kind == "bf16" else 1e-5) * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=atol)
    f32 = decode_logits(model, "f32", fused=True)
    assert not torch.equal(got, f32)  # the cache's format is what was read


@pytest.mark.parametrize("isa", ops.supported_isas())
def test_long_context_on_every_path(tmp_path, monkeypatch, isa):
    """Heads of 24 (an int8 group of 24: one vector and a scalar tail), 600 positions
    (blocks of 256, the last partial) on every instruction-set path."""
    make_hf_model("mistral", tmp_path, hidden_size=96, max_position_embeddings=1024)
    model = int8_model(tmp_path, max_seq_len=1024)
    assert model.args.head_dim == 24 and model.new_cache(kind="int8")[0].group == 24
    monkeypatch.setattr(ops, "_default_isa", lambda: ops.ISAS.index(isa))
    prompt = torch.randint(3, 320, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = decode_logits(model, "int8", fused=False, prompt=prompt)
    got = decode_logits(model, "int8", fused=True, prompt=prompt)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_rows_equal_alone_whatever_their_caches(hf_dirs):
    """Sequences with int8, f32 and bf16 caches in one pass: each row's logits are those
    of its sequence decoded alone, bit for bit."""
    model = int8_model(hf_dirs / "qwen3", max_seq_len=64)
    prompts = [PROMPT, PROMPT[3:], [8, 19, 301, 44, 2]]
    kinds = ["int8", "f32", "int8"]
    alone = []
    for prompt, kind in zip(prompts, kinds):
        s = Session(model, kv_cache=kind)
        s.prefill(prompt)
        alone.append(torch.stack([s.step(t) for t in NEXT]))
    sessions = [Session(model, kv_cache="bf16")] + [Session(model, kv_cache=k) for k in kinds]
    for s, p in zip(sessions, [PROMPT, *prompts]):
        s.prefill(p)
    together = [[] for _ in prompts]
    for t in NEXT:
        out = decode(sessions, [[t]] * len(sessions))[1:]
        for i, logits in enumerate(out):
            together[i].append(logits[-1])
    for got, ref in zip(together, alone):
        assert torch.equal(torch.stack(got), ref)


def test_threads_do_not_change_results(tmp_path):
    """An int8 cache long enough that attention runs on the pool's threads."""
    make_hf_model("llama", tmp_path, max_position_embeddings=2048)
    model = int8_model(tmp_path, max_seq_len=2048)
    prompt = torch.randint(3, 320, (1100,), generator=torch.Generator().manual_seed(2)).tolist()
    results = [decode_logits(model, "int8", True, prompt, threads=n) for n in (1, 2, 3)]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_one_token_at_a_time_equals_the_prompt(hf_dirs):
    """Principle 9 with an int8 cache: each step quantizes its own rows, as the prompt's
    pass does, so the two read the same cache."""
    model = load_model(hf_dirs / "qwen3", max_seq_len=64).model
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        whole = model(tokens, 0, model.new_cache(kind="int8"), all_logits=True)[0]
        cache = model.new_cache(kind="int8")
        steps = torch.cat([model(tokens[:, i : i + 1], i, cache)[0] for i in range(len(PROMPT))])
    torch.testing.assert_close(steps, whole, rtol=1e-5, atol=1e-5)


def test_memory_of_each_format(hf_dirs):
    """int8 takes 34 bytes per 32 values (q8_0's), a 3.76th of float32; bf16 a half. The
    load's estimate and the memory plans count the format asked for."""
    model = load_model(hf_dirs / "qwen3", max_seq_len=64).model  # head_dim 32
    sizes = {kind: sum(c.nbytes for c in model.new_cache(kind=kind)) for kind in KINDS}
    assert sizes["f32"] / sizes["int8"] == pytest.approx(4 * 32 / 34)
    assert sizes["f32"] == 2 * sizes["bf16"]
    assert all(sizes[k] == cache_bytes(model.args, 64, k) for k in KINDS)
    assert type(model.new_cache(kind="int8")[0]) is Int8KVCache
    assert type(model.new_cache()[0]) is KVCache and model.new_cache()[0].kind == "f32"
    from infer.runtime.files.sources import open_source

    source = open_source(hf_dirs / "qwen3")
    f32, int8 = (estimated_bytes(source, torch.float32, 64, kv_cache=k) for k in ("f32", "int8"))
    assert f32 - int8 == sizes["f32"] - sizes["int8"]
    lm = load_model(hf_dirs / "qwen3", max_seq_len=64, kv_cache="int8")
    assert Session(lm.model).cache[0].kind == "int8"  # the loader's format is the default


def test_int8_cache_quality_on_a_real_model(smollm2_gguf):
    """SmolLM2-135M over 320 tokens of text, prefilled 64 at a time: the int8 cache's
    next-token distributions stay close to the float cache's."""
    lm = load_model(smollm2_gguf, torch.float32, max_seq_len=512)
    text = " ".join(
        f"In {1800 + 7 * i} the town council met to discuss the river, the mill and the "
        f"bridge, which had been repaired {i % 5 + 2} times since the flood."
        for i in range(12)
    )
    ids = lm.tokenizer.encode(text)[:320]
    logp = {}
    for kind in ("f32", "int8"):
        s = Session(lm.model, kv_cache=kind)
        logits = torch.cat([s.forward(ids[i : i + 64], i, all_logits=True)
                            for i in range(0, len(ids), 64)])  # fmt: skip
        logp[kind] = logits.double().log_softmax(-1)
    kl = (logp["f32"].exp() * (logp["f32"] - logp["int8"])).sum(-1)
    assert kl.mean() < 5e-4  # 1.2e-4 when written
