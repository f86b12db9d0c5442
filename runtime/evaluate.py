"""Perplexity and KL divergence over a text, computed as llama.cpp's llama-perplexity does.

The reference is `perplexity()` and `kl_divergence()` in llama.cpp's
tools/perplexity/perplexity.cpp, so that figures here compare with theirs:

- the text is tokenized once, with a leading BOS when the tokenizer adds one
  (`common_tokenize(ctx, text, true)`), and cut into len // ctx non-overlapping
  windows of `ctx` tokens; the tail that does not fill a window is dropped;
- the KV cache starts empty for each window, and when the tokenizer adds BOS the
  window's first token is replaced by BOS;
- only the second half is scored: the logits at positions [ctx/2, ctx - 1) predict
  tokens [ctx/2 + 1, ctx), ctx - 1 - ctx/2 tokens per window (255 for 512);
- PPL = exp(mean NLL), and its standard error is PPL times the standard error of the
  mean NLL, sqrt((E[x^2] - E[x]^2) / (n - 1)).

With a reference model both run on the same windows, and per scored token we take
KL(ref || model) over the full vocabulary in float64 (llama.cpp reads the reference's
log-probs back from a file quantized to 16 bits and skips those below -16; we keep
them all), whether the two argmaxes agree, and both NLLs, for the PPL ratio and
difference with llama.cpp's covariance-aware errors. Logits are reduced per window
and dropped; what is kept across windows is running sums and one KL value per token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import InferError
from .loader import LoadedModel
from .model.kvcache import float_kind
from .model.tokenizer import Tokenizer
from .session import Session

Progress = Callable[[int, int], None]  # (windows done, windows in all)

ROWS_PER_BLOCK = 64  # scored positions reduced at a time: (64, vocab) float64 temporaries


@dataclass
class Perplexity:
    """One model's figures over the scored tokens."""

    ppl: float
    ppl_se: float  # standard error (llama-perplexity's "+/-")
    nll: float  # mean negative log-likelihood, nats per token
    seconds: float  # forward passes and scoring
    tokens_per_s: float  # window tokens evaluated per second


@dataclass
class Divergence:
    """How far the model's next-token distributions are from the reference's."""

    kl_mean: float  # mean KL(ref || model), nats per token
    kl_se: float
    kl_median: float
    kl_p99: float  # 99th percentile, linear interpolation (as llama.cpp)
    kl_max: float
    top1_agreement: float  # percent of tokens where the argmaxes agree
    top1_se: float  # percent
    ln_ppl_ratio: float  # ln(PPL / PPL(ref))
    ln_ppl_ratio_se: float
    ppl_ratio: float  # PPL / PPL(ref)
    ppl_ratio_se: float
    ppl_diff: float  # PPL - PPL(ref)
    ppl_diff_se: float


@dataclass
class EvalResult:
    ctx: int
    text_tokens: int  # the whole text, BOS included when the tokenizer adds one
    windows: int
    tokens_scored: int
    model: Perplexity
    ref: Perplexity | None = None
    divergence: Divergence | None = None


# ---------------------------------------------------------------------------- windows


def tokenize_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """The whole text's ids, BOS first when the tokenizer adds one (as llama.cpp)."""
    ids = tokenizer.encode(text, add_special=False)
    return [tokenizer.bos_id, *ids] if tokenizer.add_bos else ids


def make_windows(
    tokens: list[int], ctx: int, bos_id: int | None = None, chunks: int | None = None
) -> list[list[int]]:
    """Non-overlapping windows of `ctx` tokens, at most `chunks` of them.

    With `bos_id` (the tokenizer adds BOS), each window's first token is replaced by it.
    """
    n = len(tokens) // ctx
    if chunks is not None:
        n = min(n, chunks)
    windows = [tokens[i * ctx : (i + 1) * ctx] for i in range(n)]
    if bos_id is not None:
        windows = [[bos_id, *w[1:]] for w in windows]
    return windows


def window_logits(session: Session, window: list[int]) -> torch.Tensor:
    """Logits (ctx - 1 - ctx/2, vocab) at positions [ctx/2, ctx - 1) of a fresh window.

    The first half only fills the KV cache (no lm_head on it); the last token is
    never fed, since nothing after it is scored.
    """
    first = len(window) // 2
    session.reset()
    session.forward(window[:first], 0)
    return session.forward(window[first:-1], first, all_logits=True)


# ---------------------------------------------------------------------------- scoring


def _token_stats(logits: torch.Tensor, targets: torch.Tensor, ref_logits: torch.Tensor | None):
    """Per scored position: NLL; with a reference also its NLL, KL(ref || model), same argmax.

    logits, ref_logits: (n, vocab); targets: (n,). Reduced in float64, in row blocks.
    """
    out = {"nll": [], "nll_ref": [], "kl": [], "same_top": []}
    for start in range(0, logits.shape[0], ROWS_PER_BLOCK):
        rows = slice(start, start + ROWS_PER_BLOCK)
        target = targets[rows, None]
        logp = torch.log_softmax(logits[rows].double(), dim=-1)  # (rows, vocab)
        out["nll"].append(-logp.gather(1, target)[:, 0])
        if ref_logits is None:
            continue
        ref_logp = torch.log_softmax(ref_logits[rows].double(), dim=-1)
        out["nll_ref"].append(-ref_logp.gather(1, target)[:, 0])
        # sum_v p_ref(v) (log p_ref(v) - log p(v))
        out["kl"].append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
        out["same_top"].append(logits[rows].argmax(-1) == ref_logits[rows].argmax(-1))
    return {k: torch.cat(v) for k, v in out.items() if v}


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error, llama.cpp's sqrt((E[x^2] - E[x]^2) / (n - 1))."""
    mean = float(x.mean())
    var = float((x * x).mean()) - mean * mean
    return mean, math.sqrt(var / (len(x) - 1)) if var > 0 and len(x) > 1 else 0.0


def _covariance_of_means(a: np.ndarray, b: np.ndarray) -> float:
    n = len(a)
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1) if n > 1 else 0.0


def _perplexity(nll: np.ndarray, seconds: float, n_window_tokens: int) -> Perplexity:
    mean, se = _mean_se(nll)
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * se, mean, seconds, n_window_tokens / seconds if seconds else 0.0)


def _divergence(
    nll: np.ndarray, nll_ref: np.ndarray, kl: np.ndarray, same_top: np.ndarray
) -> Divergence:
    """The statistics of llama.cpp's kl_divergence() summary."""
    ln_ppl, ln_ppl_se = _mean_se(nll)
    ln_ref, ln_ref_se = _mean_se(nll_ref)
    cov = _covariance_of_means(nll, nll_ref)
    ln_ratio = ln_ppl - ln_ref
    ln_ratio_se = math.sqrt(max(ln_ppl_se**2 + ln_ref_se**2 - 2 * cov, 0.0))
    ppl, ppl_ref = math.exp(ln_ppl), math.exp(ln_ref)
    diff_var = (ppl * ln_ppl_se) ** 2 + (ppl_ref * ln_ref_se) ** 2 - 2 * ppl * ppl_ref * cov
    kl_mean, kl_se = _mean_se(kl)
    p = float(same_top.mean())
    n = len(same_top)
    return Divergence(
        kl_mean=kl_mean,
        kl_se=kl_se,
        kl_median=float(np.median(kl)),
        kl_p99=float(np.percentile(kl, 99)),
        kl_max=float(kl.max()),
        top1_agreement=100 * p,
        top1_se=100 * math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0,
        ln_ppl_ratio=ln_ratio,
        ln_ppl_ratio_se=ln_ratio_se,
        ppl_ratio=math.exp(ln_ratio),
        ppl_ratio_se=math.exp(ln_ratio) * ln_ratio_se,
        ppl_diff=ppl - ppl_ref,
        ppl_diff_se=math.sqrt(max(diff_var, 0.0)),
    )


# ---------------------------------------------------------------------------- evaluate


def _check_compatible(lm: LoadedModel, ref: LoadedModel) -> None:
    sizes = (lm.args.vocab_size, lm.tokenizer.vocab_size)
    ref_sizes = (ref.args.vocab_size, ref.tokenizer.vocab_size)
    if sizes != ref_sizes:
        raise InferError(
            f"the model and the reference do not share a vocabulary "
            f"({sizes[0]} vs {ref_sizes[0]} logits, {sizes[1]} vs {ref_sizes[1]} tokens)"
        )


def evaluate(
    lm: LoadedModel,
    text: str,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    ref: LoadedModel | None = None,
    progress: Progress | None = None,
) -> EvalResult:
    """Perplexity of `lm` over `text`; with `ref`, also the divergence from it."""
    if ctx < 4:
        raise InferError(f"--ctx {ctx} is too small: a window needs at least 4 tokens")
    if chunks is not None and chunks < 1:
        raise InferError(f"--chunks must be at least 1 (got {chunks})")
    for which, m in (("model", lm), ("reference", ref)):
        if m is not None and ctx > m.model.max_seq_len:
            raise InferError(
                f"--ctx {ctx} is more than the {which}'s context of {m.model.max_seq_len}"
            )
    if ref is not None:
        _check_compatible(lm, ref)

    tok = lm.tokenizer
    tokens = tokenize_text(tok, text)
    if len(tokens) < ctx:
        raise InferError(
            f"the text is {len(tokens)} tokens, fewer than one window of --ctx {ctx} "
            "(give more text or lower --ctx)"
        )
    windows = make_windows(tokens, ctx, tok.bos_id if tok.add_bos else None, chunks)
    first = ctx // 2

    session = Session(lm.model, ctx)  # the model's KV cache (load_model's kv_cache)
    # The reference's is float whatever the model's, so `ref` may be `lm` itself.
    ref_session = None
    if ref is not None:
        ref_session = Session(ref.model, ctx, kv_cache=float_kind(ref.dtype))
    per_window = []
    seconds = ref_seconds = 0.0
    for i, window in enumerate(windows):
        t0 = time.perf_counter()
        logits = window_logits(session, window)
        t1 = time.perf_counter()
        ref_logits = window_logits(ref_session, window) if ref is not None else None
        t2 = time.perf_counter()
        targets = torch.tensor(window[first + 1 :])
        per_window.append(_token_stats(logits, targets, ref_logits))
        # Scoring is charged to the model (and, with a reference, is mostly KL).
        seconds += (t1 - t0) + (time.perf_counter() - t2)
        ref_seconds += t2 - t1
        if progress is not None:
            progress(i + 1, len(windows))

    stats = {k: torch.cat([w[k] for w in per_window]).numpy() for k in per_window[0]}
    n_window_tokens = len(windows) * ctx
    result = EvalResult(
        ctx=ctx,
        text_tokens=len(tokens),
        windows=len(windows),
        tokens_scored=len(stats["nll"]),
        model=_perplexity(stats["nll"], seconds, n_window_tokens),
    )
    if ref is not None:
        result.ref = _perplexity(stats["nll_ref"], ref_seconds, n_window_tokens)
        result.divergence = _divergence(
            stats["nll"], stats["nll_ref"], stats["kl"], stats["same_top"]
        )
    return result
