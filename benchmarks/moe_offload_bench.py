"""Decode a large mixture-of-experts model with 25% of its experts in memory.

    python benchmarks/moe_offload_bench.py DIR [--layers 16] [--tokens 40] [--warmup 8]
        [--runs lfu:0.25,lru:0.25,score:0.25,lfu:0.1,lfu:0.5,naive] [--delete]

DIR is made on first use: random weights in Qwen3-30B-A3B's per-layer shape (hidden 2048,
128 experts of width 768, top 8 renormalised, 32 query / 4 KV heads of 128, q/k norms,
vocab 151936), int4 (symmetric, group 32: GGUF Q4_0's layout) everywhere but the routers
and norms, written in infer's format by `save_checkpoint`: one 2.65 MB unit per expert.
--layers 16 of the real 48 keeps the file at 6 GB (the disk here is shared; 48 would be
17 GB); per token the figures scale with the layer count, so ratios do not depend on it.
Expert codes are windows of one 256 MiB random pool at random offsets (distinct bytes
per expert, without holding 6 GB of random numbers in memory): speed depends on shapes
and bytes, not on trained values.

Each run is a fresh process (clean memory figures) with the model file dropped from the
page cache first (posix_fadvise DONTNEED); reads are O_DIRECT:

  POLICY:SHARE  load_moe_budgeted with a budget of the dense parts (resident) plus the
                expert buffers in flight plus SHARE of all experts, the cache's policy
                POLICY; the defaults: reads on 4 threads, a visit's misses first
                (start), the top 8 predicted for the next two layers (Fate: their routers
                on this layer's MoE input) and on entering each layer (its router on the
                residual stream there), wrong predictions still queued cancelled
  naive         load-on-demand: each routed expert read when MoE.forward asks for it,
                one at a time, nothing cached, nothing prefetched
  POLICY:SHARE:FLAG...  variants: nopred (no prediction: only a visit's misses read
                side by side), ahead1 (no prediction two layers ahead), norefine (no
                prediction on entering a layer), entry (only that prediction: no
                cross-layer one), nocancel (wrong queued predictions still
                read), nocrc (no crc32 on an expert's first read)

Decoding, one token per forward pass after an 8-token prompt, of a fixed random token
sequence (teacher-forced: a random model's greedy output repeats one token, and the same
token routes to the same experts, which would make any cache look perfect); the first
--warmup tokens fill the cache and are not counted. For each run (medians over --repeat interleaved rounds): decode tok/s, hit
rate, prefetch precision / recall, experts read per token (and the MB), stalls; the I/O
ceiling = disk GB/s / bytes of experts that still have to be read per token (the uses
that were not resident: misses and prefetch reads that were used), and tok/s against
it; compute per token (time minus waiting for reads) against the reads at the disk's
speed, and the overlap max(compute, reads) / time; the disk's busy share (a read in
flight); speed-up over naive; the peak footprint against the budget; whether every run produced
the same tokens and logits (sha256 of each step's logits; it must: the experts are the same
bytes).

Before each run a separate process measures the disk: random expert units read with
O_DIRECT, 1, 2, 4 and 8 reads in flight (the disk here moves between 1 and 2.6 GB/s from
minute to minute, so each run is held against the disk of its own minute, the better of
before and after it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from offload_bench import drop_cache, json_child, read_rate, write_random_model  # benchmarks/

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,  # unused: every layer is sparse
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": 2,
}
PROMPT = [1, 450, 4955, 310, 20602, 338, 263, 5828]
SEED = 0  # of the decoded token ids
POOL_BYTES = 256 << 20
DEFAULT_RUNS = "lfu:0.25,lru:0.25,score:0.25,lfu:0.1,lfu:0.5,naive"


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


class Int4Source:
    """Random int4 layers; `pooled` ones view windows of one random pool (no copy).

    Codes are uniform on 1..15, so w = (q - 8) * d has mean 0: with 0..15 every weight
    would carry -d/2, every projection a component along the all-ones direction, and
    those add up in the residual stream until every token routes alike."""

    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = self.codes(POOL_BYTES)
        self.rng = random.Random(seed)

    def codes(self, n: int) -> torch.Tensor:
        """n random bytes, each nibble uniform on 1..15."""
        lo, hi = (torch.randint(1, 16, (n,), dtype=torch.uint8, generator=self.gen) for _ in "lh")
        return lo | (hi << 4)

    def layer(self, out_features: int, in_features: int, pooled: bool, std: float = 0.02):
        from infer.quant.formats.int4 import Int4Linear

        n = out_features * in_features // 2
        if pooled:
            off = self.rng.randrange(0, POOL_BYTES - n)
            q = self.pool[off : off + n].view(out_features, in_features // 2)
        else:
            q = self.codes(n).view(out_features, in_features // 2)
        # w = (q - 8) * d with d so that w has std `std` (q - 8 uniform on -7..7: std 4.32)
        d = torch.full((out_features, in_features // 32), std / 4.32, dtype=torch.float16)
        return Int4Linear.from_tensors(
            {"qweight": q, "scales": d}, {"group_size": 32, "symmetric": True}
        )


def make_model(dest: Path, config: dict, seed: int = 0) -> None:
    from torch import nn

    src = Int4Source(seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def linear(name: str, m: nn.Linear) -> nn.Module:
        if name.endswith("mlp.gate"):  # the router stays float, as every recipe keeps it
            gate = nn.Linear(m.in_features, m.out_features, bias=False)
            w = torch.randn(m.weight.shape, generator=gen) * 0.02
            gate.weight = nn.Parameter(w, requires_grad=False)
            return gate
        # Attention outputs of std 0.002, not 0.02: a random model attends almost evenly,
        # so its attention output is nearly the same at every step, and 16 layers of it
        # would outweigh the token's own state: deep layers then route every token to
        # the same few experts (measured: 25 distinct experts of 128 over 20 tokens).
        std = 0.002 if name.endswith("o_proj") else 0.02
        return src.layer(m.out_features, m.in_features, ".experts." in name, std)

    # Embedding rows of std 1: each token's own state must dominate the residual stream,
    # else the sum of attention outputs (nearly the same at every position of a random
    # model) does, and every token routes to the same experts.
    write_random_model(
        dest, config, linear, lambda args: src.layer(args.vocab_size, args.dim, False, std=1.0)
    )


# ------------------------------------------------------------------------------------------
# Measurements, each in a child process
# ------------------------------------------------------------------------------------------


def disk_bandwidth(path: Path, n_reads: int = 96) -> dict:
    """GB/s reading random expert units with O_DIRECT, 1, 2, 4 and 8 reads in flight."""
    from infer.offload.reader import alloc_buffer
    from infer.runtime.files.checkpoint import read_checkpoint

    ckpt = read_checkpoint(path)
    experts = [u for u in ckpt.ranges if ".experts." in u]
    size = max(ckpt.ranges[u][1] - ckpt.ranges[u][0] for u in experts)
    rng = random.Random(time.time_ns())
    figures = {}
    for depth in (1, 2, 4, 8):
        units = rng.sample(experts, n_reads)
        bufs = [alloc_buffer(size) for _ in range(depth)]
        figures[f"{depth}_in_flight"], method = read_rate(ckpt, units, bufs)
    return {"gb_s": max(figures.values()), "by_depth": figures, "method": method}


def child(path: Path, run: str, n_tokens: int, warmup: int, logits_out: Path) -> dict:
    """Load as `run` says, decode, time it, count, measure the peak footprint."""
    from infer.offload.expert_plan import DEFAULT_WORKERS, budget_inputs, in_flight_buffers
    from infer.offload.experts import load_expert_cached, load_moe_budgeted, prediction_options
    from infer.offload.footprint import PeakSampler
    from infer.offload.stream import process_rss
    from infer.runtime.bench import peak_rss_bytes
    from infer.runtime.files.checkpoint import read_checkpoint

    torch.set_num_threads(2)
    ckpt = read_checkpoint(path)
    drop_cache(ckpt.file)
    ctx = len(PROMPT) + n_tokens + 2
    budget = None
    with PeakSampler(ckpt.file) as peak:
        t0 = time.perf_counter()
        if run == "naive":
            model, off = load_expert_cached(ckpt, torch.float32, ctx, 0, prefetch=False)
        else:
            policy, share, *flags = run.split(":")
            # the runtime's named predictions (infer run --expert-prediction), and tweaks
            opts = prediction_options("none") if "nopred" in flags else {}
            opts |= prediction_options("entry") if "entry" in flags else {}
            opts |= {"refine": 0} if "norefine" in flags else {}
            opts |= {"ahead": 1} if "ahead1" in flags else {}
            opts |= {"cancel": False} if "nocancel" in flags else {}
            opts |= {"check": None} if "nocrc" in flags else {}
            fixed, dense, costs, _ = budget_inputs(ckpt, torch.float32, ctx, process_rss())
            slots = round(float(share) * costs.total)
            buffers = in_flight_buffers(costs.top_k, DEFAULT_WORKERS) + slots
            budget = fixed.total + sum(c.resident_bytes for c in dense)
            budget += buffers * costs.memory_bytes + costs.memory_bytes // 2
            model, off = load_moe_budgeted(ckpt, torch.float32, ctx, budget, policy=policy, **opts)
        load_s = time.perf_counter() - t0
        tokens, logits, step_s, stats = decode(model, off, n_tokens, warmup)
        off.close()
    r = off.report(stats, phase="decode")
    counted = step_s[warmup:]
    t = stats.total
    out = {
        "run": run,
        "load_s": load_s,
        "tokens": tokens,
        "step_s": step_s,
        "decode_tok_s": len(counted) / sum(counted),
        "counted_tokens": len(counted),
        "budget": budget,
        "planned": off.plan.footprint if off.plan else None,
        "slots": sum(off.cache.slots),
        "experts_total": off.costs.total,
        "expert_bytes": off.expert_bytes,
        "hit_rate": r.hit_rate,
        "precision": r.precision,
        "recall": r.recall,
        "reads_per_token": r.reads_per_token,
        "bytes_per_token": r.bytes_read_per_token,
        # the experts used that were not resident: misses, and prefetch reads used
        "needed_bytes_per_token": (t.misses + t.prefetch_used) * off.expert_bytes / len(counted),
        "prefetch_reads_per_token": r.prefetch_reads_per_token,
        "prefetch_reads_used": r.prefetch_reads_used,
        "cancelled_per_token": t.cancelled / len(counted),
        "read_gb_s": r.read_gb_s,
        "read_busy_s": stats.read_busy_s,
        "stall_s": t.stall_s,
        "check_s": stats.check_s,
        "method": r.read_method,
        "crc32": r.crc32_check,
        "peak_sampled": peak.peak,
        "peak_rss": peak_rss_bytes(),
        "pool_peak": off.pool.peak,
        "pool_n": off.pool.n,
    }
    logits_out.write_text(json.dumps(logits))
    return out


@torch.inference_mode()
def decode(model, off, n_tokens: int, warmup: int):
    """Prefill PROMPT, then one token per step from a fixed random sequence; counters
    from step `warmup` on. Returns (each step's greedy choice, a digest of its logits,
    seconds of each step, counters)."""
    from infer.runtime.session import Session

    vocab = model.args.vocab_size
    feed = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(SEED))
    session = Session(model)
    tokens, logits, step_s = [], [], []
    pos, ids, before = 0, PROMPT, None
    for i in range(n_tokens):
        if i == warmup:
            before = off.snapshot()
        t0 = time.perf_counter()
        out = session.forward(ids, pos)[-1]
        step_s.append(time.perf_counter() - t0)
        # a digest, not the logits: 0.6 MB a step would count against the budget
        logits.append(hashlib.sha256(out.numpy().tobytes()).hexdigest())
        tokens.append(int(out.argmax()))
        pos += len(ids)
        ids = [int(feed[i])]
    return tokens, logits, step_s, off.snapshot() - before


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------


def run_child(args, *child_args: str) -> dict:
    cmd = [sys.executable, __file__, str(args.dir), *child_args]
    cmd += ["--tokens", str(args.tokens), "--warmup", str(args.warmup)]
    return json_child(cmd, str(child_args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the model (made here if missing)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=40, help="tokens decoded, the first by prefill")
    p.add_argument("--warmup", type=int, default=8, help="tokens not counted (cache filling)")
    p.add_argument("--runs", default=DEFAULT_RUNS)
    p.add_argument("--repeat", type=int, default=1, help="rounds over --runs (medians shown)")
    p.add_argument("--delete", action="store_true", help="delete DIR at the end")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--logits", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "disk":
        print(json.dumps(disk_bandwidth(args.dir)))
        return
    if args.child == "make":  # in a child: the parent's peak RSS would pass to the runs
        make_model(args.dir, {**CONFIG, "num_hidden_layers": args.layers})
        print(json.dumps({}))
        return
    if args.child:
        out = child(args.dir, args.child, args.tokens, args.warmup, args.logits)
        print(json.dumps(out))
        return

    if not args.dir.exists():
        t0 = time.perf_counter()
        run_child(args, "--child", "make", "--layers", str(args.layers))
        print(f"made {args.dir} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    size = (args.dir / "model.safetensors").stat().st_size
    print(f"model {size / 1e9:.2f} GB", file=sys.stderr)
    tmp = args.dir.parent / f".{args.dir.name}-logits"
    tmp.mkdir(exist_ok=True)
    runs = args.runs.split(",")
    results: dict[str, list[dict]] = {run: [] for run in runs}
    try:
        for rnd in range(args.repeat):  # interleaved: each round sees the same minutes
            for run in runs:
                disk = [run_child(args, "--child", "disk")]
                digest = tmp / f"{run}.{rnd}.json"
                out = run_child(args, "--child", run, "--logits", str(digest))
                disk.append(run_child(args, "--child", "disk"))
                out["disk"] = max(disk, key=lambda d: d["gb_s"])
                out["digest"] = json.loads(digest.read_text())
                results[run].append(out)
                print(f"{run}: {json.dumps(out)}", file=sys.stderr)
        report(results)
    finally:
        if args.delete:
            shutil.rmtree(args.dir, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)


def figures(r: dict) -> dict:
    """One run's derived figures."""
    counted = r["step_s"][len(r["step_s"]) - r["counted_tokens"] :]
    wall = sum(counted)
    per_token = wall / len(counted)
    stall = r["stall_s"] / len(counted)
    io_s = r["needed_bytes_per_token"] / (r["disk"]["gb_s"] * 1e9)  # at the disk's rate
    return {
        "ceiling": 1 / io_s,
        "ceiling_all": r["disk"]["gb_s"] * 1e9 / r["bytes_per_token"],
        "tok_s": r["decode_tok_s"],
        "of_ceiling": r["decode_tok_s"] * io_s,
        "compute_ms": 1000 * (per_token - stall),
        "io_ms": 1000 * io_s,
        # the token's time against the longer of its compute and its reads: 100 % is
        # perfect overlap whichever bounds it
        "overlap": max(per_token - stall, io_s) / per_token,
        "busy": r["read_busy_s"] / wall,
        "stall_ms": 1000 * stall,
    }


def report(results: dict[str, list[dict]]) -> None:
    def med(xs):
        return statistics.median(xs)

    first = next(iter(results))
    naive = [r["decode_tok_s"] for r in results.get("naive", [])]
    rows = []
    for run, reps in results.items():
        f = [figures(r) for r in reps]
        r = reps[0]
        same = all(
            x["tokens"] == results[first][0]["tokens"]
            and x["digest"] == results[first][0]["digest"]
            for x in reps
        )
        peak = max(max(x["peak_sampled"], x["peak_rss"]) for x in reps)
        tok_s = [x["tok_s"] for x in f]
        rows.append(
            {
                "run": run,
                "cached": f"{r['slots']} ({100 * r['slots'] / r['experts_total']:.0f} %)",
                "hit rate": f"{med([x['hit_rate'] for x in reps]):.3f}",
                "precision / recall": (
                    f"{med([x['precision'] for x in reps]):.2f} / "
                    f"{med([x['recall'] for x in reps]):.2f}"
                ),
                "MB read / needed per token": (
                    f"{med([x['bytes_per_token'] for x in reps]) / 1e6:.0f} / "
                    f"{med([x['needed_bytes_per_token'] for x in reps]) / 1e6:.0f}"
                ),
                "disk GB/s": f"{med([x['disk']['gb_s'] for x in reps]):.2f}",
                "I/O ceiling tok/s": f"{med([x['ceiling'] for x in f]):.2f}",
                "tok/s": f"{med(tok_s):.2f}"
                + (f" ({min(tok_s):.2f}-{max(tok_s):.2f})" if len(reps) > 1 else ""),
                "of ceiling": f"{100 * med([x['of_ceiling'] for x in f]):.0f} %",
                "vs naive": f"{med(tok_s) / med(naive):.2f}x" if naive else "-",
                "compute / reads ms": (
                    f"{med([x['compute_ms'] for x in f]):.0f} / {med([x['io_ms'] for x in f]):.0f}"
                ),
                "overlap": f"{100 * med([x['overlap'] for x in f]):.0f} %",
                "disk busy": f"{100 * med([x['busy'] for x in f]):.0f} %",
                "stall ms/token": f"{med([x['stall_ms'] for x in f]):.0f}",
                "peak / budget": (
                    f"{peak / 1e9:.2f} / {r['budget'] / 1e9:.2f} GB"
                    if r["budget"]
                    else f"{peak / 1e9:.2f} GB"
                ),
                "same output": "yes" if same else "NO",
            }
        )
    headers = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row.get(h, "") for h in headers) + " |")
    for run, reps in results.items():
        for r in reps:
            depth = ", ".join(f"{k} {v:.2f}" for k, v in r["disk"]["by_depth"].items())
            print(f"{run}: disk GB/s by reads in flight: {depth}")


if __name__ == "__main__":
    main()
