"""`infer eval`: perplexity over a text file, and KL divergence from a reference model.

Registered by main.py as `app.command("eval")(eval_model)`. The numbers follow
llama.cpp's llama-perplexity (see infer.runtime.evaluate), so a quantization can be
compared with the figures llama.cpp users publish.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from .. import InferError
from ..offload.budget import parse_size
from .common import is_tty, print_json, print_table, set_threads, status, torch_dtype
from .options import (
    Debug,
    DType,
    DTypeOpt,
    Json,
    KVCacheOpt,
    MaxMemory,
    RequiredModelArg,
    Threads,
)

TextFile = Annotated[
    Path,
    typer.Option(
        "--text",
        "-f",
        help="The text to score (UTF-8), e.g. wikitext-2's wiki.test.raw.",
        show_default=False,
    ),
]
WindowCtx = Annotated[
    int,
    typer.Option(
        "--ctx",
        "-c",
        "--ctx-size",  # llama-perplexity's spelling
        min=4,
        help="Tokens per window; the second half is scored.",
    ),
]
Chunks = Annotated[
    int | None,
    typer.Option("--chunks", min=1, help="Score at most N windows. Default: the whole text."),
]
Ref = Annotated[
    str | None,
    typer.Option(
        "--ref",
        help="A reference model (e.g. the unquantized one): adds KL divergence, "
        "top-1 agreement and the PPL ratio. It runs with a float KV cache; MODEL itself as "
        "the reference is not loaded again, so with --kv-cache only the cache differs.",
        show_default=False,
    ),
]


def eval_model(
    model: RequiredModelArg,
    text: TextFile,
    ctx: WindowCtx = 512,
    chunks: Chunks = None,
    ref: Ref = None,
    threads: Threads = None,
    dtype: DTypeOpt = DType.float32,
    kv_cache: KVCacheOpt = None,
    max_memory: MaxMemory = None,
    json_out: Json = False,
    debug: Debug = False,
) -> None:
    """Measure perplexity over a text, as llama-perplexity does; with --ref, KL divergence.

    --max-memory budgets the whole process: with --ref, the reference is loaded second
    and its share is what the first model left.
    """
    budget = parse_size(max_memory) if max_memory is not None else None
    if not text.is_file():
        raise InferError(f"{text}: no such file")
    try:
        content = text.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InferError(f"{text}: not UTF-8 text ({e.reason} at byte {e.start})") from None

    from ..runtime.registry import resolve

    # Both names before torch is imported: a wrong one fails at once.
    resolved = resolve(model)
    resolved_ref = resolve(ref) if ref is not None else None

    from ..runtime.evaluate import evaluate
    from ..runtime.loader import load_model
    from ..runtime.model.kvcache import float_kind

    n_threads = set_threads(threads)
    compute_dtype = torch_dtype(dtype)
    kind = kv_cache and kv_cache.value
    with status(f"loading {resolved.name}"):
        lm = load_model(
            resolved.path, compute_dtype, max_seq_len=ctx, max_memory=budget, kv_cache=kind
        )
        ref_lm = None
        if ref and resolved_ref.path.resolve() == resolved.path.resolve():
            ref_lm = lm  # the same weights; evaluate gives the reference a float cache
        elif ref:
            # The reference is exact: a GGUF's blocks dequantized, not run on the kernels.
            ref_lm = load_model(
                resolved_ref.path, compute_dtype, max_seq_len=ctx, max_memory=budget,
                dequantize=True,
            )  # fmt: skip
    with _progress_bar() as progress:
        result = evaluate(lm, content, ctx=ctx, chunks=chunks, ref=ref_lm, progress=progress)

    kv = kind or float_kind(compute_dtype)
    run = {"text": str(text), "dtype": dtype.value, "kv_cache": kv, "threads": n_threads}
    models = {"model": _about(resolved.name, lm)}
    if ref_lm is not None:
        models["ref"] = _about(resolved_ref.name, ref_lm)
    if json_out:
        data = asdict(result)
        for key, about in models.items():
            data[key] = {**about, **data[key]}
        print_json({**run, **data})
    else:
        _print_result(result, models, run)


def _about(name: str, lm) -> dict:
    return {"name": name, "quantization": lm.source.quantization}


@contextmanager
def _progress_bar():
    """Yield a (done, total) callback drawing a bar on stderr on a terminal; else None."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = ("windows", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as p:
        task = p.add_task("eval", total=None)
        yield lambda done, total: p.update(task, completed=done, total=total)


def _print_result(r, models: dict, run: dict) -> None:

    m = r.model
    model = models["model"]
    rows = [
        ["model", f"{model['name']} ({model['quantization']}, {run['dtype']})"],
        ["KV cache", run["kv_cache"]],
        ["text", f"{Path(run['text']).name} ({r.text_tokens:,} tokens)"],
        ["windows", f"{r.windows} x {r.ctx} ({r.tokens_scored:,} tokens scored)"],
        ["PPL", f"{m.ppl:.4f} ± {m.ppl_se:.4f}"],
        ["time", f"{m.seconds:.1f} s ({m.tokens_per_s:.0f} tok/s, {run['threads']} threads)"],
    ]
    if r.ref is not None:
        d = r.divergence
        ref = models["ref"]
        rows += [
            ["reference", f"{ref['name']} ({ref['quantization']})"],
            ["reference PPL", f"{r.ref.ppl:.4f} ± {r.ref.ppl_se:.4f}"],
            ["PPL ratio", f"{d.ppl_ratio:.4f} ± {d.ppl_ratio_se:.4f}"],
            ["PPL diff", f"{d.ppl_diff:+.4f} ± {d.ppl_diff_se:.4f}"],
            ["mean KLD", f"{d.kl_mean:.6f} ± {d.kl_se:.6f}"],
            ["median KLD", f"{d.kl_median:.6f}"],
            ["99% KLD", f"{d.kl_p99:.6f}"],
            ["max KLD", f"{d.kl_max:.6f}"],
            ["same top-1", f"{d.top1_agreement:.2f} ± {d.top1_se:.2f} %"],
            ["reference time", f"{r.ref.seconds:.1f} s ({r.ref.tokens_per_s:.0f} tok/s)"],
        ]
    print_table(["METRIC", "VALUE"], rows, title="infer eval" if is_tty() else None)
