"""`infer quantize SRC -o DST --to FORMAT`: any model `infer run` accepts -> our format.

Registered by main.py. The work is three library calls: load the source as float
(`runtime.files.build`), swap its layers for quantized ones (`quant.quantize_model`, which
imports GGUF Q8_0/Q4_0/Q4_1 blocks losslessly where the format matches), and write
the checkpoint atomically (`runtime.checkpoint.save_checkpoint`). With --calibrate the
text is tokenized here and quantize_model quantizes by GPTQ on it (quant/gptq.py), or
with --train-blocks by Block-AP (quant/block_ap.py); with --tune too, it then trains the
scales end to end on that text (quant/tune.py).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from .. import InferError
from .common import (
    human_bytes,
    is_tty,
    print_json,
    print_table,
    set_threads,
    sigterm_unwinds,
    status,
)
from .options import FLAG, Debug, Json, RequiredModelArg, Threads

CALIB_CTX = 512  # tokens per calibration window (as `infer eval`'s default context)
LOW_BIT = {"lut2", "lut3"}  # formats that need calibration text to stay usable

Output = Annotated[
    Path, typer.Option("--output", "-o", help="Directory to write.", show_default=False)
]
To = Annotated[
    str,
    typer.Option(
        "--to",
        help="int8, int6 (Q6_K's layout), q5_k, int5 (Q5_0/Q5_1's), q4_k, iq4_xs, int4, q3_k, "
        "q2_k (GGUF's layouts), lut2, lut3, lut4, or a recipe: mixed (int8 attention, int4 MLP), q4_k_m, "
        "q3_k_m (like llama.cpp's Q4_K_M, Q3_K_M), lut3_m, lut2_m (Q3_K_M, Q2_K sizes in LUT "
        "formats).",
        show_default=False,
    ),
]
GroupSize = Annotated[
    int | None, typer.Option("--group-size", "-g", help="Weights per scale (32, 64, 128).")
]
Symmetric = Annotated[
    bool | None,
    typer.Option(
        "--symmetric/--asymmetric",
        metavar=FLAG,
        help="int4, int5: scale only (Q4_0-, Q5_0-like) or scale and min (Q4_1-, Q5_1-like; "
        "default).",
        show_default=False,
    ),
]
Force = Annotated[
    bool, typer.Option("--force", metavar=FLAG, help="Replace the --output directory if it exists.")
]
Calibrate = Annotated[
    Path | None,
    typer.Option(
        "--calibrate",
        help="A text file: quantize the linear layers by GPTQ, against their inputs on "
        "this text, instead of rounding each weight alone. Slower, more accurate.",
        exists=True,
        dir_okay=False,
        show_default=False,
    ),
]
Tune = Annotated[
    int,
    typer.Option(
        "--tune",
        min=0,
        help="With --calibrate: then train the quantized layers' scales for this many "
        "steps (1024 tokens each) so the model's outputs on the text match the original "
        "model's (end-to-end tuning; helps most at 2-3 bits). 0: off.",
    ),
]
TrainBlocks = Annotated[
    int,
    typer.Option(
        "--train-blocks",
        min=0,
        help="With --calibrate: after GPTQ, train each transformer block's weights and "
        "scales for this many passes over the text so it reproduces the original block "
        "(Block-AP; helps most at 2-3 bits; slow: minutes even for a small model). "
        "0: off.",
    ),
]
Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose", "-v", metavar=FLAG, help="Also print each tensor's format and error."
    ),
]
CalibTokens = Annotated[
    int,
    typer.Option(
        "--calib-tokens", min=1, help="Tokens of the --calibrate text to use, in windows of 512."
    ),
]


def quantize(
    src: RequiredModelArg,
    output: Output,
    to: To,
    group_size: GroupSize = None,
    symmetric: Symmetric = None,
    force: Force = False,
    calibrate: Calibrate = None,
    calib_tokens: CalibTokens = 8192,
    train_blocks: TrainBlocks = 0,
    tune: Tune = 0,
    threads: Threads = None,
    verbose: Verbose = False,
    json_out: Json = False,
    debug: Debug = False,
) -> None:
    """Quantize a model into infer's own format and report its error (-v: per tensor)."""
    if output.exists() and not force:
        raise InferError(f"{output} exists (use --force to replace it)")
    for flag, value in (("--train-blocks", train_blocks), ("--tune", tune)):
        if value and calibrate is None:
            raise InferError(f"{flag} trains on calibration text: give it with --calibrate FILE")

    from ..runtime.registry import resolve

    resolved = resolve(src)

    import torch

    from ..quant.formats.recipes import RECIPES, get_recipe
    from ..quant.quantize import dequantize_model, quantize_model
    from ..runtime.files.build import build
    from ..runtime.files.checkpoint import describe_source, save_checkpoint
    from ..runtime.files.sources import GGUFSource, open_source

    set_threads(threads)
    info = open_source(resolved.path)
    recipe = get_recipe(to, n_layers=info.args.n_layers, group_size=group_size, symmetric=symmetric)
    if calibrate is None and RECIPES[to][0]["format"] in LOW_BIT:
        # As llama-quantize asks for an importance matrix for its 2-bit types.
        print(
            f"warning: {to} rounded without --calibrate loses much of the model; "
            "--calibrate FILE quantizes by GPTQ, far more accurately",
            file=sys.stderr,
        )
    with status(f"loading {resolved.name}"):
        model = build(info, torch.float32, max_seq_len=1, dequantize=True)
        dequantize_model(model)  # a no-op unless SRC is itself quantized
        tokenizer = info.tokenizer()

    calibration = training = tuning = None
    if calibrate is not None:
        from ..quant.block_ap import BlockTraining
        from ..quant.gptq import calibration_windows
        from ..quant.tune import BATCH, WINDOW, Tuning, tuning_windows

        with status(f"tokenizing {calibrate}"):
            tokens = tokenizer.encode(
                calibrate.read_text(encoding="utf-8", errors="replace"), add_special=False
            )
        bos = tokenizer.bos_id if tokenizer.add_bos else None
        ctx = min(CALIB_CTX, info.args.max_seq_len)
        calibration = calibration_windows(tokens, calib_tokens, ctx, bos)
        if train_blocks:
            training = BlockTraining(train_blocks)
        if tune:
            windows = tuning_windows(tokens, tune, bos, min(WINDOW, info.args.max_seq_len))
            tuning = Tuning(windows, tune)

    losses: list[float] = []
    t0 = time.perf_counter()
    with _progress() as (advance, training_step, tuning_step):
        if training is not None:
            training.progress = training_step
        if tuning is not None:

            def step(done: int, total: int, loss: float | None) -> None:
                if loss is not None:
                    losses.append(loss)
                tuning_step(done, total, loss)

            tuning.progress = step
        gguf = info.gguf if isinstance(info, GGUFSource) else None  # blocks it may import
        reports = quantize_model(
            model, recipe, gguf=gguf, progress=advance, calibration=calibration,
            training=training, tuning=tuning,
        )  # fmt: skip
    seconds = time.perf_counter() - t0
    if tuning is not None and not losses:
        print("note: nothing to tune: every block layer was imported as it is", file=sys.stderr)
    tail = losses[-max(1, len(losses) // 10) :]  # the last tenth of the steps
    tune_summary = None
    if losses:
        tune_summary = {
            "steps": len(losses),
            "tokens": len(losses) * BATCH * tuning.windows.shape[1],
            "kl_first_step": losses[0],
            "kl_last_steps": sum(tail) / len(tail),
        }

    with status(f"writing {output}"), sigterm_unwinds():
        save_checkpoint(
            model,
            info.config,
            tokenizer,
            output,
            source=describe_source(info.path, info.format),
            force=force,
        )

    before = sum(r.bytes_before for r in reports)
    after = sum(r.bytes_after for r in reports)
    if json_out:
        print_json(
            {
                "source": str(info.path),
                "output": str(output),
                "recipe": to,
                "bytes_before": before,
                "bytes_after": after,
                "file_bytes_before": info.file_bytes,
                "seconds": seconds,
                "calibration": None
                if calibration is None
                else {
                    "file": str(calibrate),
                    "tokens": calibration.numel(),
                    "windows": calibration.shape[0],
                    "method": "gptq" if training is None else "block-ap",
                    "epochs": train_blocks or None,
                },
                "tuning": tune_summary,
                "tensors": [r.__dict__ for r in reports],
            }
        )
        return
    if verbose:
        _print_tensors(reports)
    if calibration is not None:
        method = "GPTQ" if training is None else f"Block-AP, {train_blocks} epochs,"
        print(
            f"{method} on {calibration.numel()} tokens of {calibrate} "
            f"({calibration.shape[0]} windows); quantized in {seconds:.0f} s"
        )
    if tune_summary is not None:
        print(
            f"tuned scales for {tune_summary['steps']} steps ({tune_summary['tokens']} tokens): "
            f"KL to the original on the calibration text {tune_summary['kl_first_step']:.4g} "
            f"-> {tune_summary['kl_last_steps']:.4g}"
        )
    _print_summary(to, reports, info.file_bytes, output)


def _print_summary(to: str, reports, file_bytes: int, output: Path) -> None:
    """Four lines: formats, sizes, the error, where it went."""
    formats = Counter(r.format for r in reports)
    counts = ", ".join(f"{n} {f}" for f, n in formats.most_common())
    kinds = to if set(formats) == {to} else f"{to} ({counts})"
    imported = sum(r.imported for r in reports)
    before = sum(r.bytes_before for r in reports)
    after = sum(r.bytes_after for r in reports)
    weights = sum(out * in_ for out, in_ in (r.shape for r in reports))
    print(
        f"{kinds}: {len(reports)} tensors quantized"
        + (f" ({imported} imported as they are)" if imported else "")
    )
    print(
        f"size: {human_bytes(before)} as float32 -> {human_bytes(after)}, "
        f"{8 * after / weights:.2f} bits per weight (source file {human_bytes(file_bytes)})"
    )
    worst = max(reports, key=lambda r: r.rel_rms_error)
    mean = sum(r.rel_rms_error for r in reports) / len(reports)
    print(f"relative RMS error: mean {mean:.4f}, worst {worst.rel_rms_error:.4f} ({worst.name})")
    print(f"wrote {output}")


def _print_tensors(reports) -> None:
    """One row per tensor: its format, its error, whether it was imported or trained."""
    headers = ["tensor", "format", "max abs err", "rel rms err", ""]
    rows = [
        [
            r.name,
            r.format + ("" if not r.params else " " + _params(r.params)),
            f"{r.max_abs_error:.3g}",
            f"{r.rel_rms_error:.4f}",
            "imported" if r.imported else ", ".join(_trained(r)),
        ]
        for r in reports
    ]
    if any(r.rel_output_error is not None for r in reports):
        # The error GPTQ minimizes: of the layer's outputs on the calibration text.
        headers.insert(4, "rel out err")
        for row, r in zip(rows, reports):
            row.insert(4, "" if r.rel_output_error is None else f"{r.rel_output_error:.4f}")
    print_table(headers, rows)


def _trained(r) -> list[str]:
    return [word for word, done in (("trained", r.trained), ("tuned", r.tuned)) if done]


def _params(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())


class _progress:
    """Rich progress bars on a terminal's stderr, over tensors, block training steps and
    tuning steps; silent otherwise. Gives the three callbacks (quantize_model's,
    block_ap's and tune's)."""

    def __enter__(self):
        if not is_tty():
            return (lambda *_: None), (lambda *_: None), (lambda *_: None)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.bar = Progress(
            TextColumn("{task.fields[name]:<43}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=Console(file=sys.stderr),
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("", total=None, name="")

        def advance(name: str, done: int, total: int) -> None:
            self.bar.update(self.task, completed=done, total=total, name=f"quantizing {name}")

        def trained(block: int, blocks: int, done: int, total: int, loss: float) -> None:
            name = f"training block {block + 1}/{blocks} (MSE {loss:.4g})"
            self.bar.update(self.task, completed=done, total=total, name=name)

        def tuned(done: int, total: int, loss: float | None) -> None:
            name = "original model on the text" if loss is None else f"tuning (KL {loss:.4f})"
            self.bar.update(self.task, completed=done, total=total, name=name)

        return advance, trained, tuned

    def __exit__(self, *exc):
        if hasattr(self, "bar"):
            self.bar.stop()
