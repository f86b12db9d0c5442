"""Gemma 3 on a real file (Gemma-3-270M, Q4_K_M GGUF), and its chat template.

The tiny random Gemma 3 against transformers is in test_model.py (tiny.ARCHS).
"""

import os
from pathlib import Path

import pytest
import torch

from infer.runtime.generate import generate, make_sampler
from infer.runtime.loader import load_model
from infer.runtime.model.chat_template import ChatTemplate
from infer.runtime.session import Session

GGUF = Path(os.environ.get("INFER_TEST_GEMMA3", "/work/models/gemma3/gemma-3-270m-q4_k_m.gguf"))
# prompt -> (its tokens, 32 greedy tokens): transformers 5.24's Gemma3ForCausalLM loading
# the same file with gguf_file= (dequantized to float32) and generate(do_sample=False).
GOLDEN = {
    "The capital of France is": (
        [2, 818, 5279, 529, 7001, 563],
        [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001,
         532, 506, 1855, 7488, 3207, 528, 3879, 236761, 1030, 563, 5628, 528, 506, 6029, 529,
         506, 2891],
    ),
    "Why is the sky blue?": (
        [2, 11355, 563, 506, 7217, 3730, 236881],
        [108, 236840, 2887, 236743, 236771, 236771, 236771, 236770, 236842, 108, 236777, 236789,
         236757, 496, 3103, 23894, 1003, 672, 236761, 564, 236789, 560, 1010, 6013, 496, 2606,
         529, 6249, 580, 506, 3660, 532],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def gemma3():
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} not present (INFER_TEST_GEMMA3 names another copy)")
    return load_model(GGUF, torch.float32, max_seq_len=128, dequantize=True)


@pytest.mark.slow
def test_greedy_matches_transformers_gguf_loader(gemma3):
    tok = gemma3.tokenizer
    for prompt, (prompt_ids, golden) in GOLDEN.items():
        ids = tok.encode(prompt)
        assert ids == prompt_ids
        out = list(generate(Session(gemma3.model), ids, make_sampler(temperature=0), 32))
        assert out == golden, prompt


@pytest.mark.slow
def test_kernels_close_to_float(gemma3):
    """On the kernels (Q5_0 and Q6_K held in int8, Q4_K in int4, activations quantized
    per block) the prompt's logits stay close to the float model's: measured max |diff|
    0.76 of logits up to 26, KL at most 4e-3. Gemma's large activations make this ~1e4x
    SmolLM2's KL; greedy runs part after ~10 tokens, as llama.cpp's do from the float."""
    on_kernels = load_model(GGUF, torch.float32, max_seq_len=128)
    assert on_kernels.model.runs_on_kernels()
    ids = torch.tensor([gemma3.tokenizer.encode("Why is the sky blue?")])
    with torch.inference_mode():
        x = on_kernels.model(ids, 0, on_kernels.model.new_cache(), all_logits=True)
        y = gemma3.model(ids, 0, gemma3.model.new_cache(), all_logits=True)
    kl = torch.sum(y.softmax(-1) * (y.log_softmax(-1) - x.log_softmax(-1)), -1)
    assert kl.max() < 2e-2
    assert torch.equal(x.argmax(-1), y.argmax(-1))


# Gemma 3's template as the instruction-tuned checkpoints ship it (google/gemma-3-*-it
# tokenizer_config.json): a system message folds into the first user turn.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def test_chat_template_renders_in_the_sandbox():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue? "},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": [{"type": "text", "text": "And sunsets?"}]},
    ]
    text = ChatTemplate(GEMMA3_TEMPLATE).render(messages, bos_token="<bos>")
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhy is the sky blue?<end_of_turn>\n"
        "<start_of_turn>model\nRayleigh scattering.<end_of_turn>\n"
        "<start_of_turn>user\nAnd sunsets?<end_of_turn>\n<start_of_turn>model\n"
    )
