"""Gemma 3 on a real file (Gemma-3-270M, Q4_K_M GGUF), its chat template, a tiny GGUF
written as llama.cpp writes it, and the checks on its config's numbers.

The tiny random Gemma 3 against transformers is in test_model.py (tiny.ARCHS).
"""

from pathlib import Path

import pytest
import tiny
import torch
from real_files import pulled

from infer import InferError
from infer.runtime.generate import generate, make_sampler
from infer.runtime.loader import load_model
from infer.runtime.model.chat_template import ChatTemplate
from infer.runtime.model.families import model_args
from infer.runtime.session import Session

GGUF = pulled("gemma3-270m", "INFER_TEST_GEMMA3")
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
    if GGUF is None or not GGUF.is_file():
        pytest.skip("Gemma 3 270M is not here: `infer pull gemma3-270m`, or set INFER_TEST_GEMMA3")
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
    """On the kernels (Q5_0 as int5, Q6_K as int6 and Q4_K as q4_k bit for bit,
    activations quantized per block) the prompt's logits stay close to the float model's:
    measured max |diff| 0.0028 of logits up to 26, KL at most 2e-7 (0.026 and 9e-6 with
    Q4_K in int4, scales rounded to float16; 0.76 and 4e-3 when Q5_0 was held in int8)."""
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
# tensor_mapping): the inverse of the GGUF name map in runtime/files/gguf_meta.py.
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


def write_tiny_gguf(path: Path, ref, **metadata) -> Path:
    """`ref`, a tiny transformers Gemma 3, written as llama.cpp's converter writes it: its
    names, norm weights plus one, per-layer sliding pattern, local rope base. `metadata`:
    values that replace the converter's, by key after "gemma3.", as (gguf-py adder, value)."""
    from test_gguf import write_gguf

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
    kv = {
        "context_length": ("add_uint32", c.max_position_embeddings),
        "embedding_length": ("add_uint32", c.hidden_size),
        "block_count": ("add_uint32", c.num_hidden_layers),
        "feed_forward_length": ("add_uint32", c.intermediate_size),
        "attention.head_count": ("add_uint32", c.num_attention_heads),
        "attention.head_count_kv": ("add_uint32", c.num_key_value_heads),
        "attention.key_length": ("add_uint32", c.head_dim),
        "attention.value_length": ("add_uint32", c.head_dim),
        "attention.layer_norm_rms_epsilon": ("add_float32", c.rms_norm_eps),
        "rope.freq_base": ("add_float32", 1e6),
        "rope.freq_base_swa": ("add_float32", 1e4),
        "attention.sliding_window": ("add_uint32", c.sliding_window),
        "attention.sliding_window_pattern": (
            "add_array", [t == "sliding_attention" for t in c.layer_types]
        ),
        "final_logit_softcapping": ("add_float32", c.final_logit_softcapping),
        **metadata,
    }  # fmt: skip
    return write_gguf(path, "gemma3", tensors, [(f, f"gemma3.{k}", v) for k, (f, v) in kv.items()])


def test_tiny_gguf_matches_transformers(tmp_path):
    """A tiny Gemma 3 written as llama.cpp's converter writes it loads to transformers'
    logits. GGUF has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim)."""
    from tiny import make_hf_model

    from infer.runtime.files.build import build
    from infer.runtime.files.sources import open_source

    ref = make_hf_model("gemma3", tmp_path / "hf", query_pre_attn_scalar=32)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", ref)
    ours = build(open_source(path), torch.float32, max_seq_len=64)
    ids = torch.tensor([[5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]])
    with torch.inference_mode():
        expected = ref(ids).logits
        got = ours(ids, 0, ours.new_cache(), all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# A Gemma 3 config.json as tiny.ARCHS["gemma3"] writes it, in the older hub form.
CONFIG = {
    "model_type": "gemma3_text",
    **tiny.COMMON,
    "head_dim": 32,
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 4,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": -1}, "num_hidden_layers = -1: must be 1 to 1024"),
        ({"head_dim": 33}, "head_dim = 33: is odd (rope rotates pairs)"),
        (
            {"layer_types": ["sliding_attention"]},
            "layer_types = ['sliding_attention']: has 1 entries for 3 layers",
        ),
        (
            {"layer_types": ["sliding_attention", "full", "sliding_attention"]},
            "layer_types = 'full': must be 'sliding_attention' or 'full_attention'",
        ),
        (
            {"layer_types": None, "sliding_window_pattern": 0},
            "sliding_window_pattern = 0: must be 1 to 1024",
        ),
        ({"sliding_window": -4}, "sliding_window = -4: must be 1 to 16777216"),
        ({"rope_local_base_freq": float("nan")}, "rope_local_base_freq = nan: must be at least"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "linear"}}},
            "missing rope_parameters.full_attention.factor",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_theta": "x"}}},
            "rope_parameters.sliding_attention.rope_theta = 'x': must be a number",
        ),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar = 0: must be more than 0"),
        ({"final_logit_softcapping": "x"}, "final_logit_softcapping = 'x': must be a number"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings = 'yes': must be true or false"),
        ({"hidden_activation": "relu"}, "hidden_activation = 'relu': unsupported"),
    ],
)
def test_bad_config_fails_in_one_line(change, message):
    """Gemma 3's numbers are checked as every family's (config.ModelArgs.from_dict)."""
    model_args(CONFIG, "c.json")  # the base is good
    with pytest.raises(InferError) as err:
        model_args({**CONFIG, **change}, "c.json")
    assert str(err.value).startswith(f"c.json: {message}"), err.value


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (
            {"attention.sliding_window": ("add_int32", -4)},
            "gemma3.attention.sliding_window = -4: must be 1 to",
        ),
        (
            {"rope.freq_base_swa": ("add_float32", 1.0)},
            "gemma3.rope.freq_base_swa = 1.0: must be at least 100",
        ),
        (
            {"final_logit_softcapping": ("add_float32", -1.0)},
            "gemma3.final_logit_softcapping = -1.0: must be at least 0",
        ),
        (
            {"attention.sliding_window_pattern": ("add_array", [True, False])},
            "gemma3.attention.sliding_window_pattern = [True, False]: must be a layer count",
        ),
    ],
)
def test_bad_gguf_metadata_is_named_by_its_key(tmp_path, metadata, message):
    from tiny import make_hf_model

    ref = make_hf_model("gemma3", tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "bad.gguf", ref, **metadata)
    with pytest.raises(InferError) as err:
        load_model(path, max_seq_len=32)
    assert str(err.value).startswith(f"{path}: {message}"), err.value


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
