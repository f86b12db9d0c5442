"""Binding of the fused decode kernels (csrc/decode.c): every block of a model for a few
tokens (rows), and a token's chosen experts, run from a plan of int64 words. The plan is built by
the model layer (runtime/model/fused_decode.py), which knows the modules; this binding
only adds the instruction-set path and the thread count."""

from __future__ import annotations

from . import ops


def available() -> bool:
    return ops.available()


def layout() -> tuple[int, int, int, int, int, int]:
    """Words of the plan's header, of a layer, of a linear and of an expert row, the
    positions per block of attention's partial sums, and the most rows a call."""
    return ops._C.decode_layout()


def layers(plan, words, scratch_floats, x, rows, pos, cache, first: int, last: int) -> int:
    """Run blocks [first, last) on x (rows, dim) at positions pos (rows,) int64 with the
    rows' caches (rows, cache words) int64 (pointers, into tensors the caller keeps);
    returns the layer it stopped at: `last`, or a mixture-of-experts layer whose experts
    run next."""
    return ops._C.decode_layers(
        plan, words, scratch_floats, x, rows, pos, cache, ops._default_isa(),
        ops.get_num_threads(), first, last,
    )  # fmt: skip


def experts(table, n_rows, ids, weights, k, shared_w, xn, x, rows, dim, sums, n, phase):
    """x += the chosen experts' weighted outputs on xn, each of `rows` rows as MoE.forward
    for one token (pointers, into tensors the caller keeps)."""
    ops._C.decode_experts(
        table, n_rows, ids, weights, k, shared_w, xn, x, rows, dim, sums, n,
        ops._default_isa(), ops.get_num_threads(), phase,
    )  # fmt: skip


def kv_store(x, n: int, kind: int, group: int, cache, scales) -> None:
    """n float32 values at x into a KV cache of `kind` (decode.c's KV_*) from its first
    element (pointers), as the fused step writes keys and values."""
    ops._C.decode_kv_store(x, n, kind, group, cache, scales)
