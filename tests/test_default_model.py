"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end."""

import pytest
import torch

from infer.runtime.generate import generate, make_sampler
from infer.runtime.loader import load_model
from infer.runtime.session import Session

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
# Greedy, float32, 40 tokens. Identical to transformers' own GGUF loader's greedy output.
GOLDEN = (
    "The answer to this question lies in the intricate dance of light and color. "
    "The sky appears blue because of a phenomenon known as Rayleigh scattering. "
    "This occurs when light encounters molecules of air, which scatter"
)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(smollm2_gguf, torch.float32, max_seq_len=512)


def test_golden_greedy_answer(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode_chat(QUESTION)
    out = []
    session = Session(smollm2.model)
    for t in generate(session, ids, make_sampler(temperature=0), max_tokens=40):
        if t in tok.stop_ids:
            break
        out.append(t)
    assert tok.decode(out) == GOLDEN


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(smollm2, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([smollm2.tokenizer.encode_chat(QUESTION)])
    dequantized = load_model(smollm2_gguf, torch.float32, max_seq_len=512, dequantize=True)
    with torch.inference_mode():
        expected = ref(ids).logits
        got = smollm2.model(ids, 0, smollm2.model.new_cache(), all_logits=True)
        got_float = dequantized.model(ids, 0, dequantized.model.new_cache(), all_logits=True)
    # The model, in float32 throughout, to float32's summation order.
    torch.testing.assert_close(got_float, expected, atol=1e-3, rtol=0)
    # On the kernels, whose prompt GEMM keeps 15 bits of the activations per block of 32
    # where the CPU has vpdpbusd (kernels_cpu/csrc/kernels.h): logits within ~1e-2 of 15-25,
    # KL ~1e-7 (test_runs_its_blocks_on_the_kernels).
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=0)


@pytest.mark.slow
def test_runs_its_blocks_on_the_kernels(smollm2, smollm2_gguf):
    """Q4_1 layers on the int4 kernels, the tied Q8_0 table on int8, as llama.cpp runs the
    file; the dequantized float model (`infer eval --ref`) is the same to ~1e-7 in KL."""
    from infer.quant.formats.int4 import Int4Linear
    from infer.quant.formats.int8 import Int8Linear

    model = smollm2.model
    assert type(model.layers[7].mlp.down_proj) is Int4Linear
    assert type(model.lm_head) is Int8Linear and model.embed_tokens.table is model.lm_head
    ref = load_model(smollm2_gguf, torch.float32, max_seq_len=512, dequantize=True).model
    ids = torch.tensor([smollm2.tokenizer.encode_chat(QUESTION)])
    with torch.inference_mode():
        got = model(ids, 0, model.new_cache(), all_logits=True)[0].log_softmax(-1)
        expected = ref(ids, 0, ref.new_cache(), all_logits=True)[0].log_softmax(-1)
    kl = (expected.exp() * (expected - got)).sum(-1)
    assert kl.max() < 1e-5
