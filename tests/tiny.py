"""Tiny random models of each supported architecture, written as Hugging Face directories.

transformers builds and saves them (it is the test oracle); our loader reads them back.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A Hermes-style template (as Qwen2.5's and Qwen3's): tools listed in the system turn,
# earlier calls in <tool_call> tags, tool results in the user's turn; and Qwen3's switch
# enable_thinking (false: an empty thought already written).
HERMES = (
    "{%- if tools %}<|im_start|>system\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# A template that opens the thought itself (QwQ, DeepSeek-R1): the answer begins inside it;
# an earlier answer's thoughts (reasoning_content) are written back, as Qwen3's does.
THINKER = HERMES.replace(
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}",
).replace(
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}",
    "{%- else %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}{{ m.content }}",
)
# Mistral 7B v0.3's way, imitated: tools listed before the last user message, calls as
# a list after [TOOL_CALLS], results in [TOOL_RESULTS]; call ids of 9 characters or an error.
MISTRAL_TOKENS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]")  # fmt: skip
_ID_CHECK = (
    "{%- if {0} is not defined or {0} | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}"
)
MISTRAL = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{%- for c in m.tool_calls %}"
    + _ID_CHECK.replace("{0}", "c.id")
    + '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{{ ", " if not loop.last }}'
    "{%- endfor %}]<|im_end|>"
    "{%- elif m.role == 'tool' %}"
    + _ID_CHECK.replace("{0}", "m.tool_call_id")
    + '[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}'
    "[/TOOL_RESULTS]"
    "{%- elif m.role == 'assistant' %} {{ m.content }}<|im_end|>"
    "{%- endif %}{%- endfor %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # Qwen2.5-Coder's spelling
VOCAB = 320  # 256 byte tokens + specials, rounded up

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 2,
}

# name -> (transformers config class name, extra config fields)
ARCHS = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "llama3": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),
    # Local and global layers (a window of 4 within the 12-token prompt), a query scale
    # other than head_dim's, the final logit softcap.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": 4,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 3.0,
        },
    ),
}

# Mixtures of experts: 8 experts, top 2 or 3, expert widths a multiple of 32 (int4 g32).
MOE_ARCHS = {
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    ),
    # Layer 1 dense through mlp_only_layers; a shared expert; norm_topk_prob false.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
        },
    ),
    # Every second layer sparse (decoder_sparse_step 2), renormalised top k.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            "num_hidden_layers": 4,
        },
    ),
    "qwen3_moe_nonorm": (
        "Qwen3MoeConfig",
        {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 3, "intermediate_size": 64}),
}


def write_tokenizer(path: Path, extra: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer with no merges: one token per byte, plus ChatML specials
    (and `extra` special tokens after the bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i + len(SPECIALS) for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({s: i for i, s in enumerate(SPECIALS)})
    vocab.update({s: len(vocab) + i for i, s in enumerate(extra)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + list(extra))
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def set_chat_template(path: Path, template: str) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))


def make_hf_model(arch: str, path: Path, seed: int = 0, specials=(), **overrides):
    """Save a random `arch` model (float32) with a tokenizer to `path`; return the HF model.
    `specials`: more special tokens (e.g. FIM); `overrides` change its config (e.g.
    hidden_size=256)."""
    import transformers

    cls_name, extra = {**ARCHS, **MOE_ARCHS}[arch]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init leaves norm weights at 1: perturb them so the norms are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, specials)
    return model


def random_blocks(qtype: T, N: int, K: int, seed: int = 0) -> np.ndarray:
    """(N, bytes) rows of random `qtype` K-quant (or IQ4_NL) blocks (gguf-py cannot
    quantize to these), their float16 scales sane."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    at = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,),
          T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ3_S: (0,)}[qtype]  # fmt: skip
    for a in at:
        d = rng.uniform(1e-3, 2e-2, (N, K // block)).astype(np.float16)
        data[..., a : a + 2] = d.view(np.uint8).reshape(N, K // block, 2)
    return data.reshape(N, -1)


def assert_runs_fused(model, window: list[int], tol: float) -> None:
    """A session over `model` plans the fused decode step, and the window's last token
    decoded after the others gives the logits a forward over the whole window gives."""
    from infer.runtime.session import Session

    session = Session(model)
    assert session.fused is not None
    full = session.forward(window, 0, all_logits=True)
    session.reset()
    session.forward(window[:-1], 0)
    step = session.forward(window[-1:], len(window) - 1)
    torch.testing.assert_close(step[-1], full[-1], rtol=tol, atol=tol)
