"""Fitting shared by every group-quantized format: parameter checks, and a per-group
search of scale (and offset) that minimizes the squared error of the rounded codes,
each element's weighted by its importance (importance()).

    codes, d, m = fit_groups(w, group_size, lo, hi, affine=...)
    codes, sc, d = fit_scaled_groups(w, lo, hi, sc_max, fmt, search)   # Q6_K's, Q3_K's scales
"""

from __future__ import annotations

import torch

from ... import InferError


class GroupSizeError(InferError):
    """A weight's row length does not fit the format's group size or packing.

    quantize_model catches it and keeps that layer in a format that fits any shape.
    """


def check_params(fmt: str, params: dict, defaults: dict) -> dict:
    """`params` completed with `defaults`; unknown keys are an error."""
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise InferError(
            f"{fmt}: unknown parameter {', '.join(unknown)} (known: {', '.join(defaults) or 'none'})"
        )
    return {**defaults, **params}


def check_group_size(fmt: str, group_size: int, allowed: tuple[int, ...], note: str = "") -> int:
    """`group_size` if it is one of `allowed`, else a one-line error listing them."""
    if group_size not in allowed:
        raise InferError(
            f"{fmt}: group_size {group_size} not supported "
            f"(choose {', '.join(map(str, allowed))}{note})"
        )
    return group_size


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no NaN or infinity: its min and max in one pass (a NaN anywhere
    makes both NaN), far faster on the CPU than torch.isfinite(t).all(), which was a
    large part of loading a K-quant GGUF file."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_weight(fmt: str, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The (N, K) weight as float32, checked to be finite and to split into groups."""
    if weight.dim() != 2:
        raise InferError(f"{fmt}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if group_size <= 0 or weight.shape[1] % group_size:
        raise GroupSizeError(
            f"{fmt}: row length {weight.shape[1]} is not a multiple of the group size {group_size}"
        )
    w = weight.detach().float()
    if not all_finite(w):
        raise InferError(f"{fmt}: the weight has NaN or infinite values")
    return w


# ---------------------------------------------------------------------------------------
# Group fitting: codes, scales (and mins) minimizing the weighted squared error per group
# ---------------------------------------------------------------------------------------

# The search's step sizes, as factors of the step that puts each group's largest-magnitude
# element (symmetric) or whole range (affine) exactly on the end codes: from 11 % finer
# (that element clipped) to 11 % coarser, as llama.cpp's make_qx_quants tries for Q4_0
# with an importance matrix. Then rounds of refitting the best so far.
STEPS = tuple(1 + 0.0125 * i for i in range(-9, 10))
REFINE = 2
# GPTQ's clipping search (gptq.py) tries the range shrunk by each of these factors.
SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
# Rows fitted at once: bounds the temporaries to a few tens of MB for any tensor.
_CHUNK_ELEMENTS = 1 << 21


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest `dtype` value >= x, as float32."""
    y = x.to(dtype)
    y = torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    return y.float()


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest `dtype` value <= x, as float32."""
    y = x.to(dtype)
    y = torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)
    return y.float()


def nearest_codes(w, d, m, lo: int, hi: int) -> torch.Tensor:
    """Nearest codes in [lo, hi] for w ~ c * d + m (m None: 0); d = 0 gives code 0."""
    x = w if m is None else w - m
    c = torch.where(d == 0, 0.0, x / d).round_()
    return c.clamp_(lo, hi)


def importance(w: torch.Tensor) -> torch.Tensor:
    """How much each element's squared error counts, w (..., g): its group's RMS plus its
    own magnitude (llama.cpp's weighting for K-quants without an importance matrix).
    Large weights then keep nearly their value: clipping them for a smaller plain squared
    error costs more KL on held-out text than rounding the many small ones coarser."""
    return w.square().mean(-1, keepdim=True).sqrt_() + w.abs()


def _group_sse(w, imp, c, d, m) -> torch.Tensor:
    """Squared error per group of the float32 dequantization c * d (+ m), each element's
    weighted by imp."""
    r = c * d if m is None else c * d + m
    return (r - w).square_().mul_(imp).sum(-1, keepdim=True)


def _least_squares(w, imp, c, d, m, dtype):
    """The d (and m) minimizing the imp-weighted squared error of c * d (+ m) against w
    per group, rounded to `dtype`; groups whose codes cannot determine them keep d (and m)."""
    s_cc = (imp * c * c).sum(-1, keepdim=True)
    s_cw = (imp * c * w).sum(-1, keepdim=True)
    if m is None:
        d_ls = torch.where(s_cc > 0, s_cw / s_cc.clamp(min=1e-30), d)
        return d_ls.to(dtype).float(), None
    # Weighted normal equations of w ~ c * d + m over each group, in float32: rounding
    # here can only make a contender worse, and each one's error is measured.
    s_1 = imp.sum(-1, keepdim=True)
    s_c, s_w = (imp * c).sum(-1, keepdim=True), (imp * w).sum(-1, keepdim=True)
    det = s_1 * s_cc - s_c * s_c
    ok = det > 1e-6 * s_1 * s_cc  # codes not all equal
    det = torch.where(ok, det, 1.0)
    d_ls = torch.where(ok, (s_1 * s_cw - s_c * s_w) / det, d)
    m_ls = torch.where(ok, (s_cc * s_w - s_c * s_cw) / det, m)
    return d_ls.to(dtype).float(), m_ls.to(dtype).float()


def _baseline(w, lo, hi, affine, dtype):
    """d (and m) covering each group's whole [min, max] range: d rounded up and m down
    to `dtype`, so no element is clipped and every error is at most |d| / 2."""
    wmin = w.amin(-1, keepdim=True)
    wmax = w.amax(-1, keepdim=True)
    if affine:
        m = round_down(wmin, dtype)
        d = round_up((wmax - m) / hi, dtype)
    else:
        # value = c * d, c in [lo, hi] with lo < 0 < hi. Either sign of d may give the
        # finer step: d > 0 puts the negative end at lo, d < 0 the positive end (ggml's
        # Q4_0 maps the largest-magnitude element to -8 the same way).
        d_pos = round_up(torch.maximum(wmax / hi, wmin / lo).clamp_(min=0), dtype)
        d_neg = round_up(torch.maximum(wmax / -lo, wmin / -hi).clamp_(min=0), dtype)
        d = torch.where(d_neg < d_pos, -d_neg, d_pos)
        m = None
    if not all_finite(d) or (m is not None and not all_finite(m)):
        raise InferError(f"weights too large for {dtype} scales")
    return d, m


def _fit_chunk(w, lo, hi, affine, dtype, search):
    """w (R, G, g) float32 -> codes (R, G, g), d and m (R, G, 1), float32 tensors holding
    integers and `dtype` values (m None when not affine)."""
    d, m = _baseline(w, lo, hi, affine, dtype)
    c = nearest_codes(w, d, m, lo, hi)
    if not search:
        return c, d, m

    # Weighted search. Each contender assigns codes at some step, refits d (and m) to them
    # by weighted least squares, rounds to `dtype`, re-assigns nearest codes and measures
    # the weighted error (importance()); each group keeps its best. The baseline is the
    # first, so the result is never worse than no search by that error. Contenders: each
    # step of STEPS (symmetric: the largest-magnitude element at the end code lo, as
    # ggml's Q4_0 puts it; affine: the range from the group's minimum), then rounds of
    # refitting the best so far. (llama.cpp's make_qx_quants and make_qkx2_quants search
    # scales much the same way.)
    imp = importance(w)
    best = _group_sse(w, imp, c, d, m)

    def contend(c_try):
        nonlocal best, c, d, m
        d_a, m_a = _least_squares(w, imp, c_try, d, m, dtype)
        good = torch.isfinite(d_a) if m_a is None else torch.isfinite(d_a) & torch.isfinite(m_a)
        c_a = nearest_codes(w, d_a, m_a, lo, hi)
        sse = _group_sse(w, imp, c_a, d_a, m_a)
        better = good & (sse < best)
        best = torch.where(better, sse, best)
        c, d = torch.where(better, c_a, c), torch.where(better, d_a, d)
        if affine:
            m = torch.where(better, m_a, m)

    if affine:
        wmin = w.amin(-1, keepdim=True)
        d_end = (w.amax(-1, keepdim=True) - wmin) / hi
    else:
        top = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # signed, largest |w|
        d_end = top / lo
    for f in STEPS:
        if affine:
            contend(nearest_codes(w, d_end / f, wmin, 0, hi))
        else:
            contend(nearest_codes(w, d_end / f, None, lo, hi))
    for _ in range(REFINE):
        contend(c)
    return c, d, m


def fit_groups(
    w: torch.Tensor,
    group_size: int,
    lo: int,
    hi: int,
    *,
    affine: bool,
    dtype: torch.dtype = torch.float16,
    search: bool = True,
):
    """Quantize w (N, K) float32 in groups of `group_size` along K.

    affine:     w ~ c * d + m, codes c in [0, hi]
    not affine: w ~ c * d,     codes c in [lo, hi] (lo < 0)
    Returns codes (N, K) int16, d (N, K/g) and m (N, K/g) or None, in `dtype`.
    With search=False, every element's error is at most |d| / 2 of its group.
    """
    N, K = w.shape
    G = K // group_size
    codes = torch.empty(N, K, dtype=torch.int16)
    d_out = torch.empty(N, G, dtype=dtype)
    m_out = torch.empty(N, G, dtype=dtype) if affine else None
    rows = max(1, _CHUNK_ELEMENTS // max(K, 1))
    for r0 in range(0, N, rows):
        chunk = w[r0 : r0 + rows].reshape(-1, G, group_size)
        c, d, m = _fit_chunk(chunk, lo, hi, affine, dtype, search)
        codes[r0 : r0 + rows] = c.view(-1, K).to(torch.int16)
        d_out[r0 : r0 + rows] = d.view(-1, G).to(dtype)
        if affine:
            m_out[r0 : r0 + rows] = m.view(-1, G).to(dtype)
    return codes, d_out, m_out


def fit_scaled_groups(w: torch.Tensor, lo: int, hi: int, sc_max: int, fmt: str, search: bool):
    """GGUF Q6_K's and Q3_K's two-level scales: w (N, K) float32, K % 256 == 0 -> codes
    (N, K) int16 in lo..hi, sc (N, K/16) int8 in -sc_max..sc_max, d (N, K/256) float16,
    with w ~ d * sc * code, every product exact.

    Each group of 16 gets its own best scale s (fit_groups on codes lo..hi: the clipping
    search, or with search=False the step covering the group's range); each block's d is
    its largest |s| / sc_max rounded up to float16, so no |s / d| passes sc_max and no
    block's d is zero unless all its weights are; sc is |s / d| rounded up, with s's sign,
    so the step d sc covers the group and the codes chosen again for it are each within
    half a step. With search, sc one nearer zero is tried too (a finer step that may
    clip), and each group keeps the one with the smaller error."""
    N, K = w.shape
    B = K // 256
    _, s16, _ = fit_groups(w, 16, lo, hi, affine=False, dtype=torch.float32, search=search)
    s = s16.view(N, B, 16)
    d = round_up(s.abs().amax(-1, keepdim=True) / sc_max, torch.float16)  # (N, B, 1)
    if not torch.isfinite(d).all():
        raise InferError(f"{fmt}: weights too large for float16 scales")
    sc = torch.where(d == 0, 0.0, (s / d).abs().ceil_().clamp_(max=sc_max) * s.sign())
    wg = w.view(N, B, 16, 16)
    best = None
    for t in (sc, sc - sc.sign()) if search else (sc,):
        step = (d * t).unsqueeze(-1)  # (N, B, 16, 1): exact products
        c = nearest_codes(wg, step, None, lo, hi)
        err = (c * step - wg).square_().sum(-1)
        if best is None:
            best = [t, c, err]
        else:
            better = err < best[2]
            best = [
                torch.where(better, t, best[0]),
                torch.where(better.unsqueeze(-1), c, best[1]),
                torch.where(better, err, best[2]),
            ]
    return (
        best[1].view(N, K).to(torch.int16),
        best[0].view(N, B * 16).to(torch.int8),
        d.view(N, B).half(),
    )
