"""The fused decode step: every block of a dense model for one token in one C call.

At small models a token's ~200 matmuls are cheap and the ~1,200 torch element-wise ops
and Python calls around them are not (`infer bench --roofline` measured ~6 ms of such
overhead a token on the default model, as long as its matmuls). csrc/decode.c runs a
whole Block for one token with the element-wise work in plain loops and the quantized
matmuls called directly. Its definition is runtime/llama.py's Block.forward (tests
compare them on every architecture variant).

    step = FusedDecode.prepare(model)   # None when the model is not one it runs
    x = step(x, pos)                    # x (1, 1, dim) float32 -> after the last block

It runs models whose compute dtype is float32, whose every block linear is a quantized
format with a C kernel (int8, int4, lut1-4), and whose blocks are the dense family's
(no mixture-of-experts). The plan holds data pointers into the model's tensors and KV
caches, so it is built again (Transformer.setup_caches does) whenever those change, and a
model whose weights are swapped in and out (offload/) must not use it.
"""

from __future__ import annotations

import struct

import torch
from torch import nn

from ..quant.base import QuantLinear
from . import ops

_C = ops._C
_PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


def _linear_words(module: nn.Module) -> list[int] | None:
    """kind, qweight, scales, mins, bias, N, K, g for a quantized linear the C runs."""
    if not isinstance(module, QuantLinear):
        return None
    fmt, params = module.format, module.params
    if fmt in ("int8", "int4"):
        kind, g = int(fmt[3:]), int(params.get("group_size", 0))
    elif fmt.startswith("lut"):
        kind, g = -int(fmt[3:]), int(params["group_size"])
    else:
        return None
    bias = module.bias
    if bias is not None and not (bias.dtype is torch.float32 and bias.is_contiguous()):
        return None
    mins = getattr(module, "mins", None)
    return [
        kind,
        module.qweight.data_ptr(),
        module.scales.data_ptr(),
        0 if mins is None else mins.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        module.out_features,
        module.in_features,
        g,
    ]


def _f32(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype is torch.float32 and t.is_contiguous() and not t.is_meta


class FusedDecode:
    def __init__(self, plan: torch.Tensor, scratch: torch.Tensor, keep: list):
        self.plan, self.scratch = plan, scratch
        self._keep = keep  # tensors and modules whose data pointers the plan holds
        self._plan_ptr, self._words = plan.data_ptr(), plan.numel()
        self._scratch_ptr, self._scratch_n = scratch.data_ptr(), scratch.numel()

    @classmethod
    def prepare(cls, model: nn.Module) -> FusedDecode | None:
        """The fused step for `model` (a runtime.llama.Transformer), or None if it has
        parts the C does not run (float or unknown-format linears, other dtypes, MoE)."""
        if _C is None or not hasattr(model, "rope_cos"):
            return None
        args = model.args
        cos, sin = model.rope_cos, model.rope_sin
        if not (_f32(cos) and _f32(sin)) or args.head_dim % 2:
            return None
        header_words, layer_words, _ = _C.decode_layout()
        rows, keep = [], [cos, sin]
        for block in model.layers:
            attn = block.self_attn
            norms = [block.input_layernorm, block.post_attention_layernorm]
            if attn.q_norm is not None:
                norms += [attn.q_norm, attn.k_norm]
            weights = [n.weight for n in norms]
            cache = attn.cache
            if cache is None or not all(_f32(w) for w in weights):
                return None
            if attn.q_norm is not None and attn.q_norm.weight.numel() != args.head_dim:
                return None  # a norm over the whole projection (OLMoE) is not per head
            if not (_f32(cache.k) and _f32(cache.v)):
                return None
            row = [weights[0].data_ptr(), weights[1].data_ptr()]
            row += [weights[2].data_ptr(), weights[3].data_ptr()] if len(weights) == 4 else [0, 0]
            row += [cache.k.data_ptr(), cache.v.data_ptr()]
            for parent, name in _PROJECTIONS:
                module = getattr(getattr(block, parent, None), name, None)
                lin = _linear_words(module)
                if lin is None:
                    return None
                row += lin
                keep.append(module)
            assert len(row) == layer_words
            rows.append(row)
            keep += weights + [cache.k, cache.v]
        S = model.max_seq_len
        dim, H, KV, D = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        hidden = model.layers[0].mlp.gate_proj.out_features if model.layers else 0
        scratch = torch.empty(dim + 2 * H * D + 2 * KV * D + H * S + 2 * hidden)
        eps_bits = struct.unpack("<I", struct.pack("<f", args.norm_eps))[0]
        header = [len(rows), dim, H, KV, D, hidden, S, args.sliding_window or 0, eps_bits,
                  cos.data_ptr(), sin.data_ptr(), scratch.data_ptr()]  # fmt: skip
        assert len(header) == header_words
        plan = torch.tensor(header + [w for row in rows for w in row], dtype=torch.int64)
        return cls(plan, scratch, keep)

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x (1, 1, dim) float32 after the embedding -> the hidden state after every block.
        Writes the token's keys and values into the caches at `pos`."""
        x = x.contiguous().clone()
        _C.decode_layers(
            self._plan_ptr, self._words, self._scratch_n, x.data_ptr(), pos,
            ops._default_isa(), ops.get_num_threads(),
        )  # fmt: skip
        return x
