"""Block-AP: quantize a model block by block, training each block's weights and scales
so that the quantized block reproduces the float one.

EfficientQAT's first step (Chen et al. 2024, arXiv:2407.11062, "block-wise training of
all parameters"). GPTQ (gptq.py) fixes one linear layer at a time against its own
outputs; here every quantized linear layer of a transformer block trains at once,
through the block's attention and SiLU, against the block's float output, so its
layers can make up for each other's rounding.

For each block, in order:
- Its float outputs on the float model's hidden states are the targets.
- Its layers are quantized by GPTQ on the quantized model's hidden states, as without
  training; of that only the scales s0 and mins m0 are kept, as a starting point
  (a better one than the formats' own clipping search).
- Trained for `epochs` passes over the calibration windows, BATCH windows a step: a
  float copy W of each weight, starting at the float weight, and each group's
  scale = s0 (1 + a), min = m0 + |s0| b (a = b = 0 at first). The layer's weight is
  w = clamp(round((W - min) / scale), lo, hi) * scale + min: the format's own grid, with
  round() passing gradients straight through (the STE). W moves as W0 + |s0| u, in
  units of its group's step, so one learning rate suits layers of any magnitude. The
  loss is the mean square error of the block's output on the quantized model's hidden
  states against the float target. Adam, cosine decay to 0.
- Packed into the format (gptq.pack), its codes those of the trained W; its outputs on
  the quantized hidden states feed the next block.

Layers not quantized here (imported from GGUF blocks, or not in `names`) run frozen,
as float layers (tune.Frozen). The RMSNorm weights do not train: training them too
made no difference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.model.llama import NoCache, Transformer, full_sequences
from .formats.base import QuantLinear
from .gptq import block_hessians, grid_of, head_hessian, pack
from .tune import Frozen, descend, swapped

BATCH = 1  # windows per step (of 512 tokens from the CLI)
# Adam's learning rates: for u (weights, in their group's steps) and for a, b (relative
# changes of the scales). A step-relative rate for W beat one in absolute units; a larger
# rate for the scales made the first block worse.
LR = 7e-3
SCALE_LR = 1e-4


@dataclass
class BlockTraining:
    """What `quantize_model` (quantize.py) trains blocks for, beside its calibration windows."""

    epochs: int  # passes over the windows, per block
    # (block, n_blocks, step, steps, loss): after each training step
    progress: Callable[[int, int, int, int, float], None] | None = None


class Trained(nn.Module):
    """A QuantLinear's weight in training: float weights rounded onto the format's grid
    in the forward pass, with trainable scales (and mins)."""

    def __init__(self, q: QuantLinear, weight: torch.Tensor):
        super().__init__()
        self.q = q
        t = q.tensors()
        grid = grid_of(type(q), q.params, q.in_features)
        self.lo, self.hi = grid.lo, grid.hi
        s0, m0 = t["scales"].float(), t.get("mins")
        N, G = s0.shape
        self.register_buffer("s0", s0)
        self.register_buffer("m0", torch.zeros_like(s0) if m0 is None else m0.float())
        self.register_buffer("w0", weight.detach().float().reshape(N, G, -1))
        self.u = nn.Parameter(torch.zeros_like(self.w0))
        self.a = nn.Parameter(torch.zeros_like(s0))
        self.b = nn.Parameter(torch.zeros_like(s0)) if m0 is not None else None

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, G, g) codes (float, in [lo, hi]; round's gradient passed straight through),
        (N, G) scales and mins."""
        s = self.s0 * (1 + self.a)
        m = self.m0 if self.b is None else self.m0 + self.s0.abs() * self.b
        W = self.w0 + self.s0.abs()[..., None] * self.u
        safe = torch.where(s == 0, 1.0, s)  # an all-equal group: w = min whatever the code
        c = (W - m[..., None]) / safe[..., None]
        c = c + (c.round() - c).detach()
        return c.clamp(self.lo, self.hi), s, m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, s, m = self.codes()
        w = (c * s[..., None] + m[..., None]).reshape(self.q.out_features, -1)
        return F.linear(x, w, self.q.bias)

    @torch.no_grad()
    def packed(self) -> QuantLinear:
        """The trained weight in the layer's format, scales (and mins) in their dtype."""
        c, s, m = self.codes()
        dtype = self.q.tensors()["scales"].dtype
        codes = c.round().reshape(self.q.out_features, -1).to(torch.int16)
        mins = None if self.b is None else m.to(dtype)
        return pack(type(self.q), self.q.params, codes, s.to(dtype), mins, self.q.bias)


def train_block(
    block: nn.Module,
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    trained: list[Trained],
    epochs: int,
    rope: tuple,  # (cos, sin, cache): a block's arguments after x and pos
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Train `trained` (layers of `block`) so block(inputs[j]) approaches targets[j];
    each step's loss. `progress(step, steps, loss)` after each step."""
    params = [m.u for m in trained]
    scale_params = [p for m in trained for p in (m.a, m.b) if p is not None]
    opt = torch.optim.Adam([{"params": params, "lr": LR}, {"params": scale_params, "lr": SCALE_LR}])
    n = len(inputs)
    steps = max(1, epochs * n // BATCH)
    # Each epoch visits every window once, in its own order (seeded: reproducible).
    gen = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs + 1)]).tolist()

    def step_losses(step: int) -> Iterator[torch.Tensor]:
        for j in order[step * BATCH : (step + 1) * BATCH]:
            yield F.mse_loss(block(inputs[j], 0, *rope), targets[j]) / BATCH

    with torch.enable_grad():
        return descend(opt, steps, step_losses, progress)


@torch.no_grad()
def quantize_blocks(
    model: Transformer,
    windows: torch.Tensor,
    names: set[str],
    quantize: Callable[..., None],
    training: BlockTraining,
) -> None:
    """Quantize the linear layers `names` of `model` by Block-AP on `windows` (n, T) of
    calibration tokens, in place.

    `quantize(name, H)` replaces the float layer `name` by its QuantLinear, by GPTQ
    under H (rounding when H is None: an expert no token reached); it is the caller's,
    which also reports the error. Training starts from that layer's scales and moves its
    codes and scales. An untied "lm_head" in `names`, outside the blocks, comes last and
    keeps GPTQ's weights (H of its inputs on the quantized model)."""
    if not names:
        return  # e.g. every layer imported from GGUF blocks: nothing to train
    dtype = model.rope_cos.dtype
    T = windows.shape[1]
    with full_sequences(model, T):
        rope = model.rope_cos[:T], model.rope_sin[:T], NoCache()  # a block's extra args
        xs = [model.embed_tokens(w[None]).to(dtype) for w in windows]  # each (1, T, dim)
        floats = xs  # the float model's hidden states
        for i, block in enumerate(model.layers):
            prefix = f"layers.{i}."
            mine = sorted(n for n in names if n.startswith(prefix))
            targets = [block(x, 0, *rope) for x in floats]
            if mine:
                weights = {n: model.get_submodule(n).weight for n in mine}
                hessians = block_hessians(block, prefix, names, xs, rope)
                for n in mine:
                    quantize(n, hessians.get(n))  # GPTQ: where training starts
                del hessians

                def step(done: int, total: int, loss: float, i: int = i) -> None:
                    if training.progress is not None:
                        training.progress(i, len(model.layers), done, total, loss)

                def make(name: str, q: QuantLinear, weights=weights, prefix=prefix) -> nn.Module:
                    w = weights.get(prefix + name)
                    return Frozen(q) if w is None else Trained(q, w)

                with swapped(block, make) as layers:
                    trained = [m for m in layers.values() if isinstance(m, Trained)]
                    train_block(block, xs, targets, trained, training.epochs, rope, step)
                del weights
            xs = [block(x, 0, *rope) for x in xs]
            floats = targets
        if "lm_head" in names:
            quantize("lm_head", head_hessian(model, xs))
