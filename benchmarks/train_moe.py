"""Train a small Qwen3-MoE on tinyshakespeare, so expert routing is learned, not random.

    python benchmarks/train_moe.py [--out /tmp/moe-shakespeare] [--steps 2000] [--threads 1]

No real MoE checkpoint can be fetched on these machines, and random routers do not route
like trained ones (a random router's choices carry no structure a cache or a predictor can
use). This model is what the routing figures (benchmarks/moe_routing.py) are measured on.

- Layout: Qwen3-MoE (transformers' Qwen3MoeForCausalLM is the trainer): 6 layers, hidden
  128, 32 experts of intermediate 64, top-4 with normalised top-k weights (an eighth of the
  experts per token, as Qwen3-30B-A3B's 8 of 128 is a sixteenth), q/k norms, untied
  embeddings. Every layer is an MoE layer. 10 to 15 minutes on one shared thread.
  `--layers 12 --steps 1200` (27 minutes here, the machine busy) routes more predictably:
  a layer changes the residual stream less when there are more of them, which is what
  cross-layer prediction relies on (benchmarks/README.md has both models' figures).
- Loss: next-byte cross entropy plus Qwen3-MoE's Switch-style load-balancing aux loss
  (`router_aux_loss_coef` * num_experts * sum_e f_e * P_e), so experts share the load.
- Tokenizer: byte level, no merges (tests/tiny.py `write_tokenizer`): one token per byte.
- Data: the first 90% of tinyshakespeare trains; the last 10% is held out (moe_routing.py
  reads routing traces over it). Random windows of --seq tokens, batches of --batch.
- Deterministic: one seed for the init and one torch.Generator for the batches; one
  thread by default (the machine is shared), so a rerun writes the same weights.
- Saved in Hugging Face format with the standard per-expert names
  `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` (transformers 5 stacks experts
  as `gate_up_proj` / `down_proj`; they are split on save), config.json with model_type
  "qwen3_moe", tokenizer.json and tokenizer_config.json. Files are written under a temp
  directory renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny import VOCAB, write_tokenizer

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
HELD_OUT = 0.1  # the last 10% of the text is never trained on

CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 512,  # unused: every layer is sparse
    "moe_intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.01,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": 2,
}


def split_text(path: Path = DATA) -> tuple[str, str]:
    """(train, held-out) text of tinyshakespeare, split at a line boundary near 90%."""
    text = path.read_text(encoding="utf-8")
    cut = text.index("\n", int(len(text) * (1 - HELD_OUT))) + 1
    return text[:cut], text[cut:]


def encode(text: str) -> torch.Tensor:
    """Token ids of `text` under the byte-level tokenizer the model is saved with."""
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d))
        tok = Tokenizer.from_file(str(Path(d) / "tokenizer.json"))
    return torch.tensor(tok.encode(text).ids, dtype=torch.long)


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under the standard per-expert names, contiguous, float32."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2*I, H): gate rows, then up rows
            prefix = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # (E, H, I)
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def save(model, config: dict, out: Path, meta: dict) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = dict(config, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    cfg["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(tmp)
    (tmp / "training.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


@torch.no_grad()
def check_saved(model, out: Path, ids: torch.Tensor) -> None:
    """Reload `out` through transformers and require the same logits as the trained model."""
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    a, b = model(input_ids=ids[None]).logits, loaded(input_ids=ids[None]).logits
    if not torch.equal(a, b):
        raise SystemExit(f"saved model differs from the trained one: {(a - b).abs().max():.3g}")


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, n: int = 8) -> float:
    """Mean next-token loss over n fixed windows of the held-out text."""
    starts = torch.linspace(0, len(data) - seq - 2, n).long()
    x = torch.stack([data[s : s + seq] for s in starts])
    y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe-shakespeare"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    ap.add_argument("--experts", type=int, default=CONFIG["num_experts"])
    ap.add_argument("--top-k", type=int, default=CONFIG["num_experts_per_tok"])
    ap.add_argument("--expert-size", type=int, default=CONFIG["moe_intermediate_size"])
    args = ap.parse_args()

    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = dict(
        CONFIG,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size,
    )
    config = transformers.Qwen3MoeConfig(**cfg)
    model = transformers.Qwen3MoeForCausalLM(config).float().train()

    train_text, held_text = split_text()
    train, held = encode(train_text), encode(held_text)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters, {len(train)} train / {len(held)} held-out tokens")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + args.seq] for s in starts])
        y = torch.stack([train[s + 1 : s + args.seq + 1] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        loss = ce + config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            dt = time.perf_counter() - t0
            print(
                f"step {step:5d}  ce {ce.item():.3f}  aux {out.aux_loss.item():.3f}  "
                f"lr {lr_at(step):.2e}  {dt:.0f}s",
                flush=True,
            )

    model.eval()
    held_loss = evaluate(model, held, args.seq)
    train_loss = evaluate(model, train, args.seq)
    print(f"final: train loss {train_loss:.3f}, held-out loss {held_loss:.3f} (nats/byte)")
    meta = dict(
        vars(args),
        out=str(args.out),
        train_loss=train_loss,
        held_out_loss=held_loss,
        seconds=time.perf_counter() - t0,
    )
    save(model, cfg, args.out, meta)
    check_saved(model, args.out, held[:256])
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
