"""Recipes: which format each weight of a model gets.

A recipe is a callable `name -> spec | None`. `name` is a module's Hugging Face-style
name without the "model." prefix ("layers.3.mlp.down_proj", "lm_head", "embed_tokens");
`spec` is {"format": ..., **params} for `FORMATS[format].from_float`, None keeps the
weight in float. With tied embeddings the one table is asked about as "lm_head" (as
llama.cpp gives a tied token_embd the output layer's type).

Every named recipe keeps the embeddings and the output layer in int8 (Q8_0-compatible;
in the "int8" and "int6" recipes they are in that format like every other weight):
they are the most sensitive tensors (llama.cpp keeps the output at Q6_K or better), and
in small models with tied embeddings, like the default one, they are one tensor.

Mixture-of-experts layers: each expert's projections ("layers.3.mlp.experts.7.down_proj")
and a shared expert's ("layers.3.mlp.shared_expert.up_proj") are treated as the MLP's
projections of the same name. The router ("layers.3.mlp.gate") and the shared expert's
gate stay in float in every recipe, as llama.cpp keeps ffn_gate_inp: they are a tiny
fraction of the weights, and an error there changes which experts run.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ... import InferError
from . import int4, int5, int6, int8, iq4xs, lut, q2k, q3k, q4k, q5k  # noqa: F401  (register)
from .base import FORMATS

Recipe = Callable[[str], "dict | None"]

# layers.N.<self_attn|mlp>.<projection>, an expert's or shared expert's projection included
_BLOCK = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(?:experts\.\d+\.|shared_expert\.)?(\w+)")
_ROUTER = re.compile(r"layers\.\d+\.mlp\.(gate|shared_expert_gate)")
INT8 = {"format": "int8", "group_size": 32}
INT4 = {"format": "int4", "group_size": 32, "symmetric": False}
INT5 = {"format": "int5", "group_size": 32, "symmetric": False}
# A spec may name the spec to use instead where its format does not fit a weight's rows
# ("fallback"; without one, quantize.FALLBACK): int6's blocks of 256, else int8 g32.
INT6 = {"format": "int6", "fallback": INT8}


def spec_params(spec: dict) -> dict:
    """A spec's format parameters: all but its format and fallback."""
    return {k: v for k, v in spec.items() if k not in ("format", "fallback")}


def _outside_blocks(name: str) -> dict:
    """The output layer (and an embedding table tied to it) as llama.cpp's Q6_K output:
    int6, or int8 g32 where its rows are not a multiple of 256. An untied embedding table:
    int8 g32. One large matrix read every token, where int6's 6.56 bits a weight beat
    int8's 8.5: fewer bytes read, faster decoding."""
    return INT6 if name == "lm_head" else INT8


def is_router(name: str) -> bool:
    """Whether module `name` is a router or a shared expert's gate: float in every recipe."""
    return _ROUTER.fullmatch(name) is not None


def _everything(main: dict, n_layers: int | None) -> Recipe:
    """`main` for every weight, embeddings and output included."""
    return lambda name: main


def _uniform(main: dict, n_layers: int | None) -> Recipe:
    """`main` for every linear layer in the blocks; outside them, _outside_blocks."""
    return lambda name: main if _BLOCK.fullmatch(name) else _outside_blocks(name)


def _uniform_k(main: dict, n_layers: int | None) -> Recipe:
    """`main` (q5_k, q4_k, q3_k, q2_k, iq4_xs) for every linear layer in the blocks, int4 g32 (q5_k:
    int5 g32) where its rows are not a multiple of 256; outside them, _outside_blocks."""
    spec = {**main, "fallback": INT5 if main["format"] == "q5_k" else INT4}
    return lambda name: spec if _BLOCK.fullmatch(name) else _outside_blocks(name)


def _q3_k_m(main: dict, n_layers: int | None) -> Recipe:
    """Like llama.cpp's Q3_K_M (llama_tensor_get_type in src/llama-quant.cpp), in the
    same bits: `main` (q3_k) in the blocks, but
      v_proj     q5_k in the first two layers, q4_k after
      o_proj     q4_k
      down_proj  q5_k in the first sixteenth of the layers, q4_k after
    each K-quant with int4 g32 (q5_k: int5 g32) where rows are not a multiple of 256;
    outside the blocks, _outside_blocks."""
    main = {**main, "fallback": INT4}
    q4_k = {"format": "q4_k", "fallback": INT4}
    q5_k = {"format": "q5_k", "fallback": INT5}

    def recipe(name: str) -> dict | None:
        m = _BLOCK.fullmatch(name)
        if m is None:
            return _outside_blocks(name)
        layer, proj = int(m.group(1)), m.group(3)
        if proj == "v_proj":
            return q5_k if layer < 2 else q4_k
        if proj == "down_proj":
            return q5_k if layer < n_layers // 16 else q4_k
        return q4_k if proj == "o_proj" else main

    return recipe


def _mixed(main: dict, n_layers: int | None) -> Recipe:
    """int8 attention, `main` (int4) MLP; outside the blocks, _outside_blocks."""

    def recipe(name: str) -> dict | None:
        m = _BLOCK.fullmatch(name)
        if m is None:
            return _outside_blocks(name)
        return main if m.group(2) == "mlp" else INT8

    return recipe


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice (src/llama-quant.cpp) of the layers Q4_K_M promotes: the first
    and last eighth, and every third layer between."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def _q4_k_m(main: dict, n_layers: int | None) -> Recipe:
    """Like llama.cpp's Q4_K_M (llama_tensor_get_type in src/llama-quant.cpp), with our
    formats standing in for its types:
      Q4_K (4.5 bpw: 32-element sub-blocks, 6-bit scale and min)  -> int4 g32 asymmetric
         (the same sub-block structure with float16 scale and min: 5.0 bpw)
      Q6_K for attn_v and ffn_down where use_more_bits(layer)      -> int8 g32 (int6 there
         reads fewer bytes but decodes no faster)
      Q6_K for output.weight (and a tied token_embd)               -> int6 (else int8 g32)
      token_embd (untied; Q4_K there)                              -> int8 g32, as in
         every recipe here
    Everything else (q, k, o, gate, up, and v/down in the other layers) is Q4_K -> int4."""

    def recipe(name: str) -> dict | None:
        m = _BLOCK.fullmatch(name)
        if m is None:
            return _outside_blocks(name)
        layer, proj = int(m.group(1)), m.group(3)
        if proj in ("v_proj", "down_proj") and use_more_bits(layer, n_layers):
            return INT8
        return main

    return recipe


def _lut_m(main: dict, n_layers: int | None) -> Recipe:
    """lut2_m, lut3_m: the main lut format with llama.cpp's Q2_K / Q3_K_M promotions and
    two of our own, all at the main group size:
      q, gate, up                               -> main (lut2 / lut3)
      v, o, down, as llama.cpp keeps attn_v, attn_output and ffn_down one k-quant up
        (Q3_K in Q2_K, Q4_K in Q3_K_M; llama_tensor_get_type in src/llama-quant.cpp),
        and k                                   -> one bit more (lut3 / lut4)
      every weight of the first and last layer  -> lut4
    Why k and the edge layers: quantized alone, k costs more KL per weight than anything
    but v, and the first and last layer several times a typical middle one; promoting
    them buys the most accuracy per added bit."""
    bits = FORMATS[main["format"]].bits
    more = {**main, "format": f"lut{bits + 1}"}
    edge = {**main, "format": "lut4"}

    def recipe(name: str) -> dict | None:
        m = _BLOCK.fullmatch(name)
        if m is None:
            return _outside_blocks(name)
        layer, proj = int(m.group(1)), m.group(3)
        if layer in (0, n_layers - 1):
            return edge
        return more if proj in ("k_proj", "v_proj", "o_proj", "down_proj") else main

    return recipe


# name -> (main format spec, which the CLI's overrides change; builder(main, n_layers))
RECIPES: dict[str, tuple[dict, Callable[[dict, int | None], Recipe]]] = {
    "int8": (INT8, _everything),
    "int6": (INT6, _everything),  # as llama.cpp's Q6_K: every weight (Q8_0 where K % 256)
    "int5": (INT5, _uniform),  # as GGUF Q5_1 (Q5_0 with --symmetric)
    "int4": (INT4, _uniform),
    "q5_k": ({"format": "q5_k"}, _uniform_k),  # as GGUF Q5_K: every block linear
    "q4_k": ({"format": "q4_k"}, _uniform_k),  # as GGUF Q4_K: every block linear
    "q3_k": ({"format": "q3_k"}, _uniform_k),  # as GGUF Q3_K: every block linear
    "q2_k": ({"format": "q2_k"}, _uniform_k),  # as GGUF Q2_K: every block linear
    "iq4_xs": ({"format": "iq4_xs"}, _uniform_k),  # as GGUF IQ4_XS: every block linear
    "lut2": ({"format": "lut2", "group_size": 64}, _uniform),
    "lut3": ({"format": "lut3", "group_size": 64}, _uniform),
    "lut4": ({"format": "lut4", "group_size": 64}, _uniform),
    "mixed": (INT4, _mixed),
    "q4_k_m": (INT4, _q4_k_m),
    "q3_k_m": ({"format": "q3_k"}, _q3_k_m),
    "lut2_m": ({"format": "lut2", "group_size": 64}, _lut_m),
    "lut3_m": ({"format": "lut3", "group_size": 64}, _lut_m),
}
_NEEDS_LAYERS = {"q4_k_m", "q3_k_m", "lut2_m", "lut3_m"}


def get_recipe(name: str, *, n_layers: int | None = None, **overrides) -> Recipe:
    """The recipe `name`. `overrides` (e.g. group_size=64, symmetric=True; None = not
    given) change the params of its main format. `n_layers` is the model's layer count,
    needed by recipes that treat layers differently (q4_k_m, q3_k_m, lut2_m, lut3_m)."""
    if name not in RECIPES:
        raise InferError(f"unknown quantization recipe {name!r} (known: {', '.join(RECIPES)})")
    main, build = RECIPES[name]
    main = {**main, **{k: v for k, v in overrides.items() if v is not None}}
    cls = FORMATS[main["format"]]
    # Validate now, before any weight is touched: unknown or unsupported params raise.
    # The fallback stays: without it, rows its format cannot split get per-channel int8.
    main = {
        "format": cls.format,
        **cls.resolve_params(spec_params(main)),
        **({"fallback": main["fallback"]} if "fallback" in main else {}),
    }
    if name in _NEEDS_LAYERS and n_layers is None:
        raise InferError(f"recipe {name!r} needs the model's layer count (n_layers)")
    recipe = build(main, n_layers)
    return lambda module: None if is_router(module) else recipe(module)
