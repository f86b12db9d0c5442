"""One pass over several sequences (session.decode): each sequence's logits are those of
decoding it alone, with sequences joining and leaving mid-way, for every format the fused
step runs, for mixtures of experts, on the torch path and with streamed layers, on
float32, bf16 and int8 caches side by side; and a run of guessed tokens checked in one
pass equals decoding them one at a time."""

import pytest
import torch
from test_offload import convert, make_hf, min_budget
from tiny import make_hf_model

from infer.kernels_cpu import ops
from infer.offload.stream import load_streamed
from infer.quant.formats.recipes import get_recipe
from infer.quant.quantize import quantize_model
from infer.runtime.files.checkpoint import read_checkpoint
from infer.runtime.loader import load_model
from infer.runtime.session import Session, decode, prefill_together

PROMPTS = [
    [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140],
    [8, 19, 301, 44, 2],
    [60, 61, 62, 7, 7, 7, 150, 151, 152],
]
# step at which each prompt's sequence joins the batch, and how many tokens it decodes
JOIN, STEPS = [0, 2, 4], [8, 3, 5]

pytestmark = pytest.mark.skipif(not ops.available(), reason="C extension not built")


def alone(model, prompt: list[int], steps: int, kv_cache: str | None = None) -> torch.Tensor:
    """Greedy decode after `prompt` by itself (on a cache of `kv_cache`'s format): each
    step's logits (steps, vocab)."""
    session = Session(model, kv_cache=kv_cache)
    logits = session.prefill(prompt)
    out = []
    for _ in range(steps):
        logits = session.step(int(logits.argmax()))
        out.append(logits)
    return torch.stack(out)


def batched(model, prompts=PROMPTS, join=JOIN, steps=STEPS, kv_caches=None) -> list[torch.Tensor]:
    """The same sequences decoded together, one decode() a step; sequence i joins at step
    join[i] and leaves after steps[i] tokens, its cache of kv_caches[i]'s format."""
    sessions = [Session(model, kv_cache=k) for k in kv_caches or [None] * len(prompts)]
    last = [None] * len(prompts)
    out = [[] for _ in prompts]
    t = 0
    while any(len(o) < n for o, n in zip(out, steps)):
        for i, p in enumerate(prompts):
            if join[i] == t:
                last[i] = sessions[i].prefill(p)
        live = [i for i in range(len(prompts)) if last[i] is not None and len(out[i]) < steps[i]]
        got = decode([sessions[i] for i in live], [[int(last[i].argmax())] for i in live])
        for i, logits in zip(live, got):
            last[i] = logits[-1]
            out[i].append(logits[-1])
        t += 1
    return [torch.stack(o) for o in out]


def assert_rows_equal_alone(model, exact: bool = True, kv_caches=None):
    kinds = kv_caches or [None] * len(PROMPTS)
    together = batched(model, kv_caches=kinds)
    for prompt, n, kind, got in zip(PROMPTS, STEPS, kinds, together):
        ref = alone(model, prompt, n, kind)
        if exact:
            assert torch.equal(got, ref)
        else:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
            assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched")
    for arch in ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "olmoe", "gemma3"):
        make_hf_model(arch, root / arch)
    return root


def quantized(hf_dirs, arch: str, recipe: str, **overrides):
    model = load_model(hf_dirs / arch, max_seq_len=64).model
    quantize_model(model, get_recipe(recipe, n_layers=model.args.n_layers, **overrides))
    return model


@pytest.mark.parametrize(
    "arch, recipe, overrides",
    [("llama", "int8", {}), ("llama", "int8", {"group_size": 0}),
     ("llama", "int4", {"symmetric": True}), ("llama", "int4", {"symmetric": False}),
     ("llama", "int5", {"symmetric": True}), ("llama", "int5", {"symmetric": False}),
     ("llama", "lut2", {"group_size": 32}), ("llama", "lut3", {}), ("llama", "lut2_m", {}),
     ("qwen2", "int8", {}), ("qwen3", "int4", {}), ("mistral", "int8", {}),
     ("mixtral", "int8", {}), ("qwen2_moe", "int4", {}), ("qwen2_moe", "int5", {}),
     ("olmoe", "lut2_m", {})],
)  # fmt: skip
def test_rows_equal_alone_on_the_fused_step(hf_dirs, arch, recipe, overrides):
    model = quantized(hf_dirs, arch, recipe, **overrides)
    assert Session(model).fused is not None
    assert_rows_equal_alone(model)


@pytest.mark.parametrize(
    "arch, recipe",
    [("llama", "int8"), ("qwen3", "int4"), ("mistral", "int8"), ("gemma3", "int8"),
     ("mixtral", "int8"), ("qwen2_moe", "int4")],
)  # fmt: skip
def test_rows_on_int8_caches_equal_alone(hf_dirs, arch, recipe):
    """Every row on an int8 cache (q8_0 blocks), then beside rows on float32 and bf16
    caches: each sequence's logits are those of it decoded alone on its cache."""
    model = quantized(hf_dirs, arch, recipe)
    assert Session(model, kv_cache="int8").fused is not None
    assert_rows_equal_alone(model, kv_caches=["int8"] * 3)
    assert_rows_equal_alone(model, kv_caches=["bf16", "int8", "f32"])


def test_rows_equal_alone_int6(tmp_path):
    make_hf_model("llama", tmp_path / "m", hidden_size=256, intermediate_size=512)
    model = load_model(tmp_path / "m", max_seq_len=64).model
    quantize_model(model, get_recipe("int6"))
    assert Session(model).fused is not None
    assert_rows_equal_alone(model)


@pytest.mark.parametrize("recipe", ["q4_k", "q3_k", "q2_k", "iq4_xs"])
def test_rows_equal_alone_k_quants(tmp_path, recipe):
    """The K-quants' and iq4_xs's blocks of 256 (down_proj's rows of 320 fall back to int4)."""
    from infer.quant.formats.base import FORMATS

    make_hf_model("llama", tmp_path / "m", hidden_size=256, intermediate_size=320)
    model = load_model(tmp_path / "m", max_seq_len=64).model
    quantize_model(model, get_recipe(recipe))
    assert type(model.layers[0].mlp.up_proj) is FORMATS[recipe]
    assert Session(model).fused is not None
    assert_rows_equal_alone(model)


def test_rows_equal_alone_on_the_torch_path(hf_dirs):
    model = load_model(hf_dirs / "qwen2_moe", max_seq_len=64).model  # float: no fused step
    assert Session(model).fused is None
    assert_rows_equal_alone(model, exact=False)


@pytest.mark.parametrize("kv_cache", ["f32", "int8"])
@pytest.mark.parametrize("fused", [True, False])
def test_guessed_tokens_in_one_pass_equal_one_at_a_time(hf_dirs, fused, kv_cache):
    model = quantized(hf_dirs, "mistral", "int4")  # a window of 8: rows cross it
    guesses = [41, 7, 233, 18, 90, 5, 5, 61, 2, 300, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    one, together = Session(model, kv_cache=kv_cache), Session(model, kv_cache=kv_cache)
    if not fused:
        one.fused = together.fused = None
    for s in (one, together):
        s.prefill(PROMPTS[0])
    ref = torch.stack([one.step(t) for t in guesses])
    got = decode([together], [guesses])[0]  # 20 rows: more than one pass of the C step
    assert together.tokens == one.tokens
    if fused:
        assert len(guesses) > together.fused.max_rows
        assert torch.equal(got, ref)
    else:
        # torch's path takes 20 rows through another kernel (the integer GEMM where the
        # host has one): keys a hair apart can round to int8 codes one step apart
        tol = (1e-3 if kv_cache == "int8" else 1e-4) * ref.abs().max().item()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=tol)
    # guesses that were not accepted go; the next pass writes their positions again
    together.truncate(len(PROMPTS[0]) + 3)
    one.truncate(len(PROMPTS[0]) + 3)
    assert torch.equal(decode([together], [[77]])[0][-1], one.step(77)) or not fused


@pytest.mark.parametrize("kv_cache", ["f32", "int8"])
def test_guesses_across_attention_blocks_equal_one_at_a_time(tmp_path, kv_cache):
    """Past 256 positions attention splits into blocks, and the rows of a sequence's
    guesses share each block's tasks: 20 rows crossing from the second block into the
    third, beside a sequence decoding one token, equal one at a time bit for bit."""
    make_hf_model("llama", tmp_path, max_position_embeddings=600)
    model = load_model(tmp_path).model
    quantize_model(model, get_recipe("int8", n_layers=model.args.n_layers))
    prompt = [(7 * i) % 300 + 3 for i in range(500)]
    guesses = [(11 * i) % 300 + 1 for i in range(20)]
    one, other, together, beside = (Session(model, 600, kv_cache=kv_cache) for _ in range(4))
    for s, p in ((one, prompt), (together, prompt), (other, PROMPTS[1]), (beside, PROMPTS[1])):
        s.prefill(p)
    ref = torch.stack([one.step(t) for t in guesses])
    got, side = decode([together, beside], [guesses, [9]])
    assert together.fused is not None and torch.equal(got, ref)
    assert torch.equal(side[0], other.step(9))


def test_sequences_and_guesses_share_a_pass(hf_dirs):
    """One session checking guesses beside others decoding a token each."""
    model = quantized(hf_dirs, "qwen3", "int8")
    a, b, c = (Session(model) for _ in range(3))
    refs = [Session(model) for _ in range(3)]
    for s, r, p in zip((a, b, c), refs, PROMPTS):
        s.prefill(p)
        r.prefill(p)
    got = decode([a, b, c], [[1], [2, 3, 4, 5], [6]])
    ref = [
        torch.stack([r.step(t) for t in toks]) for r, toks in zip(refs, [[1], [2, 3, 4, 5], [6]])
    ]
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


@pytest.mark.parametrize("arch, recipe", [("llama", "int8"), ("qwen2_moe", None), ("gemma3", None)])
def test_prompts_prefilled_together_equal_alone(hf_dirs, arch, recipe):
    """Prompts' chunks of several sequences in one pass (prefill_together): each prompt's
    logits and cache those of its prefill alone, a cached prefix reused, and the tokens
    decoded after it the same. Gemma's sliding window (8) is crossed."""
    if recipe:
        model = quantized(hf_dirs, arch, recipe)
    else:
        model = load_model(hf_dirs / arch, max_seq_len=64).model
    prompts = [PROMPTS[0] * 2, PROMPTS[1], PROMPTS[2] + PROMPTS[0]]
    sessions = [Session(model) for _ in prompts]
    sessions[2].prefill(PROMPTS[2] + [1, 2])  # holds the prompt's first 9 tokens
    last = [None] * len(prompts)
    while any(x is None for x in last):
        todo = [i for i, x in enumerate(last) if x is None]
        got = prefill_together([sessions[i] for i in todo], [prompts[i] for i in todo], 10)
        for i, x in zip(todo, got):
            last[i] = x
    for s, p, x in zip(sessions, prompts, last):
        ref = Session(model)
        want = ref.prefill(p, 10)
        assert s.tokens == p
        tol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(x, want, rtol=1e-4, atol=tol)
        t = int(want.argmax())
        torch.testing.assert_close(s.step(t), ref.step(t), rtol=1e-4, atol=tol)


def test_decode_refuses_bad_rows(hf_dirs):
    model = quantized(hf_dirs, "llama", "int8")
    s, other = Session(model), Session(quantized(hf_dirs, "llama", "int8"))
    s.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="different models"):
        decode([s, other], [[1], [2]])
    with pytest.raises(ValueError, match="twice"):
        decode([s, s], [[1], [2]])
    with pytest.raises(ValueError, match="no tokens"):
        decode([s], [[]])


def test_streamed_layers_read_once_for_all_rows(tmp_path):
    """A streamed model decodes its sequences together as alone, and a pass reads each
    streamed layer once whatever its rows. The torch path: an MLP width of a multiple of 32
    (as real models'), or torch's SiLU would take a row's last elements by its scalar
    tail alone and by its vector body in a batch, an ulp apart."""
    hf = make_hf(tmp_path / "hf", intermediate_size=128)
    ckpt = read_checkpoint(convert(hf, tmp_path / "int8", "int8"))
    budget, _ = min_budget(ckpt)
    model, stream, plan = load_streamed(ckpt, torch.float32, 64, budget, process_bytes=0)
    try:
        assert plan.window == 1 and Session(model).fused is None
        refs = [alone(model, p, n) for p, n in zip(PROMPTS, STEPS)]
        stream.reset_stats()
        sessions = [Session(model) for _ in PROMPTS]
        last = [s.prefill(p) for s, p in zip(sessions, PROMPTS)]
        prefill = stream.snapshot()
        got = decode(sessions, [[int(x.argmax())] for x in last])
        after = stream.snapshot()
        assert after.passes - prefill.passes == 1
        # the streamed layers once (reads run up to a window ahead of the pass), not per row
        assert after.bytes_read - prefill.bytes_read < 1.5 * plan.streamed_bytes
        for g, r in zip(got, refs):
            assert torch.equal(g[-1], r[0])
    finally:
        stream.close()


def test_default_model_greedy_tokens_batched_equal_alone(smollm2_gguf):
    model = load_model(smollm2_gguf, max_seq_len=256).model
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 28, 638, 359, 346, 47], [1, 2]]
    steps = [12, 12, 12]
    together = batched(model, prompts, [0, 3, 5], steps)
    for p, n, got in zip(prompts, steps, together):
        assert torch.equal(got.argmax(-1), alone(model, p, n).argmax(-1))
        assert torch.equal(got, alone(model, p, n))
