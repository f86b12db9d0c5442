"""What x's integer digits cost in quality: `infer eval`'s KL with x rounded per block.

The integer kernels take x per block of 32 as X = round(x / sx), sx = amax / XMAX: two
int8 digits (XMAX = 32512, 15 significant bits: csrc/kernels.h IG_XMAX) or one
(XMAX = 127: llama.cpp's Q8_0 activations, with a float scale). This emulates either in
torch: every quantized layer of the chosen formats gets x so rounded before its matmul,
for prompts as for decode, and the model is scored as `infer eval --ref` scores it
(runtime/evaluate.py) against REF run in float32 on its dequantized weights. One digit
times the weights' codes is what the kernels would compute exactly (X fits the two-digit
kernels' X as 256 X), so the figures are the kernels' numerics, up to float rounding.

    benchmarks/x_digits_kl.py MODEL... --ref REF [--chunks N] [--formats int4,int5]
                                       [--block 256]

--block sets the block of one scale: 32 for the integer GEMM and most GEMVs, 256 for
q4_k's GEMV and int6's on AVX-512 VNNI.

The reference's logits are computed once per window and kept for every model and mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from infer.quant.formats.base import FORMATS
from infer.runtime import evaluate as ev
from infer.runtime.loader import load_model
from infer.runtime.registry import resolve

TEXT = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-test.txt"
XMAX = {"float": None, "two": 32512, "one": 127}


def round_x(x: torch.Tensor, xmax: int, block: int) -> torch.Tensor:
    """x (..., K), K % block == 0 -> round(x / sx) * sx per block, sx = amax / xmax."""
    xb = x.float().unflatten(-1, (-1, block))
    step = xb.abs().amax(-1, keepdim=True) / xmax
    q = torch.where(step > 0, (xb / step).round() * step, 0.0)
    return q.flatten(-2)


def digits_on(model: torch.nn.Module, formats: list[str], xmax: int | None, block: int) -> int:
    """Make the layers of `formats` round x to `xmax` per block (None: leave x); count them."""
    classes = tuple(FORMATS[f] for f in formats)
    n = 0
    for module in model.modules():
        if not isinstance(module, classes):
            continue
        forward = type(module).forward.__get__(module)
        if xmax is None:
            module.forward = forward
        else:
            module.forward = lambda x, f=forward: f(round_x(x, xmax, block))
        n += 1
    return n


def keep_ref_logits(ref_model: torch.nn.Module) -> None:
    """Make evaluate's window_logits compute the reference's logits once per window."""
    plain, kept = ev.window_logits, {}

    def window_logits(session, window):
        if session.model is not ref_model:
            return plain(session, window)
        key = tuple(window)
        if key not in kept:
            kept[key] = plain(session, window)
        return kept[key]

    ev.window_logits = window_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--ref", required=True, help="the reference, run on its dequantized weights")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--formats", default="int4", help="comma-separated formats to round x for")
    p.add_argument("--modes", default="float,two,one", help="of float, two, one")
    p.add_argument("--block", type=int, default=32, help="elements of x per scale")
    args = p.parse_args()
    formats = args.formats.split(",")
    modes = args.modes.split(",")
    bad = [f for f in formats if f not in FORMATS] + [m for m in modes if m not in XMAX]
    if bad:
        sys.exit(f"x_digits_kl: unknown format or mode {', '.join(bad)}")
    text = args.text.read_text(encoding="utf-8")
    ref = load_model(resolve(args.ref).path, max_seq_len=args.ctx, dequantize=True)
    keep_ref_logits(ref.model)
    for name, mode in ((name, mode) for name in args.models for mode in modes):
        lm = load_model(resolve(name).path, max_seq_len=args.ctx)
        layers = digits_on(lm.model, formats, XMAX[mode], args.block)
        t0 = time.perf_counter()
        r = ev.evaluate(lm, text, ctx=args.ctx, chunks=args.chunks, ref=ref)
        d = r.divergence
        row = {
            "model": name,
            "x": mode,
            "block": args.block,
            "formats": formats,
            "layers": layers,
            "windows": r.windows,
            "ppl": round(r.model.ppl, 4),
            "kl_mean": d.kl_mean,
            "kl_se": d.kl_se,
            "kl_p99": d.kl_p99,
            "top1": round(d.top1_agreement, 2),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
