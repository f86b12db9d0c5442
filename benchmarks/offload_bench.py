"""Decode a model 3x larger than its memory budget, streaming layers from disk.

    python benchmarks/offload_bench.py DIR [--budget-fraction 0.33] [--tokens 6]

DIR is made on first use: random weights in Llama-2-7B's shape (dim 4096, 32 layers,
32 heads, ffn 11008, vocab 32000) as int4 (symmetric, group 32: GGUF Q4_0's layout),
written in infer's format by `save_checkpoint`, 3.7 GB. Speed depends on shapes and
bytes, not on trained values. Then, each in a fresh process (clean peak figures) with
the model file's pages dropped from the page cache first (posix_fadvise DONTNEED, no
root needed):

  resident   load_model without a budget: everything mapped (the reference outputs)
  stream     --max-memory = fraction x file size: pinned layers + sliding window,
             each unit's crc32 checked on its first read (the default)
  always     the same, crc32 checked on every read
  naive      load-on-demand, same budget: each layer read when needed into one buffer,
             no read-ahead, nothing pinned or kept (crc32 on first read, as stream)

Each streamed run also measures the disk, in its own process right after loading and
right after decoding: the streamed layers read once with O_DIRECT, 4 reads in flight,
into the stream's own buffers. The faster of the two is that run's disk bandwidth: the
shared virtual disk here moves between 0.6 and 2.9 GB/s from minute to minute, so each
run is held against the disk of its own minutes, read the way the stream reads.

For each: decode tok/s (greedy, after prefill and one token), the I/O ceiling
(disk GB/s / bytes read per token), tok/s / ceiling, the stream's own read rate and the
share of the run with a read in flight ("disk busy": how well reads overlap compute,
whatever the disk's speed that minute), speedup over naive, the peak
footprint (RSS + the model file's cached pages not in RSS, sampled every 50 ms, and
the peak RSS; the disk measurements are left out) against the budget, and whether the generated tokens and every step's logits
equal the resident run's (decoded block by block, as a streamed model decodes; the fused
C decode step of the resident model differs from it by rounding, ~1e-6, also shown).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MODES = ("resident", "stream", "always", "naive")

# Llama-2-7B's config.json, the numbers that matter.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT = [1, 450, 4955, 310, 20602, 338, 263, 5828]  # token ids: any will do


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------


def byte_tokenizer(path: Path):
    """A byte-level BPE tokenizer with no merges (the model's ids beyond it never print)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from infer.runtime.model.tokenizer import Tokenizer as InferTokenizer

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {ch: i + len(specials) for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({s: i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return InferTokenizer.from_hf_dir(path)


def random_int4(out_features: int, in_features: int, gen: torch.Generator):
    """An int4 (Q4_0 layout) layer of random codes; w = (q - 8) * d has std ~0.02."""
    from infer.quant.formats.int4 import Int4Linear

    q = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=gen)
    d = torch.full((out_features, in_features // 32), 0.02 / 4.6, dtype=torch.float16)
    return Int4Linear.from_tensors(
        {"qweight": q, "scales": d}, {"group_size": 32, "symmetric": True}
    )


def write_random_model(dest: Path, config: dict, linear, embedding) -> None:
    """A model in `config`'s shape written in infer's format at `dest`: each nn.Linear
    replaced by `linear(name, module)` (in named_modules order), the embedding by
    QuantEmbedding(`embedding(args)`), norms all ones; a byte-level tokenizer beside it.
    Shared with moe_offload_bench.py."""
    from torch import nn

    from infer.quant.formats.base import QuantEmbedding, QuantLinear
    from infer.runtime.files.checkpoint import save_checkpoint
    from infer.runtime.model.config import ModelArgs
    from infer.runtime.model.llama import Transformer

    args = ModelArgs.from_dict(config)
    with torch.device("meta"):
        model = Transformer(args)
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear):
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, child, linear(name, m))
    model.embed_tokens = QuantEmbedding(embedding(args))
    for m in model.modules():
        if not isinstance(m, (QuantLinear, nn.Linear)) and getattr(m, "weight", None) is not None:
            m.weight = nn.Parameter(torch.ones(m.weight.shape), requires_grad=False)  # norms
    tokenizer = byte_tokenizer(dest.parent / f".{dest.name}-tokenizer")
    source = {"path": "random", "sha256": {}, "format": "random"}
    save_checkpoint(model, config, tokenizer, dest, source=source)


def make_model(dest: Path, config: dict, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    write_random_model(
        dest,
        config,
        lambda name, m: random_int4(m.out_features, m.in_features, gen),
        lambda args: random_int4(args.vocab_size, args.dim, gen),
    )


# ------------------------------------------------------------------------------------------
# One measurement, in a child process
# ------------------------------------------------------------------------------------------


def drop_cache(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_rate(ckpt, units: list[str], bufs: list) -> tuple[float, str]:
    """(GB/s, the reader's method) reading `units` once with O_DIRECT (where the file
    system takes it), one read in flight per buffer, the page cache dropped first.
    Shared with moe_offload_bench.py."""
    from infer.offload.reader import UnitReader

    drop_cache(ckpt.file)
    depth = len(bufs)
    with UnitReader(ckpt.file, ckpt.ranges, None, workers=depth) as reader:
        t0 = time.perf_counter()
        tickets = [reader.submit(u, bufs[i]) for i, u in enumerate(units[:depth])]
        for i in range(len(units)):
            tickets[i].wait()
            if i + depth < len(units):
                tickets.append(reader.submit(units[i + depth], bufs[i % depth]))
        seconds = time.perf_counter() - t0
        method = reader.method
    return sum(ckpt.ranges[u][1] - ckpt.ranges[u][0] for u in units) / seconds / 1e9, method


def reset_peak_rss() -> None:
    """Linux: the peak RSS (VmHWM) starts again from the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # then the figure is the peak since the process started: an overestimate


def child(path: Path, mode: str, budget: int, n_tokens: int, logits_out: Path) -> dict:
    """Load in `mode`, greedy-decode `n_tokens` after PROMPT, time it, measure the peak.

    Streamed modes also measure the disk in this process, right after loading and right
    after decoding: the streamed layers read once, 4 reads in flight, into the stream's
    own buffers (naive has one; three more are made, outside the measured peak)."""
    from infer.offload.footprint import PeakSampler
    from infer.offload.reader import alloc_buffer
    from infer.offload.stream import load_streamed, process_rss
    from infer.runtime.bench import peak_rss_bytes
    from infer.runtime.files.checkpoint import read_checkpoint
    from infer.runtime.loader import load_model

    torch.set_num_threads(2)
    file = path / "model.safetensors"
    drop_cache(file)
    ctx = len(PROMPT) + n_tokens + 2
    ckpt = read_checkpoint(path)
    plan = stream = None
    with PeakSampler(file) as load_peak:
        t0 = time.perf_counter()
        if mode == "resident":
            model = load_model(path, torch.float32, ctx).model
        else:
            model, stream, plan = load_streamed(
                ckpt,
                torch.float32,
                ctx,
                budget,
                process_bytes=process_rss(),
                prefetch=mode != "naive",
                check="always" if mode == "always" else "first",
            )
        load_s = time.perf_counter() - t0
    if mode != "resident" and stream is None:
        sys.exit(f"the whole model fits in {budget} bytes: nothing to stream (lower the budget)")
    peak = max(load_peak.peak, peak_rss_bytes())
    disk = []
    if stream is not None:
        units = list(plan.streamed)
        extra = [alloc_buffer(plan.slot_bytes) for _ in range(4 - len(stream.slots))]
        disk.append(read_rate(ckpt, units, [*stream.slots, *extra])[0])
        del extra
        reset_peak_rss()
    with PeakSampler(file) as decode_peak:
        tokens, logits, step_s = decode(model, n_tokens)
        stats = stream.snapshot() if stream is not None else None
    peak = max(peak, decode_peak.peak, peak_rss_bytes())
    out = {
        "mode": mode,
        "load_s": load_s,
        "tokens": tokens,
        "decode_tok_s": (n_tokens - 1) / sum(step_s[1:]),
        "step_s": step_s,
        "peak": peak,
    }
    if mode == "resident":
        # The same decode block by block (no fused C step), as a streamed model runs.
        fused_logits = logits
        tokens2, logits, _ = decode(model, n_tokens, fused=False)
        out["fused_vs_blocks_max_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(fused_logits, logits)
        )
        out["blocks_same_tokens"] = tokens2 == tokens
    else:
        stream.close()  # reads in flight finish: the buffers are free again
        extra = [alloc_buffer(plan.slot_bytes) for _ in range(4 - len(stream.slots))]
        disk.append(read_rate(ckpt, list(plan.streamed), [*stream.slots, *extra])[0])
        out |= {
            "disk_gb_s": disk,
            "budget": budget,
            "planned": plan.footprint,
            "pinned": len(plan.pinned),
            "streamed": len(plan.streamed),
            "window": plan.window,
            "streamed_bytes": plan.streamed_bytes,
            "bytes_per_pass": stats.bytes_per_pass,
            "read_gb_s": stats.read_gb_s,
            "read_busy_s": stats.read_busy_s,
            "stall_s": stats.stall_s,
            "check_s": stats.check_s,
            "passes": stats.passes,
            "method": stream.reader.method,
        }
    save_file({"logits": torch.stack(logits)}, logits_out)  # (steps, vocab); no pickles
    return out


@torch.inference_mode()
def decode(model, n_tokens: int, fused: bool = True):
    """Greedy: prefill PROMPT, then n_tokens - 1 single-token steps. Returns (tokens,
    logits of each step, seconds of each step; step 0 is the prefill)."""
    from infer.runtime.session import Session

    session = Session(model)
    if not fused:
        session.fused = None
    tokens, logits, step_s = [], [], []
    pos, ids = 0, PROMPT
    for _ in range(n_tokens):
        t0 = time.perf_counter()
        out = session.forward(ids, pos)[-1]
        step_s.append(time.perf_counter() - t0)
        logits.append(out.clone())
        pos += len(ids)
        ids = [int(out.argmax())]
        tokens.append(ids[0])
    return tokens, logits, step_s


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------


def load_logits(path: Path) -> torch.Tensor:
    """(steps, vocab): each decode step's logits, as the child saved them."""
    return load_file(path)["logits"]


def json_child(cmd: list[str], what: str) -> dict:
    """Run one measurement in a fresh process (OpenMP threads passive) and return the
    JSON object its last line of stdout holds; exit with its stderr if it failed.
    Shared with moe_offload_bench.py."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"{what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(args, mode: str, budget: int, logits_out: Path) -> dict:
    cmd = [sys.executable, __file__, str(args.dir), "--child", mode, "--budget", str(budget)]
    cmd += ["--tokens", str(args.tokens), "--logits", str(logits_out)]
    return json_child(cmd, mode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the model (made here if missing)")
    p.add_argument("--budget-fraction", type=float, default=1 / 3)
    p.add_argument("--tokens", type=int, default=6, help="greedy tokens (the first by prefill)")
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--logits", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.dir, args.child, args.budget, args.tokens, args.logits)))
        return

    if not args.dir.exists():
        t0 = time.perf_counter()
        make_model(args.dir, {**CONFIG, "num_hidden_layers": args.layers})
        print(f"made {args.dir} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    file = args.dir / "model.safetensors"
    size = file.stat().st_size
    budget = int(size * args.budget_fraction)
    print(f"model {size / 1e9:.2f} GB, budget {budget / 1e9:.2f} GB", file=sys.stderr)

    tmp = args.dir.parent / f".{args.dir.name}-logits"
    tmp.mkdir(exist_ok=True)
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_child(args, mode, budget, tmp / f"{mode}.safetensors")
        print(f"{mode}: {json.dumps(results[mode])}", file=sys.stderr)
    report(results, size, budget, tmp)


def report(results: dict, size: int, budget: int, tmp: Path) -> None:
    ref = load_logits(tmp / "resident.safetensors") if "resident" in results else None
    naive = results.get("naive", {}).get("decode_tok_s")
    rows = []
    for mode, r in results.items():
        peak = r["peak"]
        row = {
            "mode": mode,
            "tok/s": f"{r['decode_tok_s']:.3f}",
            "MB read/token": "-",
            "I/O ceiling tok/s": "-",
            "of ceiling": "-",
            "vs naive": f"{r['decode_tok_s'] / naive:.2f}x" if naive else "-",
            "peak footprint": f"{peak / 1e9:.2f} GB",
            "of budget": "-",
            "same as resident": "-",
        }
        if mode != "resident":
            per_token = r["bytes_per_pass"]
            disk = max(r["disk_gb_s"])
            ceiling = disk * 1e9 / per_token
            row |= {
                "disk GB/s": "/".join(f"{g:.2f}" for g in r["disk_gb_s"]),
                "stream GB/s": f"{r['read_gb_s']:.2f}",
                "disk busy": f"{100 * r['read_busy_s'] / sum(r['step_s']):.0f} %",
                "MB read/token": f"{per_token / 1e6:.0f}",
                "I/O ceiling tok/s": f"{ceiling:.3f}",
                "of ceiling": f"{100 * r['decode_tok_s'] / ceiling:.0f} %",
                "of budget": f"{100 * peak / budget:.0f} %",
                "layers": f"{r['pinned']} pinned, {r['streamed']} streamed, w={r['window']}",
            }
            if ref is not None:
                got = load_logits(tmp / f"{mode}.safetensors")
                same = r["tokens"] == results["resident"]["tokens"] and all(
                    torch.equal(a, b) for a, b in zip(ref, got)
                )
                row["same as resident"] = "yes (tokens, logits)" if same else "NO"
        rows.append(row)
    headers = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row.get(h, "") for h in headers) + " |")
    print(f"\nmodel {size / 1e9:.2f} GB, budget {budget / 1e9:.2f} GB")
    if "resident" in results:
        r = results["resident"]
        print(
            f"resident: fused C decode vs block by block, max |logit diff| "
            f"{r['fused_vs_blocks_max_diff']:.2e}, same tokens: {r['blocks_same_tokens']}"
        )


if __name__ == "__main__":
    main()
