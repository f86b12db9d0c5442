"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end."""

import pytest
import torch

from infer.runtime.generate import generate, make_sampler
from infer.runtime.loader import load_model

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
    for t in generate(smollm2.model, ids, make_sampler(temperature=0), max_tokens=40):
        if t in tok.stop_ids:
            break
        out.append(t)
    assert tok.decode(out) == GOLDEN


def test_logits_match_transformers_gguf_loader(smollm2, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    ids = smollm2.tokenizer.encode_chat(QUESTION)
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits
        smollm2.model.cached_tokens.clear()
        got = smollm2.model(torch.tensor([ids]), 0, all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
