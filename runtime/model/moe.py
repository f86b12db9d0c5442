"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

It takes the MLP's place in the layers `ModelArgs.is_moe_layer` picks. Parameters have
Hugging Face names, so safetensors load without a table (Transformer.sanitize maps
Mixtral's older names and stacked expert tensors onto these):

    gate                 nn.Linear(dim, n_experts): the router
    experts.E            expert E, an MLP of width moe_hidden_dim (gate_proj, up_proj, down_proj)
    shared_expert        Qwen2-MoE only: an MLP every token goes through, its output
    shared_expert_gate   scaled by sigmoid(nn.Linear(dim, 1))

Routing is transformers' (Qwen2MoeTopKRouter, MixtralTopKRouter): the router's logits in
the compute dtype, a softmax over all experts in float32, the top k, renormalised to sum
to 1 when norm_topk_prob. Mixtral always renormalises, which equals its original
definition (top k of the logits, softmax over those k). The weights are then cast to the
compute dtype, as the Qwen and OLMoE code does (Mixtral's keeps them in float32: the same
in float32, one rounding apart in bfloat16).

The block runs its experts through `provider` (the `Experts` interface): by default
`ResidentExperts`, its own `experts` modules; an expert cache (offload/) assigns one that
reads experts from disk as they are routed to.

forward() runs only the experts the router chose. Decoding (one token) calls each of its
k experts once; a prompt groups tokens by expert, runs each used expert once on its
tokens and scatter-adds the weighted outputs. Both add experts in ascending id order,
as transformers does, so a token's output does not depend on how the prompt was split.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs


class Experts(Protocol):
    """Where an MoE block's experts come from; `e` is an expert id of the block."""

    # Every expert stays in memory: the fused decode step may hold pointers to them.
    resident: bool

    def routed(
        self, x: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """The router chose `ids` (N, k) with `weights` for the tokens x (N, dim), from
        `probs` (N, n_experts); called before any of them runs."""

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` on x (n, dim), the tokens routed to it."""

    def bound(self, ids: list[int]) -> AbstractContextManager[list[nn.Module]]:
        """The modules of experts `ids` (ascending), ready to run while the context lasts."""

    def ready(self, e: int) -> bool:
        """Whether bound([e]) would not wait for a read."""


class ResidentExperts:
    """Experts held in memory: the block's own modules."""

    resident = True

    def __init__(self, modules: nn.ModuleList):
        self.modules = modules

    def routed(self, x, probs, ids, weights) -> None:
        pass

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.modules[e](x)

    @contextlib.contextmanager
    def bound(self, ids: list[int]) -> Iterator[list[nn.Module]]:
        yield [self.modules[e] for e in ids]

    def ready(self, e: int) -> bool:
        return True


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, mlp: type[nn.Module]):
        """`mlp` builds one expert from a ModelArgs (llama.MLP, of width args.hidden_dim)."""
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.n_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        expert_args = dataclasses.replace(args, hidden_dim=args.moe_hidden_dim)
        self.experts = nn.ModuleList(mlp(expert_args) for _ in range(args.n_experts))
        if args.shared_expert_dim:
            self.shared_expert = mlp(dataclasses.replace(args, hidden_dim=args.shared_expert_dim))
            self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.provider: Experts = ResidentExperts(self.experts)

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> (N, n_experts) float32: the router's softmax for each of the
        N = x.numel() // dim tokens."""
        logits = self.gate(x.reshape(-1, x.shape[-1]))  # in x's dtype, as transformers
        return logits.float().softmax(dim=-1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., dim) -> (ids, weights), both (N, top_k): int64 expert ids by falling
        weight, weights in x's dtype. The router alone: callable on any hidden state."""
        return self._top(self.probs(x), x.dtype)

    def _top(self, probs: torch.Tensor, dtype: torch.dtype):
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(dtype)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route(x) for tokens about to run: the provider hears of the choice first."""
        x = x.reshape(-1, x.shape[-1])
        probs = self.probs(x)
        ids, weights = self._top(probs, x.dtype)
        self.provider.routed(x, probs, ids, weights)
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (1, T, dim) -> (1, T, dim)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        ids, weights = self.select(x)
        if x.shape[0] == 1:
            # Decode: the token's k experts, in ascending id order (see the module doc).
            out = torch.zeros_like(x)
            for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())):
                out += self.provider.run(e, x) * w
        else:
            out = self._grouped(x, ids, weights)
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each used expert once, on the tokens routed to it; outputs scatter-added."""
        k = ids.shape[1]
        flat = ids.flatten()  # (N * k,): slot t * k + j is token t's j-th choice
        slots = flat.argsort(stable=True)  # slots grouped by expert, tokens ascending in each
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        tokens = slots // k
        slot_weights = weights.flatten()[slots, None]  # (N * k, 1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                y = self.provider.run(e, x[rows]) * slot_weights[start : start + n]
                out.index_add_(0, rows, y)
            start += n
        return out
