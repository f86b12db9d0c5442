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
    assert Session(on_kernels.model).fused is not None  # decode runs the fused C step
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


# HF name -> llama.cpp's GGUF name for a Gemma 3 block (conversion/gemma.py, gguf-py's
# tensor_mapping): the inverse of the GGUF name map in runtime/files/gguf.py.
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def test_tiny_gguf_matches_transformers(tmp_path):
    """A tiny Gemma 3 written as llama.cpp's converter writes it (its names, norm weights
    plus one, per-layer sliding pattern, local rope base) loads to transformers' logits.
    GGUF has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim)."""
    from test_gguf import write_gguf
    from tiny import make_hf_model

    from infer.runtime.files.build import build
    from infer.runtime.files.sources import open_source

    ref = make_hf_model("gemma3", tmp_path / "hf", query_pre_attn_scalar=32)
    c = ref.config
    tensors = {}
    for name, p in ref.state_dict().items():
        w = p.float().numpy().copy()
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("norm.weight"):
            w += 1.0
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            tensors[f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"] = w
    a = "gemma3"
    kv = [
        ("add_uint32", f"{a}.context_length", c.max_position_embeddings),
        ("add_uint32", f"{a}.embedding_length", c.hidden_size),
        ("add_uint32", f"{a}.block_count", c.num_hidden_layers),
        ("add_uint32", f"{a}.feed_forward_length", c.intermediate_size),
        ("add_uint32", f"{a}.attention.head_count", c.num_attention_heads),
        ("add_uint32", f"{a}.attention.head_count_kv", c.num_key_value_heads),
        ("add_uint32", f"{a}.attention.key_length", c.head_dim),
        ("add_uint32", f"{a}.attention.value_length", c.head_dim),
        ("add_float32", f"{a}.attention.layer_norm_rms_epsilon", c.rms_norm_eps),
        ("add_float32", f"{a}.rope.freq_base", 1e6),
        ("add_float32", f"{a}.rope.freq_base_swa", 1e4),
        ("add_uint32", f"{a}.attention.sliding_window", c.sliding_window),
        ("add_array", f"{a}.attention.sliding_window_pattern",
         [t == "sliding_attention" for t in c.layer_types]),
        ("add_float32", f"{a}.final_logit_softcapping", c.final_logit_softcapping),
    ]  # fmt: skip
    path = write_gguf(tmp_path / "tiny.gguf", a, tensors, kv)
    ours = build(open_source(path), torch.float32, max_seq_len=64)
    ids = torch.tensor([[5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]])
    with torch.inference_mode():
        expected = ref(ids).logits
        got = ours(ids, 0, ours.new_cache(), all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_quantized_runs_fused(tmp_path):
    """int4 linears: the session plans the fused C step, and a token decoded by it gives
    the logits of a forward over the whole window (test_fused_decode checks the step
    against the blocks for every format)."""
    from tiny import assert_runs_fused, make_hf_model

    from infer.quant.formats.recipes import get_recipe
    from infer.quant.quantize import quantize_model

    make_hf_model("gemma3", tmp_path)
    model = load_model(tmp_path, max_seq_len=64).model
    quantize_model(model, get_recipe("int4", n_layers=model.args.n_layers))
    assert_runs_fused(model, [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140], 1e-4)
