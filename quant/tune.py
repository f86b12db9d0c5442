"""Tune a quantized model's scales end to end against the float model it was made from.

GPTQ (gptq.py) fits each linear layer alone, to its own outputs. What a user sees is the
whole model's next-token distribution, and at 2 bits a layer's small errors compound
through the ones after it. Here, after quantization, every code stays as it is and
every group's scale (and min) is trained by gradient descent so that the quantized
model's distributions match the float model's on calibration text: the loss is
KL(float || quantized) per position, the quantity `infer eval --ref` reports. This is
EfficientQAT's second step, E2E-QP (Chen et al. 2024, arXiv:2407.11062: codes frozen,
quantization parameters trained end to end), with the float model as teacher as in
distillation-based QAT (LLM-QAT, Liu et al. 2023, arXiv:2305.17888).

- The teacher runs first, while the model is still float (`teacher_targets`): for each
  position of the tuning windows it keeps the TOP_K largest log-probabilities and the
  log of the mass of all other tokens, a few MB, so the float weights need not stay in
  memory beside the quantized ones. The loss is the KL divergence between the
  distributions coarsened to those TOP_K tokens plus one bucket for the rest, which is
  never more than the full KL.
- Every format here stores w = code * scale (+ min) per group: tensors "scales" (and
  "mins"), (out_features, groups). A tuned layer trains a and b in
  scale = scale0 * (1 + a), min = min0 + |scale0| * b, both starting at 0, so the
  model starts exactly where quantization left it and one learning rate serves layers
  whose scales differ by orders of magnitude. The result is packed back into the same
  format (`from_tensors`), rounded to the scales' dtype.
- Tuned: the linear layers of the transformer blocks named by the caller (quantize.py
  passes those it quantized, not the ones imported bit for bit from GGUF blocks).
  Everything else, the embedding/output table included, is frozen.
- `steps` steps of BATCH windows of WINDOW tokens, spread evenly over the text (each
  seen once when the text is long enough); Adam, learning rate cosine-decayed to 0.
  The RMSNorm weights do not train: tuning them as well made no difference.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import InferError
from ..runtime.model.llama import NoCache, Transformer, full_sequences
from .formats.base import QuantLinear, set_module
from .gptq import calibration_windows

TOP_K = 64  # teacher probabilities kept per position
WINDOW = 256  # tokens per tuning window
BATCH = 4  # windows per step
# Adam's learning rate for a and b (relative changes of the scales, so one rate suits
# every layer; in absolute units a rate good for one layer diverges on another).
LR = 7e-4
_NEG = -1e4  # stands for log(0): keeps 0 * log 0 terms at 0, not nan


@dataclass
class Targets:
    """The teacher's coarsened distributions over `windows` (n, T)."""

    windows: torch.Tensor  # (n, T) token ids
    ids: torch.Tensor  # (n, T, TOP_K) int64: the teacher's most likely next tokens
    logp: torch.Tensor  # (n, T, TOP_K + 1) float32: their log-probs, then the rest's


@dataclass
class Tuning:
    """What `quantize_model` (quantize.py) tunes scales on, and for how long."""

    windows: torch.Tensor  # (n, T) token ids of calibration text (`tuning_windows`)
    steps: int
    lr: float = LR
    # (done, total, loss): after each step; first with loss None after each teacher window
    progress: Callable[[int, int, float | None], None] | None = None


def _coarsen(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(T, vocab) logits, (T, k) token ids -> (T, k + 1) log-probs: of those ids, then of
    every other token together."""
    logp = logits.float().log_softmax(-1)
    rest = logp.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    return torch.cat((logp.gather(-1, ids), rest), -1).clamp(min=_NEG)


def _window_logits(model: Transformer, window: torch.Tensor) -> torch.Tensor:
    cache = [NoCache()] * len(model.layers)
    return model(window[None], 0, cache, all_logits=True)[0]  # (T, vocab)


def tuning_windows(
    tokens: list[int], steps: int, bos_id: int | None = None, ctx: int = WINDOW
) -> torch.Tensor:
    """(n, ctx) windows for `steps` steps: steps * BATCH windows spread evenly over
    `tokens` (fewer, then reused in turn, when the text is shorter)."""
    return calibration_windows(tokens, steps * BATCH * ctx, ctx, bos_id)


@torch.no_grad()
def teacher_targets(
    model: Transformer,
    windows: torch.Tensor,
    progress: Callable[[int, int, None], None] | None = None,
) -> Targets:
    """Run the (float) model over `windows` and keep what tuning needs of its outputs.

    `progress(done, total, None)` is called after each window."""
    ids, logp = [], []
    with full_sequences(model, windows.shape[1]):
        for i, w in enumerate(windows):
            logits = _window_logits(model, w)
            top = logits.topk(TOP_K, dim=-1).indices  # (T, TOP_K)
            ids.append(top)
            logp.append(_coarsen(logits, top))
            if progress is not None:
                progress(i + 1, len(windows), None)
    return Targets(windows, torch.stack(ids), torch.stack(logp))


class _Tuned(nn.Module):
    """A QuantLinear with trainable scales (and mins) over its frozen codes."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.q = q
        t = q.tensors()
        s0, m0 = t["scales"].float(), t.get("mins")
        N, G = s0.shape
        m0 = torch.zeros_like(s0) if m0 is None else m0.float()
        w = q.dequantize().view(N, G, -1)
        # w = code * s0 + m0 exactly (the formats' dequantize), so this recovers the codes.
        codes = torch.where(s0[..., None] != 0, (w - m0[..., None]) / s0[..., None], 0).round()
        self.register_buffer("codes", codes)  # (N, G, g) float32
        self.register_buffer("s0", s0)
        self.register_buffer("m0", m0)
        self.a = nn.Parameter(torch.zeros_like(s0))
        self.b = nn.Parameter(torch.zeros_like(s0)) if "mins" in t else None

    def scales_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s0 * (1 + self.a)
        m = self.m0 if self.b is None else self.m0 + self.s0.abs() * self.b
        return s, m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, m = self.scales_mins()
        w = (self.codes * s[..., None] + m[..., None]).view(self.q.out_features, -1)
        return F.linear(x, w, self.q.bias)

    @torch.no_grad()
    def packed(self) -> QuantLinear:
        """The same format with the tuned scales (and mins), in their stored dtype."""
        t = dict(self.q.tensors())
        s, m = self.scales_mins()
        t["scales"] = s.to(t["scales"].dtype)
        if self.b is not None:
            t["mins"] = m.to(t["mins"].dtype)
        return type(self.q).from_tensors(t, self.q.params, self.q.bias)


class Frozen(nn.Module):
    """A QuantLinear as a plain float linear layer (its C kernels keep no autograd graph)."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.q = q
        self.register_buffer("weight", q.dequantize())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.q.bias)

    def packed(self) -> QuantLinear:
        return self.q  # as it was


@contextlib.contextmanager
def swapped(
    root: nn.Module, make: Callable[[str, QuantLinear], nn.Module]
) -> Iterator[dict[str, nn.Module]]:
    """Swap each QuantLinear under `root` for make(its name, it), a trainable or Frozen
    stand-in; yields {name: stand-in}; on exit puts back each stand-in's packed()."""
    layers: dict[str, nn.Module] = {}
    # remove_duplicate=False: a tied output layer is also the embedding's ".table"; the
    # embedding looks rows up in its buffers, which stay, so only "lm_head" is swapped.
    for name, m in list(root.named_modules(remove_duplicate=False)):
        if isinstance(m, QuantLinear) and not name.endswith(".table"):
            layers[name] = make(name, m)
            set_module(root, name, layers[name])
    try:
        yield layers
    finally:
        for name, m in layers.items():
            set_module(root, name, m.packed())


def descend(
    opt: torch.optim.Optimizer,
    steps: int,
    step_losses: Callable[[int], Iterator[torch.Tensor]],
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """`steps` steps of `opt`, its learning rates cosine-decayed from their initial values
    to 0. A step's gradient is the sum over the losses `step_losses(step)` yields, each
    backpropagated as it comes (one graph alive at a time). Returns each step's summed
    loss; `progress(step, steps, loss)` after each step."""
    rates = [group["lr"] for group in opt.param_groups]
    losses = []
    for step in range(steps):
        decay = 0.5 * (1 + math.cos(math.pi * step / steps))
        for group, lr in zip(opt.param_groups, rates):
            group["lr"] = lr * decay
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for loss in step_losses(step):
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
        if progress is not None:
            progress(step + 1, steps, total)
    return losses


@contextlib.contextmanager
def _differentiable(model: Transformer, names: set[str]) -> Iterator[dict[str, _Tuned]]:
    """Swap each QuantLinear for a _Tuned (`names`) or a Frozen one; on exit put back
    the tuned layers packed, and the others as they were."""
    with swapped(model, lambda n, q: _Tuned(q) if n in names else Frozen(q)) as layers:
        yield {n: m for n, m in layers.items() if isinstance(m, _Tuned)}


def tune_scales(
    model: Transformer,
    targets: Targets,
    names: set[str],
    steps: int,
    *,
    lr: float = LR,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Train the scales of the QuantLinears `names` of `model` (in place) for `steps`
    steps so its outputs on `targets.windows` approach the teacher's; each step's loss
    (mean KL per position, taken before that step's update).

    `progress(step, steps, loss)` is called after each step."""
    if steps < 1:
        raise InferError(f"tuning needs at least one step (got {steps})")
    missing = sorted(n for n in names if not isinstance(model.get_submodule(n), QuantLinear))
    if missing:
        raise InferError(f"cannot tune {missing[0]}: it is not a quantized linear layer")
    n = targets.windows.shape[0]
    T = targets.windows.shape[1]

    def step_losses(step: int) -> Iterator[torch.Tensor]:
        for j in range(step * BATCH, (step + 1) * BATCH):
            i = j % n
            logp = _coarsen(_window_logits(model, targets.windows[i]), targets.ids[i])
            ref = targets.logp[i]
            # KL(ref || model) per position, averaged over the batch's positions
            yield (ref.exp() * (ref - logp)).sum(-1).mean() / BATCH

    with torch.enable_grad(), _differentiable(model, names) as tuned, full_sequences(model, T):
        params = [p for m in tuned.values() for p in m.parameters()]
        return descend(torch.optim.Adam(params, lr=lr), steps, step_losses, progress)
