"""Write a GGUF model with random weights in the exact shape of Llama-3.2-1B.

    python benchmarks/make_llama1b.py llama1b-f16.gguf [--dtype f16|f32] [--seed 0]

Speed depends on shapes, not on trained values, so this stands in for the real 1B
model (which cannot be fetched here) when llama.cpp and `infer` are timed side by side:

    hidden 2048, 16 layers, 32 heads, 8 kv heads, head_dim 64, intermediate 8192,
    vocab 128256, tied embeddings, rope theta 500000 with llama3 scaling (factor 32,
    low/high freq factor 1/4, original context 8192), RMSNorm eps 1e-5.

What it holds, and why:
  - Weights: normal(0, 0.02), as Llama's initializer_range, so activations stay finite
    through 16 layers; norm weights are ones. One torch.Generator seeded with --seed
    draws every tensor in file order, so a seed gives the same file byte for byte.
  - Layout: each matrix is drawn in the Hugging Face layout, then attn_q / attn_k rows are
    permuted as llama.cpp's convert_hf_to_gguf.py LlamaModel.permute does, so the file
    means the same model to llama.cpp and to readers that un-permute (ours does).
  - Llama 3 scaling travels as the `rope_freqs.weight` tensor (32 factors), computed as
    convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors does for rope_type llama3.
  - Tokenizer: the default model's (SmolLM2, gpt2-type BPE, 49152 tokens, its merges, its
    pre-tokenizer and chat template) verbatim, padded with 79104 `<|pad_N|>` tokens of type
    UNUSED to 128256, so the embedding and the tied output layer keep the 1B shape
    (262.7M of the 1.24B parameters, and a fifth of the bytes each decoded token reads).
    Unused tokens are never produced by the tokenizer and are not special (llama.cpp does
    not scan text for them), so prompts tokenize exactly as with SmolLM2.
  - Types: matrices in --dtype (F16 by default: 2.5 GB; F32: 4.9 GB), norms and rope
    factors in F32, as llama.cpp's converter writes them. llama-quantize makes Q8_0, Q4_0
    and K-quants from it (2048 and 8192 are multiples of 256); `infer quantize` makes ours.

Tensors are generated and written one at a time (GGUFWriter's streaming calls), so memory
stays at about one embedding table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

# Llama-3.2-1B's config.json, the numbers that matter here.
CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
}

UNUSED = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """Per-frequency divisors, as convert_hf_to_gguf.py writes `rope_freqs.weight`."""
    dim, base, s = cfg["head_dim"], cfg["rope_theta"], cfg["rope_scaling"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old_len = s["original_max_position_embeddings"]
    low_wavelen = old_len / s["low_freq_factor"]
    high_wavelen = old_len / s["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (old_len / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf.py)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape (rows, cols), kind) in file order; kind: matrix, norm, q, k, rope."""
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_rows = cfg["num_attention_heads"] * hd
    kv_rows = cfg["num_key_value_heads"] * hd
    specs = [
        ("token_embd.weight", (cfg["vocab_size"], d), "matrix"),
        ("rope_freqs.weight", (hd // 2,), "rope"),
    ]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}"
        specs += [
            (f"{b}.attn_norm.weight", (d,), "norm"),
            (f"{b}.attn_q.weight", (q_rows, d), "q"),
            (f"{b}.attn_k.weight", (kv_rows, d), "k"),
            (f"{b}.attn_v.weight", (kv_rows, d), "matrix"),
            (f"{b}.attn_output.weight", (d, q_rows), "matrix"),
            (f"{b}.ffn_norm.weight", (d,), "norm"),
            (f"{b}.ffn_gate.weight", (f, d), "matrix"),
            (f"{b}.ffn_up.weight", (f, d), "matrix"),
            (f"{b}.ffn_down.weight", (d, f), "matrix"),
        ]
    specs.append(("output_norm.weight", (d,), "norm"))  # no output.weight: tied
    return specs


def tokenizer_metadata(path: Path) -> dict:
    """The gpt2-type tokenizer keys of a GGUF file (the default model's)."""
    from infer.runtime.files.gguf import GGUFFile

    md = GGUFFile(path).metadata
    if md.get("tokenizer.ggml.model") != "gpt2":
        sys.exit(f"{path}: tokenizer is {md.get('tokenizer.ggml.model')!r}, expected 'gpt2'")
    return {k: v for k, v in md.items() if k.startswith("tokenizer.")}


def add_tokenizer(w: GGUFWriter, tok: dict, vocab_size: int) -> None:
    tokens = list(tok["tokenizer.ggml.tokens"])
    types = list(tok["tokenizer.ggml.token_type"])
    if len(tokens) > vocab_size:
        sys.exit(f"the tokenizer has {len(tokens)} tokens, more than the vocab of {vocab_size}")
    pad = vocab_size - len(tokens)
    tokens += [f"<|pad_{i}|>" for i in range(pad)]
    types += [UNUSED] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(tok["tokenizer.ggml.merges"]))
    for key, add in [
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("unknown_token_id", w.add_unk_token_id),
        ("padding_token_id", w.add_pad_token_id),
        ("add_bos_token", w.add_add_bos_token),
        ("add_space_prefix", w.add_add_space_prefix),
        ("chat_template", w.add_chat_template),
    ]:
        if f"tokenizer.ggml.{key}" in tok or f"tokenizer.{key}" in tok:
            add(tok.get(f"tokenizer.ggml.{key}", tok.get(f"tokenizer.{key}")))


def write_model(out: Path, tokenizer_from: Path, *, dtype: str, seed: int, cfg: dict) -> None:
    float_type = {"f16": np.float16, "f32": np.float32}[dtype]
    w = GGUFWriter(out, "llama")
    w.add_name("Llama-3.2-1B shape, random weights")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(LlamaFileType.MOSTLY_F16 if dtype == "f16" else LlamaFileType.ALL_F32)
    add_tokenizer(w, tokenizer_metadata(tokenizer_from), cfg["vocab_size"])

    specs = tensor_specs(cfg)
    for name, shape, kind in specs:
        t = float_type if len(shape) == 2 else np.float32
        nbytes = math.prod(shape) * np.dtype(t).itemsize
        raw = GGMLQuantizationType.F16 if t == np.float16 else GGMLQuantizationType.F32
        w.add_tensor_info(name, shape, np.dtype(t), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    gen = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    for name, shape, kind in specs:
        if kind == "rope":
            data = llama3_rope_factors(cfg)
        elif kind == "norm":
            data = np.ones(shape, dtype=np.float32)
        else:
            m = torch.randn(shape, generator=gen).mul_(std)
            if kind == "q":
                m = permute(m, cfg["num_attention_heads"])
            elif kind == "k":
                m = permute(m, cfg["num_key_value_heads"])
            data = m.numpy().astype(float_type)
        w.write_tensor_data(data)
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--dtype", choices=["f16", "f32"], default="f16", help="matrix type")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="a gpt2-type GGUF whose tokenizer to reuse (default: the default model)",
    )
    p.add_argument(
        "--layers", type=int, default=CONFIG["num_hidden_layers"], help="fewer for a quick check"
    )
    args = p.parse_args()

    src = args.tokenizer_from
    if src is None:
        from infer.runtime.registry import resolve

        src = resolve(None, progress=False).path
    cfg = {**CONFIG, "num_hidden_layers": args.layers}
    t0 = time.perf_counter()
    write_model(args.out, src, dtype=args.dtype, seed=args.seed, cfg=cfg)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
