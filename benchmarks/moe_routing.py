"""Routing figures of the trained MoE: cache hit rates per policy, and the Fate predictor.

    python benchmarks/moe_routing.py [--model /tmp/moe-shakespeare] [--tokens 8192]
        [--trace /tmp/moe-shakespeare-trace.npz] [--live CHECKPOINT --live-tokens 512]

The model is benchmarks/train_moe.py's, run by infer's own runtime (runtime/model/moe.py) over
the held-out tenth of tinyshakespeare, in consecutive windows of the trained length (128).
Hooks capture, for each MoE layer l, the router's probabilities and the hidden states
from which layer l+1's experts are predicted with layer l+1's router (Fate):

    moe_in     layer l+1's router on layer l's MoE input (post_attention_layernorm_l out)
    residual   layer l+1's router on post_attention_layernorm_{l+1} of layer l's residual
               after attention
    layer_out  the same on layer l's output, i.e. on the residual entering layer l+1:
               known before l+1's attention runs, so its reads overlap only that
               attention (SmallThinker's pre-attention prediction; offload/experts.py's
               `refine`, which also predicts layer 0 from the embeddings)

A causal forward routes each position as decoding it would, so the windows stand in for
a decoded stream: the trace replays them one token at a time, the cache kept across
windows. Reported: the predictor's precision and recall per layer (top k and top 2k);
the hit rate of `get` for each policy, slot allocation and cache size (25/50/75% of all
experts), without prefetch and prefetching the top k or 2k, with Belady's MIN (evict the
expert needed furthest ahead: no cache without prefetch does better) as the bound;
ScorePolicy's decay alpha.

--live CHECKPOINT (our format, `infer quantize DIR -o CHECKPOINT --to int8`) decodes
--live-tokens held-out tokens one at a time with the experts read from disk through the
cache (offload/experts.py), for each policy and cache size: hit rate, precision and
recall, reads, stalls and tok/s, against the resident model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

from infer.offload.expert_cache import CacheStats, ScorePolicy, allocate
from infer.offload.trace import Trace, TraceRecorder, replay
from infer.runtime.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_moe import encode, split_text

WINDOW = 128  # the length the model was trained on


@torch.no_grad()
def capture(model, windows: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per MoE layer, over all windows' tokens in order: router probs (N, E), the MoE
    input, the residual after attention, and the layer's output (N, dim)."""
    got = {"probs": [], "moe_in": [], "residual": [], "layer_out": [], "layer_in": []}
    per: dict[str, list[list[torch.Tensor]]] = {k: [[] for _ in model.layers] for k in got}

    def keep(kind, i):
        return lambda m, a, *out: per[kind][i].append((out[0] if out else a[0]).reshape(-1, dim))

    dim, hooks = model.args.dim, []
    for i, block in enumerate(model.layers):
        norm = block.post_attention_layernorm
        hooks.append(norm.register_forward_hook(keep("moe_in", i)))
        hooks.append(norm.register_forward_pre_hook(keep("residual", i)))
        hooks.append(block.register_forward_hook(keep("layer_out", i)))
        hooks.append(block.register_forward_pre_hook(keep("layer_in", i)))
    try:
        for w in windows:
            model(w[None], 0, model.new_cache(w.shape[0]))
    finally:
        for h in hooks:
            h.remove()
    for kind in ("moe_in", "residual", "layer_out", "layer_in"):
        got[kind] = [torch.cat(xs) for xs in per[kind]]
    got["probs"] = [b.mlp.probs(x) for b, x in zip(model.layers, got["moe_in"])]
    return got


@torch.no_grad()
def predict(model, got, source: str, width: int, d: int = 1) -> list[torch.Tensor]:
    """(N, width) experts predicted for layer l+d at each layer l < L-d from `source`."""
    layers, out = model.layers, []
    for lay in range(len(layers) - d):
        x = got[source][lay]
        if source != "moe_in":
            x = layers[lay + d].post_attention_layernorm(x)
        out.append(layers[lay + d].mlp.probs(x).topk(width, -1).indices)
    return out


@torch.no_grad()
def predict_entry(model, got, width: int) -> list[torch.Tensor]:
    """(N, width) experts predicted for each layer l on entering it: its router on
    post_attention_layernorm_l of the residual stream entering layer l."""
    return [
        b.mlp.probs(b.post_attention_layernorm(x)).topk(width, -1).indices
        for b, x in zip(model.layers, got["layer_in"])
    ]


def overlap(pred: torch.Tensor, actual: torch.Tensor) -> tuple[float, float]:
    """(precision, recall) of predicted sets against actual sets, over all tokens."""
    hit = (pred[:, :, None] == actual[:, None, :]).any(-1).sum().item()
    return hit / pred.numel(), hit / actual.numel()


def belady(trace: Trace, slots: list[int]) -> float:
    """Hit rate of Belady's MIN per layer: on a miss with full slots, evict the resident
    expert whose next use is furthest away. Without prefetch nothing does better."""
    hits = uses = 0
    for lay, cap in enumerate(slots):
        seq = trace.experts[:, lay]  # (T, k)
        T = len(seq)
        nxt = np.full((T, trace.n_experts), T)  # nxt[t, e]: first use of e at or after t
        for t in range(T - 1, -1, -1):
            if t + 1 < T:
                nxt[t] = nxt[t + 1]
            nxt[t, seq[t]] = t
        resident: set[int] = set()
        for t in range(T):
            todo = sorted(set(seq[t].tolist()))
            after = nxt[t + 1] if t + 1 < T else np.full(trace.n_experts, T)
            for i, e in enumerate(todo):
                uses += 1
                if e in resident:
                    hits += 1
                    continue
                if cap == 0:
                    continue
                if len(resident) >= cap:  # this token's later experts are needed now
                    cands = [r for r in resident if r not in todo[i + 1 :]] or list(resident)
                    resident.discard(max(cands, key=lambda r: after[r]))
                resident.add(e)
    return hits / uses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/moe-shakespeare"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--trace", type=Path, default=Path("/tmp/moe-shakespeare-trace.npz"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--live", type=Path, help="our-format checkpoint of the model")
    ap.add_argument("--live-tokens", type=int, default=512)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model = load_model(args.model, max_seq_len=WINDOW).model
    L, E, k = model.args.n_layers, model.args.n_experts, model.args.n_experts_per_tok
    _, held = split_text()
    n = args.tokens // WINDOW
    ids = encode(held)[: n * WINDOW].reshape(n, WINDOW)
    t0 = time.perf_counter()
    got = capture(model, ids)
    print(f"{args.model}: {L} layers, {E} experts, top {k}; {ids.numel()} held-out tokens")
    print(f"forward with hooks: {time.perf_counter() - t0:.1f}s\n")

    probs = got["probs"]
    actual = [p.topk(k, -1) for p in probs]
    use = torch.stack([torch.bincount(a.indices.flatten(), minlength=E) for a in actual])
    share = use.float() / use.sum(1, keepdim=True)
    print("expert load per layer (share of routings; uniform = %.3f):" % (1 / E))
    for lay in range(L):
        print(f"  layer {lay}: min {share[lay].min():.3f}  max {share[lay].max():.3f}")

    # ---- the cross-layer predictor ----
    print("\npredictor precision / recall for layer l+1, predicted at layer l:")
    print("| source | predicted | " + " | ".join(f"l={i + 1}" for i in range(L - 1)) + " | all |")
    print("|---|---|" + "---|" * L)
    best, best_pr = None, -1.0
    for source in ("moe_in", "residual", "layer_out"):
        for width in (k, 2 * k):
            pred = predict(model, got, source, width)
            cells, hit_p, hit_r = [], 0.0, 0.0
            for lay in range(L - 1):
                p, r = overlap(pred[lay], actual[lay + 1].indices)
                cells.append(f"{p:.3f} / {r:.3f}")
                hit_p, hit_r = hit_p + p / (L - 1), hit_r + r / (L - 1)
            print(
                f"| {source} | top {width} | "
                + " | ".join(cells)
                + f" | {hit_p:.3f} / {hit_r:.3f} |"
            )
            if source != "layer_out" and width == k and hit_p > best_pr:
                best, best_pr = source, hit_p

    entry = predict_entry(model, got, 2 * k)
    cells = [overlap(entry[lay][:, :k], actual[lay].indices) for lay in range(L)]
    print(
        f"| entry (own router, residual entering l) | top {k} | "
        + " | ".join(f"{p:.3f} / {r:.3f}" for p, r in cells[1:])
        + f" | {sum(p for p, _ in cells[1:]) / (L - 1):.3f} / "
        f"{sum(r for _, r in cells[1:]) / (L - 1):.3f} |  (layer 0: {cells[0][0]:.3f})"
    )

    ahead = predict(model, got, "moe_in", k, d=2)
    cells = [overlap(ahead[lay], actual[lay + 2].indices)[0] for lay in range(L - 2)]
    print(
        f"two layers ahead (layer l+2's router on layer l's MoE input), top {k}: precision "
        f"{sum(cells) / len(cells):.3f} (" + " ".join(f"{c:.2f}" for c in cells) + ")"
    )

    # ---- the trace: predictions of the top 2k, so replay can prefetch k or 2k ----
    pred = predict(model, got, best, 2 * k)
    meta = {"model": str(args.model), "predictor": best, "refined": "entry", "text": "held-out"}
    rec = TraceRecorder(L, E, meta=meta)
    for lay in range(L):
        w = actual[lay].values / actual[lay].values.sum(-1, keepdim=True)
        nxt = pred[lay] if lay < L - 1 else None
        two = ahead[lay] if lay < L - 2 else None
        rec.record(lay, actual[lay].indices, w, probs[lay], nxt, entry[lay], two)
    trace = rec.trace()
    trace.save(args.trace)
    print(
        f"\ntrace: {args.trace} ({trace.n_tokens} tokens), predictor {best} and entry, top {2 * k}"
    )
    # prefetch variants: (Fate width, entry width, two-ahead width); None: no prefetch
    widths = {
        "none": None,
        f"top {k}": (k, 0, 0),
        f"top {2 * k}": (2 * k, 0, 0),
        f"entry {k}": (0, k, 0),
        f"top {k} + entry {k}": (k, k, 0),
        f"top {k} + entry {k} + 2 ahead {k} (default)": (k, k, k),
    }

    def cut(width):
        w, r, a = width
        return dataclasses.replace(
            trace,
            predicted=trace.predicted[:, :, :w],
            refined=trace.refined[:, :, :r],
            ahead=trace.ahead[:, :, :a],
        )

    def run(policy, slots, width, scheme="uniform"):
        t = trace if width is None else cut(width)
        return replay(t, policy, slots, prefetch=width is not None, scheme=scheme).totals()

    # ---- replay ----
    print("\nhit rate of get() by policy; reads = experts read per token (on demand +")
    print("prefetched) with lfu; MIN = Belady's bound for a cache without prefetch")
    print("| cached | slots | prefetch | lru | lfu | score | reads (lfu) | MIN |")
    print("|---|---|---|---|---|---|---|---|")
    for frac in (0.25, 0.5, 0.75):
        total = int(frac * L * E)
        for scheme in ("uniform", "shallow"):
            slots = allocate(total, L, E, scheme)
            for label, width in widths.items():
                if (
                    scheme == "shallow"
                    and label not in ("none", f"top {k}")
                    and not (label.endswith("(default)"))
                ):
                    continue  # the variants once, with uniform slots
                st = {name: run(name, slots, width) for name in ("lru", "lfu", "score")}
                reads = (st["lfu"].misses + st["lfu"].prefetched) / trace.n_tokens
                mn = f"{belady(trace, slots):.3f}" if width is None else ""
                cells = " | ".join(f"{v.hit_rate:.3f}" for v in st.values())
                print(f"| {frac:.0%} | {scheme} {slots} | {label} | {cells} | {reads:.2f} | {mn} |")

    total = int(0.5 * L * E)
    print(f"\nScorePolicy alpha at 50% ({total} slots, uniform): none / top {k} prefetch")
    for alpha in (0.01, 0.03, 0.1, 0.3, 0.5):
        a, b = (run(ScorePolicy(alpha), total, w) for w in (None, (k, 0, 0)))
        print(f"  alpha {alpha}: {a.hit_rate:.3f} / {b.hit_rate:.3f}")

    print(f"\nprefetch bookkeeping at 50% (lfu, shallow), layers 1..{L - 1} (layer 0 has no")
    print("Fate prediction): precision = predicted and used / predicted; recall = / used")
    for label, width in list(widths.items())[1:]:
        cache = replay(cut(width), "lfu", allocate(total, L, E, "shallow"))
        st = sum(cache.stats[1:], CacheStats())
        print(
            f"  {label}: precision {st.precision:.3f}, recall {st.recall:.3f}, "
            f"hit rate {st.hit_rate:.3f}, {st.prefetched / trace.n_tokens:.2f} prefetch reads "
            f"per token, {st.prefetch_used / max(1, st.prefetched):.3f} of them used"
        )

    if args.live is not None:
        live(args.live, ids.flatten()[: args.live_tokens])


@torch.no_grad()
def decode(model, tokens: torch.Tensor) -> float:
    """Teacher-forced decoding, one token per forward, windows of WINDOW; seconds."""
    cache = model.new_cache(WINDOW)
    t0 = time.perf_counter()
    for t, tok in enumerate(tokens.tolist()):
        model(torch.tensor([[tok]]), t % WINDOW, cache)
    return time.perf_counter() - t0


def live(path: Path, tokens: torch.Tensor) -> None:
    """Experts read from disk through the cache, token by token, against resident."""
    from infer.offload.experts import load_expert_cached
    from infer.runtime.files.checkpoint import read_checkpoint

    n = len(tokens)
    resident = load_model(path, max_seq_len=WINDOW).model
    base = n / decode(resident, tokens)
    del resident
    print(f"\nlive: {path}, {n} tokens decoded one at a time; resident {base:.0f} tok/s")
    print("| policy | cached | hit rate | precision / recall | reads/token | KiB/token |", end="")
    print(" stall ms/token | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    ckpt = read_checkpoint(path)
    L, E = ckpt.args.n_layers, ckpt.args.n_experts
    for frac in (0.25, 0.5, 0.75):
        for name in ("lru", "lfu", "score"):
            model, off = load_expert_cached(
                ckpt, torch.float32, WINDOW, int(frac * L * E), policy=name
            )
            try:
                secs = decode(model, tokens)
            finally:
                off.close()
            st = off.cache.totals()
            pred = sum(off.cache.stats[1:], CacheStats())  # layer 0 is never predicted
            print(
                f"| {name} | {frac:.0%} | {st.hit_rate:.3f} | "
                f"{pred.precision:.3f} / {pred.recall:.3f} | "
                f"{(st.misses + st.prefetched) / n:.2f} | {st.bytes_read / n / 1024:.0f} | "
                f"{st.stall_s / n * 1e3:.2f} | {n / secs:.0f} |"
            )


if __name__ == "__main__":
    main()
