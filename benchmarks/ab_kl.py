"""How far apart two builds of the C extension answer: the KL divergence between their
logits on a model over a text, both builds in one process (ab_extension.py's loading).
For a kernel change that is not meant to be exact (benchmarks/README.md, "One digit for
prompts only").

    python benchmarks/ab_kl.py OTHER.so MODEL --text ../shared/data/wikitext-2-test.txt \
        [--ctx 512] [--chunks 8]

Each window of --ctx tokens runs through both builds; the second half of each is scored,
as `infer eval` scores: KL(this build || the other), ± its standard error, and how often
their top tokens agree.
"""

from __future__ import annotations

import argparse

import torch
from ab_extension import load_other, use  # benchmarks/

from infer.kernels_cpu import ops
from infer.runtime.loader import load_model
from infer.runtime.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", help="the other build's kernels_cpu/_C*.so")
    ap.add_argument("model")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()

    lm = load_model(args.model, max_seq_len=args.ctx)
    with open(args.text, encoding="utf-8") as f:
        ids = lm.tokenizer.encode(f.read())
    builds = {"this": ops._C, "other": load_other(args.other)}
    kls, agree = [], []
    for c in range(args.chunks):
        window = ids[c * args.ctx : (c + 1) * args.ctx]
        logp = {}
        for name, module in builds.items():
            use(module)
            logits = Session(lm.model, args.ctx).forward(window, 0, all_logits=True)
            logp[name] = torch.log_softmax(logits.float(), -1)[args.ctx // 2 :]
        p, q = logp["this"], logp["other"]
        kls.append((p.exp() * (p - q)).sum(-1))
        agree.append(p.argmax(-1) == q.argmax(-1))
    kl, same = torch.cat(kls), torch.cat(agree).float()
    se = kl.std() / kl.numel() ** 0.5
    print(f"KL(this || other) {kl.mean():.6f} ± {se:.6f}, same top-1 {100 * same.mean():.2f} %")


if __name__ == "__main__":
    main()
