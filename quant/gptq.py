"""GPTQ: quantize a linear layer's weight against the inputs it sees, with error feedback.

Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers" (arXiv:2210.17323), and its reference code (gptq.py,
`fasterquant`). Rounding each weight to its nearest code minimizes ||W_q - W||; what
matters is the layer's output error ||X W_q^T - X W^T|| over real inputs X (T, K).
Per row that is a quadratic in the row's error with Hessian H = 2 X^T X / T, and GPTQ
quantizes the K columns one at a time, each time moving the rounding error of column j
onto the columns not yet quantized in the way that cancels it best under H (the Optimal
Brain Surgeon update): with U the upper Cholesky factor of H^-1,

    err = (w_j - q_j) / U[j, j];    W[:, j+1:] -= err U[j, j+1:]

Columns go in blocks of 128: inside a block the update is applied column by column,
to the rest of the row once per block (the paper's "lazy batch" updates). H is damped
by DAMP times its mean diagonal before the inversion.

Each format's groups keep their structure: when the quantizer reaches the first column
of a group, that group's scale (and min) are fitted to the group's weights as they stand
then, error feedback included, by the formats' clipping search (`fit.fit_groups`) with
each column's error weighted by its input's mean square (H's diagonal), as llama.cpp's
importance matrix weights it; its columns are then rounded to nearest with those. The
codes, scales and mins are packed into an ordinary QuantLinear of the format, which
dequantizes to exactly the weights GPTQ computed (tests/test_gptq.py checks this for
every format).

With act_order (the reference code's --act-order) columns go in order of decreasing
H diagonal (the most active inputs first); groups stay contiguous in the stored layout,
so a group's scale is fitted when its first column in that order comes up. Off by
default: it made the quantized model worse.

Not done: the paper's true-sequential order (within a block, q/k/v first, then o_proj on
their quantized outputs, then gate/up, then down). It made the model worse and took twice
as long (the later layers fit the calibration text still more closely).

`layer_hessians` collects H for a model's linear layers block by block, each block fed
the outputs of the blocks before it already quantized, as in the paper; quantize.py's
`quantize_model(..., calibration=)` drives it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .. import InferError
from ..runtime.model.llama import NoCache, full_sequences
from .formats.base import QuantLinear
from .formats.fit import REFINE, SHRINK, check_weight, fit_groups
from .formats.int4 import Int4Linear, pack_nibbles
from .formats.int8 import Int8Linear
from .formats.lut import LutLinear, pack_planes

BLOCK_SIZE = 128  # columns per lazy-update block (the paper's B)
# Dampening, as a fraction of H's mean diagonal. The paper uses 0.01, which overfits
# calibration text unlike the text a model then sees; stronger dampening generalizes.
DAMP = 0.1


# ---------------------------------------------------------------------------------------
# What a format's groups are, and how its codes are packed
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """A format's group quantizer: w = c * d (+ m) with codes c in [lo, hi], per group of
    `group_size` consecutive weights of a row; d (and m) stored as `dtype`."""

    group_size: int
    lo: int
    hi: int
    affine: bool
    dtype: torch.dtype = torch.float16


def supports(cls: type[QuantLinear]) -> bool:
    """Whether GPTQ quantizes format `cls`: one scale (and min) per group. Not int6,
    whose two levels of scales (an int8 per 16 under a float16 per 256) it has no grid
    for; at 6.56 bits a weight, its own clipping search serves."""
    return issubclass(cls, (Int4Linear, LutLinear, Int8Linear))


def grid_of(cls: type[QuantLinear], params: dict, in_features: int) -> Grid:
    """The Grid of format `cls` with resolved `params` for rows of `in_features`."""
    g = params.get("group_size")
    if issubclass(cls, Int4Linear):
        return Grid(g, -8, 7, False) if params["symmetric"] else Grid(g, 0, 15, True)
    if issubclass(cls, LutLinear):
        return Grid(g, 0, 2**cls.bits - 1, True)
    if issubclass(cls, Int8Linear):
        # group_size 0: one float32 scale per row
        return (
            Grid(in_features, -127, 127, False, torch.float32)
            if g == 0
            else Grid(g, -127, 127, False)
        )
    raise InferError(f"GPTQ does not support format {cls.format!r}")


def pack(cls: type[QuantLinear], params: dict, codes, d, m, bias=None) -> QuantLinear:
    """A `cls` QuantLinear from codes (N, K) in its grid's [lo, hi], d and m (N, K/g) in its
    grid's dtype (m None unless affine), laid out as the format's docstring says."""
    if issubclass(cls, Int4Linear):
        q = codes + 8 if params["symmetric"] else codes  # symmetric: (q - 8) * d
        tensors = {"qweight": pack_nibbles(q), "scales": d}
        if m is not None:
            tensors["mins"] = m
    elif issubclass(cls, LutLinear):
        tensors = {"qweight": pack_planes(codes, cls.bits), "scales": d, "mins": m}
    elif issubclass(cls, Int8Linear):
        tensors = {"qweight": codes.to(torch.int8), "scales": d}
    else:
        raise InferError(f"GPTQ does not support format {cls.format!r}")
    return cls.from_tensors(tensors, params, bias)


# ---------------------------------------------------------------------------------------
# The algorithm
# ---------------------------------------------------------------------------------------


@dataclass
class GPTQResult:
    codes: torch.Tensor  # (N, K) int16, in [grid.lo, grid.hi]
    d: torch.Tensor  # (N, K/g) grid.dtype
    m: torch.Tensor | None  # (N, K/g) grid.dtype, affine grids only
    weight: torch.Tensor  # (N, K) float32: codes * d (+ m), what the packed layer holds


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, U^T U = H^-1; float64.

    A Hessian singular even after dampening (too few calibration tokens for its width)
    is dampened ten times more, up to four times."""
    diag = torch.arange(H.shape[0])
    step = damp * H.diagonal().mean().clamp(min=1e-12)
    for _ in range(5):
        H[diag, diag] += step
        # With J the reversal: J H J = M M^T (M lower) gives H = V V^T, V = J M J upper,
        # so H^-1 = V^-T V^-1 and U = V^-1 = J M^-1 J: one factorization, one inverse.
        M, info = torch.linalg.cholesky_ex(H.flip(0, 1))
        if info == 0:
            eye = torch.eye(len(M), dtype=M.dtype)
            return torch.linalg.solve_triangular(M, eye, upper=False).flip(0, 1)
        step = step * 9  # the total grows tenfold
    raise InferError("GPTQ: the calibration Hessian is not positive definite")


def _nearest(w, d, m, lo: int, hi: int) -> torch.Tensor:
    """Nearest codes in [lo, hi] for w ~ c * d (+ m); d = 0 gives code 0 (as fit_groups)."""
    x = w if m is None else w - m
    return torch.where(d == 0, 0.0, x / d).round_().clamp_(lo, hi)


def fit_group(w: torch.Tensor, imp: torch.Tensor, grid: Grid):
    """d (and m), each (N, 1) float32 holding `grid.dtype` values, for one group w (N, g),
    minimizing the squared error weighted by each column's importance imp (g,).

    fit_groups' clipping search (the same contenders: the range shrunk by each SHRINK
    factor, then REFINE rounds of refitting), with the error weighted as llama.cpp
    weights it by an importance matrix: imp is H's diagonal, the mean squared input of
    each column, so the scale fits the columns whose errors reach the output most
    (much better than unweighted fitting).
    """
    lo, hi, affine, dtype = grid.lo, grid.hi, grid.affine, grid.dtype
    # The baseline: the whole range of each row, as fit_groups starts.
    _, d, m = fit_groups(w, w.shape[1], lo, hi, affine=affine, dtype=dtype, search=False)
    d, m = d.float(), (m.float() if affine else None)

    def sse(c, d, m):
        r = c * d if m is None else c * d + m
        return ((r - w).square_() * imp).sum(-1, keepdim=True)

    s_1 = imp.sum()

    def refit(c, d, m):
        """Weighted least squares d (and m) for codes c, rounded to dtype."""
        s_cc, s_cw = (imp * c * c).sum(-1, keepdim=True), (imp * c * w).sum(-1, keepdim=True)
        if m is None:
            return torch.where(s_cc > 0, s_cw / s_cc, d).to(dtype).float(), None
        s_c, s_w = (imp * c).sum(-1, keepdim=True), (imp * w).sum(-1, keepdim=True)
        det = s_1 * s_cc - s_c * s_c
        ok = det > 1e-6 * s_1 * s_cc  # codes not all equal
        det = torch.where(ok, det, 1.0)
        d_ls = torch.where(ok, (s_1 * s_cw - s_c * s_w) / det, d)
        m_ls = torch.where(ok, (s_cc * s_w - s_c * s_cw) / det, m)
        return d_ls.to(dtype).float(), m_ls.to(dtype).float()

    c = _nearest(w, d, m, lo, hi)
    best = sse(c, d, m)

    def contend(c_try):
        nonlocal best, c, d, m
        d_a, m_a = refit(c_try, d, m)
        good = torch.isfinite(d_a) if m_a is None else torch.isfinite(d_a) & torch.isfinite(m_a)
        c_a = _nearest(w, d_a, m_a, lo, hi)
        err = sse(c_a, d_a, m_a)
        better = good & (err < best)
        best = torch.where(better, err, best)
        c, d = torch.where(better, c_a, c), torch.where(better, d_a, d)
        if affine:
            m = torch.where(better, m_a, m)

    d0 = d
    if affine:
        mean = (imp * w).sum(-1, keepdim=True) / s_1
        wmin, wmax = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    for alpha in SHRINK:
        if affine:
            lo_a = mean + (wmin - mean) * alpha
            contend(_nearest(w, (mean + (wmax - mean) * alpha - lo_a) / hi, lo_a, 0, hi))
        else:
            contend(_nearest(w, d0 * alpha, None, lo, hi))
    for _ in range(REFINE):
        contend(c)
    return d, m


@torch.no_grad()
def gptq(
    weight: torch.Tensor,
    H: torch.Tensor,
    grid: Grid,
    *,
    act_order: bool = False,
    block_size: int = BLOCK_SIZE,
    damp: float = DAMP,
) -> GPTQResult:
    """Quantize weight (N, K) onto `grid`, minimizing the output error under H (K, K)."""
    W = weight.detach().float().clone()
    N, K = W.shape
    g = grid.group_size
    if K % g:
        raise InferError(f"GPTQ: row length {K} is not a multiple of the group size {g}")
    G = K // g
    H = H.detach().double().clone()
    # Inputs that are always zero: any weight does, so make it 0 (and H invertible there).
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    imp = H.diagonal().float()  # each input's mean square (x2): weights for fitting scales

    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    U = _inverse_cholesky(H, damp).float()  # (K, K) upper triangular
    del H
    group = (perm // g).tolist()  # group of each column, in processing order
    where = torch.argsort(perm)  # original column -> position in processing order
    positions = where.view(G, g)  # each group's columns, as positions

    codes = torch.empty(N, K)  # processing order
    Q = torch.empty(N, K)
    d_out = torch.zeros(N, G, dtype=grid.dtype)
    m_out = torch.zeros(N, G, dtype=grid.dtype) if grid.affine else None
    d_col, m_col = [None] * G, [None] * G  # each fitted group's d, m as float32 (N,)

    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()  # this block's columns, updated column by column
        U1 = U[i1:i2, i1:i2]
        Err = torch.zeros(N, i2 - i1)
        for j in range(i2 - i1):
            gi = group[i1 + j]
            if d_col[gi] is None:
                # The group's first column: fit its scale (and min) to its columns as they
                # stand now. All are still unquantized; those past this block have yet to
                # receive this block's feedback so far, Err[:, :j] @ U[i1:i1+j, those].
                pos = positions[gi]
                cur = torch.empty(N, g)
                inside = pos < i2
                cur[:, inside] = W1[:, pos[inside] - i1]
                later = pos[~inside]
                if later.numel():
                    cur[:, ~inside] = W[:, later] - Err[:, :j] @ U[i1 : i1 + j, later]
                d, m = fit_group(cur, imp[gi * g : (gi + 1) * g], grid)
                d_col[gi], m_col[gi] = d[:, 0], (None if m is None else m[:, 0])
                d_out[:, gi] = d[:, 0].to(grid.dtype)  # exact: d holds grid.dtype values
                if grid.affine:
                    m_out[:, gi] = m[:, 0].to(grid.dtype)
            w = W1[:, j]
            c = _nearest(w, d_col[gi], m_col[gi], grid.lo, grid.hi)
            q = c * d_col[gi] if m_col[gi] is None else c * d_col[gi] + m_col[gi]  # as dequantize
            codes[:, i1 + j], Q[:, i1 + j] = c, q
            err = (w - q) / U1[j, j]
            W1[:, j:].addr_(err, U1[j, j:], alpha=-1)
            Err[:, j] = err
        W[:, i2:].addmm_(Err, U[i1:i2, i2:], alpha=-1)

    return GPTQResult(codes[:, where].to(torch.int16), d_out, m_out, Q[:, where])


def quantize_linear(
    cls: type[QuantLinear],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    params: dict,
    H: torch.Tensor,
    *,
    act_order: bool = False,
) -> QuantLinear:
    """`cls.from_float(weight, bias, **params)`, but quantized by GPTQ under Hessian H.

    Raises GroupSizeError, as from_float does, when the rows do not split into groups."""
    p = cls.resolve_params(params)
    grid = grid_of(cls, p, weight.shape[1])
    w = check_weight(cls.format, weight, grid.group_size)
    r = gptq(w, H, grid, act_order=act_order)
    return pack(cls, p, r.codes, r.d, r.m, bias)


def output_error(weight: torch.Tensor, wq: torch.Tensor, H: torch.Tensor) -> float:
    """||X Wq^T - X W^T|| / ||X W^T|| over the inputs X whose Hessian is H (H ~ X^T X)."""
    w = weight.double()
    diff = wq.double() - w
    num = ((diff @ H.double()) * diff).sum().item()
    den = ((w @ H.double()) * w).sum().item()
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else 0.0


# ---------------------------------------------------------------------------------------
# Calibration: Hessians of a model's linear layers, block by block
# ---------------------------------------------------------------------------------------


def calibration_windows(
    tokens: list[int], n_tokens: int, ctx: int = 512, bos_id: int | None = None
) -> torch.Tensor:
    """(n, ctx) token ids: n = n_tokens // ctx windows spread evenly over `tokens`.

    A text shorter than one window gives one window of all of it. With `bos_id` each
    window starts with it (as evaluate.make_windows does for tokenizers that add BOS)."""
    if not tokens or n_tokens <= 0:
        raise InferError("calibration needs at least one token")
    ctx = min(ctx, n_tokens, len(tokens))
    n = max(1, min(n_tokens, len(tokens)) // ctx)
    starts = torch.linspace(0, len(tokens) - ctx, n).long().tolist()
    windows = torch.tensor([tokens[s : s + ctx] for s in starts])
    if bos_id is not None:
        windows[:, 0] = bos_id
    return windows


def _xtx(x: torch.Tensor) -> torch.Tensor:
    """X^T X (K, K) in float64 of inputs x (..., K): the product in float32, per window."""
    X = x.reshape(-1, x.shape[-1]).float()
    return (X.T @ X).double()


class _Hessians:
    """Forward hooks summing X^T X of the inputs of some linear layers.

    Layers fed the same input tensor (q, k, v; gate, up) share one sum."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.sums: dict[str, torch.Tensor] = {}  # first name of each distinct input -> sum
        self.alias: dict[str, str] = {}  # name -> the name whose sum it shares
        self.tokens: dict[str, int] = {}
        self._last: tuple[torch.Tensor, str] | None = None
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            x = args[0]
            if self._last is not None and self._last[0] is x:
                self.alias[name] = self.alias.get(self._last[1], self._last[1])
            else:
                self.alias[name] = name
                xtx = _xtx(x)
                if name in self.sums:
                    self.sums[name] += xtx
                else:
                    self.sums[name] = xtx
                self.tokens[name] = self.tokens.get(name, 0) + x.numel() // x.shape[-1]
            # Held until the next hook: keeps x alive, so `is` cannot match a new tensor
            # that reuses its memory.
            self._last = (x, name)

        return hook

    def close(self) -> dict[str, torch.Tensor]:
        """Remove the hooks; name -> H = 2 X^T X / T (float64; shared inputs share H)."""
        for h in self._handles:
            h.remove()
        self._last = None
        H = {n: 2 * s / self.tokens[n] for n, s in self.sums.items()}
        return {name: H[root] for name, root in self.alias.items()}


def block_hessians(
    block: nn.Module,
    prefix: str,
    names: set[str],
    xs: list[torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """{name: H} for the linear layers of `block` (named `prefix` + its own name) that are
    in `names`, on the block's inputs xs (each (1, T, dim), at positions from 0)."""
    modules = {
        prefix + n: m
        for n, m in block.named_modules()
        if prefix + n in names and isinstance(m, nn.Linear)
    }
    if not modules:
        return {}
    hessians = _Hessians(modules)
    try:
        for x in xs:
            block(x, 0, *rope)
    finally:
        H = hessians.close()
    return H


def head_hessian(model: nn.Module, xs: list[torch.Tensor]) -> torch.Tensor:
    """H of the output layer's inputs, given the last block's outputs xs: taken from the
    final norm's outputs directly, since running the layer would make (n * T, vocab)
    logits."""
    xtx = sum(_xtx(model.norm(x)) for x in xs)
    return 2 * xtx / sum(x.shape[1] for x in xs)


@torch.no_grad()
def layer_hessians(
    model: nn.Module, windows: torch.Tensor, names: set[str]
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield {name: H} for the linear layers in `names`, one transformer block at a time.

    Each block is fed the calibration windows (n, T) as the model at that moment
    transforms them: after each yield the caller replaces that block's layers with
    quantized ones, and the block's outputs are recomputed through those for the next
    block (the paper's sequential scheme). An untied "lm_head" in `names` comes last,
    on the final norm's outputs.
    """
    dtype = model.rope_cos.dtype
    T = windows.shape[1]
    with full_sequences(model, T):
        rope = model.rope_cos[:T], model.rope_sin[:T], NoCache()  # a block's extra args
        xs = [model.embed_tokens(w[None]).to(dtype) for w in windows]  # each (1, T, dim)
        for i, layer in enumerate(model.layers):
            H = block_hessians(layer, f"layers.{i}.", names, xs, rope)
            if H:
                yield H
            xs = [layer(x, 0, *rope) for x in xs]
        if "lm_head" in names and isinstance(model.lm_head, nn.Linear):
            yield {"lm_head": head_hessian(model, xs)}
