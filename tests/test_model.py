"""Our Llama-family runtime against transformers, on tiny random models of each architecture."""

import pytest
import torch
from tiny import ARCHS, COMMON, MOE_ARCHS, make_hf_model

from infer.runtime.files.build import build
from infer.runtime.files.sources import open_source
from infer.runtime.model.families import model_args, model_class
from infer.runtime.session import Session

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = make_hf_model(request.param, path)
    ours = build(open_source(path), torch.float32, max_seq_len=64)
    return ref, ours


@torch.inference_mode()
def test_prompt_logits_match(pair):
    ref, ours = pair
    ids = torch.tensor([PROMPT])
    expected = ref(ids).logits
    got = ours(ids, 0, ours.new_cache(), all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_token_by_token_equals_full_forward(pair):
    ref, ours = pair
    expected = ref(torch.tensor([PROMPT])).logits[0]
    cache = ours.new_cache()
    for pos, token in enumerate(PROMPT):
        got = ours(torch.tensor([[token]]), pos, cache)[0, -1]
        torch.testing.assert_close(got, expected[pos], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_chunked_prefill_and_prefix_reuse(pair):
    ref, ours = pair
    expected = ref(torch.tensor([PROMPT])).logits[0, -1]
    session = Session(ours)
    torch.testing.assert_close(session.prefill(PROMPT, chunk=5), expected, atol=1e-4, rtol=1e-4)
    # A second call sharing a prefix recomputes only the tail.
    other = PROMPT[:7] + [42, 43]
    expected = ref(torch.tensor([other])).logits[0, -1]
    assert session.reused_prefix(other) == 7
    torch.testing.assert_close(session.prefill(other, chunk=4), expected, atol=1e-4, rtol=1e-4)
    assert session.tokens == other


def test_bfloat16_close_to_float32(tmp_path):
    make_hf_model("qwen3", tmp_path)
    info = open_source(tmp_path)
    f32 = build(info, torch.float32, 64)
    bf16 = build(info, torch.bfloat16, 64)
    with torch.inference_mode():
        a = f32(torch.tensor([PROMPT]), 0, f32.new_cache(), all_logits=True)
        b = bf16(torch.tensor([PROMPT]), 0, bf16.new_cache(), all_logits=True).float()
    assert (a - b).abs().max() < 0.1 * a.abs().max()


@pytest.mark.parametrize("arch", sorted({**ARCHS, **MOE_ARCHS}))
@pytest.mark.parametrize("tied", [True, False])
def test_param_shapes_are_the_modules(arch, tied):
    """ModelArgs.param_shapes (what `infer info` checks a file against, without torch) is
    every parameter of the model built on the meta device, and n_params their sum."""
    import math

    import transformers

    cls_name, extra = {**ARCHS, **MOE_ARCHS}[arch]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra, "tie_word_embeddings": tied})
    args = model_args(cfg.to_dict(), arch)
    with torch.device("meta"):
        model = model_class(args)(args)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert args.param_shapes() == {k: tuple(v.shape) for k, v in params.items()}
    stored = [v for k, v in params.items() if not (tied and k == "lm_head.weight")]
    assert args.n_params == sum(math.prod(v.shape) for v in stored)
