"""Predicting and recording what MoE routers choose.

A prediction ranks experts by a router's logits (`guess`) on a hidden state that is not
yet its input: layer j + 1's router on layer j's MoE input (Fate's cross-layer
prediction), or a layer's router on the residual stream entering it (`router_input`).
A wrong guess costs a read, never a different output. `RoutingRecorder` records a
resident model's routing into a trace (offload/trace.py) as an expert cache records it.
"""

from __future__ import annotations

import functools

import torch

from .. import InferError
from ..kernels_cpu import ops as kernel_ops
from ..quant.formats.int8 import Int8Linear
from ..runtime.model.llama import RMSNorm, Transformer
from ..runtime.model.moe import MoE
from .trace import TraceRecorder


def guess(block: MoE, x: torch.Tensor, k: int) -> torch.Tensor:
    """(N, k) ids of the k experts that `block`'s router ranks first for each of the N
    tokens of x (..., dim): a prediction to prefetch by. Its logits' top k: the softmax
    that route() takes them through does not change their order."""
    return block.gate(x.reshape(-1, x.shape[-1])).topk(k, dim=-1).indices


def guess_router(block: MoE) -> Int8Linear | None:
    """An int8 copy of `block`'s router (per-channel scales) to predict with: a quarter
    of the float router's bytes, read by the C GEMV on every kernel thread, where torch
    reads the float one on one (the fused step keeps torch to one thread). A prediction
    is a guess, so the copy's rounding costs nothing but the odd swap at the k-th place.
    None without the C kernels, or for a router with a bias."""
    gate = block.gate
    if not kernel_ops.available() or gate.bias is not None:
        return None
    return Int8Linear.from_float(gate.weight.detach().float(), group_size=0, search=False)


def router_input(layer, x: torch.Tensor) -> torch.Tensor:
    """What a layer's router will see, guessed from the residual stream `x` entering
    the layer: the layer's MoE-input norm of it (attention's update is not known yet),
    up to a positive factor per token, which does not change the router's ranking: an
    RMSNorm's weight times x, without its 1 / rms. A model whose router runs before
    attention would return its router's own input here, and the prediction would be
    exact."""
    norm = layer.post_attention_layernorm
    return x * norm.weight if isinstance(norm, RMSNorm) else norm(x)


# ---------------------------------------------------------------------------------------
# Recording a resident model's routing
# ---------------------------------------------------------------------------------------


class RoutingRecorder:
    """Hooks that record a resident MoE model's routing into `recorder` (what `--trace`
    does when the experts are not offloaded): the same rows an ExpertStore records, with
    Fate's prediction `width` wide."""

    def __init__(self, model: Transformer, recorder: TraceRecorder, width: int | None = None):
        args = model.args
        ids = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
        if not ids:
            raise InferError("--trace needs a mixture-of-experts model")
        self.recorder = recorder
        self.blocks = [model.layers[i].mlp for i in ids]
        self.width = args.n_experts_per_tok if width is None else width
        self._handles = [
            b.register_forward_pre_hook(functools.partial(self._visit, j))
            for j, b in enumerate(self.blocks)
        ]

    @torch.no_grad()
    def _visit(self, j: int, block, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        pred = None
        if j + 1 < len(self.blocks):
            pred = guess(self.blocks[j + 1], x, self.width)
        ids, weights = block.route(x)
        self.recorder.record(j, ids, weights.float(), block.probs(x), pred)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def new_recorder(ckpt_args, meta: dict | None = None) -> TraceRecorder:
    n = sum(1 for i in range(ckpt_args.n_layers) if ckpt_args.is_moe_layer(i))
    return TraceRecorder(n, ckpt_args.n_experts, meta)
