"""Rope's inverse frequencies and the tables each model file builds from them: in torch,
so apart from config.py, which reads the numbers without it."""

from __future__ import annotations

import math

import torch

from .config import ModelArgs


def rope_inv_freq(args: ModelArgs):
    """Inverse frequencies (head_dim // 2,), with llama3 or linear scaling applied."""
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
    )
    if args.rope_freq_factors is not None:
        return inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float64)
    s = args.rope_scaling
    if s is None:
        return inv_freq
    factor = float(s.get("factor", 1.0))
    if s["rope_type"] == "linear":
        return inv_freq / factor
    # llama3 (Llama 3.1/3.2): keep high frequencies, divide low ones by `factor`,
    # interpolate smoothly between (transformers' _compute_llama3_parameters).
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, out)


def rope_tables(args: ModelArgs, positions: int, dtype: torch.dtype):
    """cos and sin of each position's angles, (positions, head_dim) in `dtype`, the two
    halves alike: a half is computed in float64 and copied in `dtype`, so no float64
    table of the whole width raises load's peak memory."""
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), rope_inv_freq(args))
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
