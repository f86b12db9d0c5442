"""The fused decode step: the blocks of a model for one token in C calls.

In small models a token's matmuls are cheap and the many torch element-wise ops and
Python calls around them are not. csrc/decode.c runs a whole Block for one token with
the element-wise work in plain loops and the quantized matmuls called directly. Its
definition is llama.py's and gemma3.py's Block.forward (tests compare them on every
architecture variant). A model tells it what its blocks differ in: each block's norm
weights (`norm_weights`: Gemma's norms after attention and after the MLP), each layer's
rope tables and window (`layer_rope`), the MLP activation (`mlp_act`) and the query
scale (`attn_scale`).

    step = FusedDecode.prepare(model)      # None when the model is not one it runs
    x = step(x, rows, words)               # x (1, R, dim) float32 -> after the last block
    stage = FusedDecode.prepare(model, range(4, 8))  # blocks 4-7 only (a pipeline stage)

A call runs R rows (llama.Rows: each sequence's tokens at their positions, its cache),
every weight read once for all of them, up to `max_rows` rows at a time (more are run
as several such calls); each row computes what it would alone. A plan over a range of
blocks (a pipeline stage's, the rest of the model on the meta device) numbers them from
0, and its caches hold those blocks' layers only.

A dense model's blocks run in one C call. In a mixture-of-experts layer the C stops
after attention; the block's router (MoE.route, in torch, so the experts chosen are the
model's own) picks the experts, and one more C call runs them (decode_experts: all the
chosen experts' gate and up GEMVs as one pool job, then their down GEMVs as another)
and adds their weighted outputs, in MoE.forward's order, before the next layer's call.
Experts whose provider is not resident (an expert cache, offload/) are bound through
the provider's `bound` in the order MoE.forward gets them: each call runs the next
expert (waiting for its read if need be) with those after it already in memory (its
`ready`), so experts compute while later ones are still being read. The sum is kept
between the calls: the cached model computes what the resident one does, bit for bit.
Forward pre-hooks on a block or an MoE block (a routing recorder's, an expert cache's
predictions) run where their __call__ would run them: the C stops before such a block.
They observe; an input a hook returns in place of the block's is not used.

It runs models whose compute dtype is float32 and whose every block linear (each
expert's included) is a quantized format with a C kernel (int8, int6, int5, int4, the
K-quants and iq4_xs, lut1-4); routers stay float, in torch. The plan holds data pointers into the model's
tensors, so a session builds it again whenever those change; each call passes its rows' caches
(`cache_words`): float32, bf16 or int8 (kvcache.py), each row's its own. A layer whose
weights are not in place (streamed from disk: a placeholder) makes prepare return None.
"""

from __future__ import annotations

import struct

import torch
from torch import nn

from ...kernels_cpu import decode as kernels
from ...quant.formats.base import QuantLinear
from .llama import LayerRows, Rows
from .moe import MoE

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_ACTS = {"silu": 0, "gelu_tanh": 1}  # the MLP's activation -> decode.c's act word
_MLP = ("gate_proj", "up_proj", "down_proj")


def _linear_words(module: nn.Module | None) -> list[int] | None:
    """kind, qweight, scales, mins, bias, N, K, g, qh of a linear the C runs, else None."""
    w = module.kernel_weights() if isinstance(module, QuantLinear) else None
    if w is None:
        return None
    bias = module.bias
    if bias is not None and not (bias.dtype is torch.float32 and bias.is_contiguous()):
        return None
    # A placeholder (offload/: one element expanded) or a meta tensor holds no weights.
    for t in (w.qweight, w.scales, w.mins, w.qh):
        if t is not None and (t.is_meta or not t.is_contiguous()):
            return None
    return [
        w.kind,
        w.qweight.data_ptr(),
        0 if w.scales is None else w.scales.data_ptr(),
        0 if w.mins is None else w.mins.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        module.out_features,
        module.in_features,
        w.group_size,
        0 if w.qh is None else w.qh.data_ptr(),
    ]


def _runs_on_kernels(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear) and module.kernel_weights() is not None


def _f32(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype is torch.float32 and t.is_contiguous() and not t.is_meta


def _mlp_words(mlp: nn.Module) -> list[int] | None:
    """gate, up, down words of an MLP (a dense block's or an expert's) the C runs."""
    words = []
    for name in _MLP:
        lin = _linear_words(getattr(mlp, name, None))
        if lin is None:
            return None
        words += lin
    return words


_KV_KINDS = {"f32": 0, "bf16": 1, "int8": 2}  # a cache's kind -> decode.c's KV_*


def cache_words(cache: list) -> torch.Tensor:
    """A sequence's cache (kvcache.py: one per layer) as decode.c reads it, int64: its
    positions, kind and int8 group, then each layer's k, v, k_scale, v_scale pointers
    (0 for a float cache's scales)."""
    kind = cache[0].kind
    tensors = ("k", "v", "k_scale", "v_scale") if kind == "int8" else ("k", "v")
    words = [cache[0].k.shape[2], _KV_KINDS[kind], cache[0].group]
    for c in cache:
        ts = [getattr(c, name) for name in tensors]
        if c.kind != kind or not all(t.is_contiguous() and not t.is_meta for t in ts):
            raise ValueError("the fused decode step needs contiguous caches of one kind")
        words += [t.data_ptr() for t in ts] + [0] * (4 - len(ts))
    return torch.tensor(words, dtype=torch.int64)


class FusedDecode:
    def __init__(self, plan, keep: list, moe: dict, layers: list, rope, row_floats: int):
        self.plan = plan
        self._layers, self._rope = layers, rope  # rope: each layer's (cos, sin) tables
        self._keep = keep  # tensors and modules whose data pointers the plan holds
        self._plan_ptr, self._words = plan.data_ptr(), plan.numel()
        self._n_layers = int(plan[0])
        self._dim = int(plan[1])
        self._row_floats = row_floats  # of scratch a row
        self.max_rows = kernels.layout()[5]
        self.scratch = None
        self._grow(1)
        # layer -> (MoE block, its experts' table (rows, 3 * LIN) int64)
        self._moe = moe
        self._bufs = None  # _bound_buffers'
        self._sums = torch.empty(self.max_rows * self._dim)  # the experts' sums, a row each

    @classmethod
    def prepare(cls, model: nn.Module, layers: range | None = None) -> FusedDecode | None:
        """The fused step for `model` (a llama.Transformer or gemma3.Gemma3) over its
        blocks `layers` (default: all), or None if they have parts the C does not run
        (float or unknown-format linears, other dtypes, weights not in place)."""
        if not kernels.available() or getattr(model, "mlp_act", None) not in _ACTS:
            return None
        args = model.args
        if args.head_dim % 2:
            return None
        layers = range(len(model.layers)) if layers is None else layers
        header_words, layer_words, lin_words, _, attn_block, _ = kernels.layout()
        rows, keep, moe, hidden, rope = [], [], {}, 0, []
        for n, i in enumerate(layers):  # n: the block's index in the plan
            block = model.layers[i]
            attn = block.self_attn
            # input, pre-MLP, q, k, after attention, after the MLP (None: none)
            weights = block.norm_weights()
            cos, sin, window = model.layer_rope(i)
            if not all(_f32(w) for w in weights[:2] + (cos, sin)) or not all(
                w is None or _f32(w) for w in weights[2:]
            ):
                return None
            # q/k norms per head, or over the whole projection (OLMoE: qk_norm_full)
            D = args.head_dim
            full = (args.n_heads * D, args.n_kv_heads * D) if args.qk_norm_full else (D, D)
            if weights[2] is not None and (weights[2].numel(), weights[3].numel()) != full:
                return None
            row = [0 if w is None else w.data_ptr() for w in weights]
            row += [cos.data_ptr(), sin.data_ptr(), window or 0]
            rope.append((cos, sin))
            for name in _ATTENTION:
                module = getattr(attn, name, None)
                lin = _linear_words(module)
                if lin is None:
                    return None
                row += lin
                keep.append(module)
            mlp = block.mlp
            if isinstance(mlp, MoE):
                # Resident experts: their words now; bound on demand: at each visit, so
                # here only their formats are checked.
                resident = mlp.provider.resident
                if not resident and not all(
                    _runs_on_kernels(getattr(e, name)) for e in mlp.experts for name in _MLP
                ):
                    return None
                experts = [*mlp.experts] if resident else []
                experts += [mlp.shared_expert] if mlp.shared_expert else []
                table = [_mlp_words(e) for e in experts]
                if any(t is None for t in table):
                    return None
                moe[n] = (mlp, torch.tensor(table, dtype=torch.int64).view(-1, 3 * lin_words))
                keep += experts
                row += [0] * (3 * lin_words)  # kind 0: the experts run in decode_experts
            else:
                words = _mlp_words(mlp)
                if words is None:
                    return None
                row += words
                keep.append(mlp)
                hidden = max(hidden, mlp.gate_proj.out_features)
            assert len(row) == layer_words
            rows.append(row)
            keep += [w for w in weights if w is not None] + [cos, sin]
        S = model.max_seq_len  # the rope tables' positions: every cache's at most
        dim, H, KV, D = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        blocks = -(-S // attn_block)  # attention's per-block partials (decode.c)
        row_floats = dim + 2 * H * D + 2 * KV * D + 2 * hidden + H * blocks * (D + 2)
        eps_bits = struct.unpack("<I", struct.pack("<f", args.norm_eps))[0]
        scale_bits = struct.unpack("<I", struct.pack("<f", model.attn_scale or 0.0))[0]
        header = [len(rows), dim, H, KV, D, hidden, S, eps_bits, 0,
                  int(args.qk_norm_full), _ACTS[model.mlp_act], scale_bits, 0]  # fmt: skip
        assert len(header) == header_words
        plan = torch.tensor(header + [w for row in rows for w in row], dtype=torch.int64)
        return cls(plan, keep, moe, [model.layers[i] for i in layers], rope, row_floats)

    def _grow(self, rows: int) -> None:
        """Scratch for `rows` rows a call (the plan's words 8 and 12 say where and how many)."""
        self.scratch = torch.empty(rows * self._row_floats)
        self._scratch_n = self.scratch.numel()
        self.plan[8], self.plan[12] = self.scratch.data_ptr(), rows

    def __call__(self, x: torch.Tensor, rows: Rows, cache_words: torch.Tensor) -> torch.Tensor:
        """x (1, R, dim) float32 entering the plan's first block -> the hidden states after
        its last. Writes the rows' keys and values into their caches at their positions;
        cache_words (R, words) int64 are each row's sequence's cache_words(). More rows
        than the C takes a call run as several calls, in order (a sequence's rows after
        its earlier ones, as the C needs)."""
        m = self.max_rows
        if x.shape[1] <= m:
            return self._rows(x, rows, cache_words)
        parts = [
            self._rows(x[:, a : a + m], _row_slice(rows, a, a + m), cache_words[a : a + m])
            for a in range(0, x.shape[1], m)
        ]
        return torch.cat(parts, dim=1)

    def _rows(self, x: torch.Tensor, rows: Rows, cache_words: torch.Tensor) -> torch.Tensor:
        """__call__ for at most max_rows rows: the blocks in C calls, stopping for hooks
        and for experts."""
        R = x.shape[1]
        if R > int(self.plan[12]):
            self._grow(R)
        x = x.contiguous().clone()
        pos = torch.tensor(rows.positions, dtype=torch.int64)
        cache_words = cache_words.contiguous()
        layers, n = self._layers, self._n_layers
        layer = 0
        while layer < n:
            block = layers[layer]
            if block._forward_pre_hooks:  # as Block.__call__ would run them
                cos, sin = self._rope[layer]
                args = (x, None, cos[pos], sin[pos], LayerRows(rows.spans, layer))
                for hook in list(block._forward_pre_hooks.values()):
                    hook(block, args)
            last = layer + 1  # run on to the next block with hooks
            while last < n and not layers[last]._forward_pre_hooks:
                last += 1
            layer = kernels.layers(
                self._plan_ptr, self._words, self._scratch_n, x.data_ptr(), R, pos.data_ptr(),
                cache_words.data_ptr(), layer, last,
            )  # fmt: skip
            if layer < last:  # a mixture of experts
                self._experts(layer, x[0])
                layer += 1
        return x

    def _experts(self, layer: int, x: torch.Tensor) -> None:
        """x (R, dim) += the MoE block of `layer` on the rows' inputs, which decode_layers
        left in the scratch: MoE.forward for each row alone."""
        block, table = self._moe[layer]
        R = x.shape[0]
        xn = self.scratch[: R * self._dim].view(R, self._dim)
        for hook in list(block._forward_pre_hooks.values()):  # as block(xn) would run them
            hook(block, (xn.view(1, R, self._dim),))
        # Routed a row at a time: the router's float matmul of one row, as alone.
        chosen = [block.select(xn[r : r + 1]) for r in range(R)]
        ids = torch.cat([i for i, _ in chosen])  # (R, k)
        weights = torch.cat([w for _, w in chosen]).float().contiguous()
        shared_w = None  # (R,) float32: MoE.forward's sigmoid(shared_expert_gate(x))
        if block.shared_expert is not None:
            gate = block.shared_expert_gate
            shared_w = torch.cat([torch.sigmoid(gate(xn[r : r + 1])).view(1) for r in range(R)])
        if block.provider.resident:
            self._run_experts(table, ids, weights, shared_w, xn, x, phase=3)
            return
        for r in range(R):
            w = None if shared_w is None else shared_w[r : r + 1]
            self._bound_experts(table, block.provider, ids[r], weights[r], w, xn[r : r + 1],
                                x[r : r + 1])  # fmt: skip

    def _bound_experts(self, table, provider, ids, weights, shared_w, xn, x) -> None:
        """x (1, dim) += one row's experts, bound on demand in ascending order, as MoE.forward
        gets them: each call runs the next one (waiting for its read if need be) and those
        after it already in memory, so experts compute while later ones are still being
        read. The sum is kept between the calls: the same sum, in the same order, as one
        call."""
        chosen = sorted(zip(ids.tolist(), weights.tolist()))
        rows, rows_np, order, w, w_np = self._bound_buffers(len(chosen) + len(table), table)
        k, i = len(chosen), 0
        while i < k:
            j = i + 1
            while j < k and provider.ready(chosen[j][0]):
                j += 1
            with provider.bound([e for e, _ in chosen[i:j]]) as modules:
                for slot, module in enumerate(modules):
                    words = _mlp_words(module)
                    if words is None:
                        raise RuntimeError("an expert the fused decode step cannot run was bound")
                    rows_np[slot] = words
                    w_np[0, slot] = chosen[i + slot][1]
                rows_np[j - i : j - i + len(table)] = table.numpy()
                phase = (i == 0) | (j == k) << 1
                n = j - i + len(table)
                ids_now = order[:, : j - i]
                self._run_experts(rows[:n], ids_now, w[:, : j - i], shared_w, xn, x, phase=phase)
            i = j

    def _bound_buffers(self, n: int, table: torch.Tensor):
        """Rows (n, table's width) int64 for bound experts' words, ids 0..n-1 (1, n),
        weights (1, n) float32, and numpy views of the rows and weights: kept, not made
        per call."""
        if self._bufs is None or self._bufs[0].shape[0] < n:
            rows = torch.zeros(n, table.shape[1], dtype=torch.int64)
            w = torch.zeros(1, n)
            order = torch.arange(n, dtype=torch.int64).view(1, n)
            self._bufs = (rows, rows.numpy(), order, w, w.numpy())
        return self._bufs

    def _run_experts(self, table, ids, weights, shared_w, xn, x, *, phase) -> None:
        """kernels.experts over R rows: ids and weights (R, k), shared_w (R,) or None,
        xn and x (R, dim) contiguous."""
        ids, weights = ids.contiguous(), weights.contiguous()  # kept alive for the call
        kernels.experts(
            table.data_ptr(), table.shape[0], ids.data_ptr(), weights.data_ptr(),
            ids.shape[1], 0 if shared_w is None else shared_w.data_ptr(), xn.data_ptr(),
            x.data_ptr(), x.shape[0], self._dim, self._sums.data_ptr(), self._sums.numel(),
            phase,
        )  # fmt: skip


def _row_slice(rows: Rows, a: int, b: int) -> Rows:
    """Rows a .. b - 1 of `rows`: a sequence's span cut where they begin and end."""
    spans, start = [], 0
    for pos, n, cache in rows.spans:
        lo, hi = max(a, start), min(b, start + n)
        if lo < hi:
            spans.append((pos + lo - start, hi - lo, cache))
        start += n
    return Rows(spans)
