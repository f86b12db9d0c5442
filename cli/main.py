"""The `infer` command: a thin shell over `infer.runtime`.

Commands parse options, call one library function, and print. torch and the
runtime are imported inside the commands so that `infer --help` stays instant.
Errors: `main()` turns an InferError into `error: <message>` on one line with its
exit code, a usage error (a bad option or argument) into one line and exit 2 unless
stderr is a terminal, anything else into one line and exit 1; --debug (or
INFER_DEBUG=1) adds the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from .. import InferError, __version__
from ..offload.budget import parse_size
from . import record_interrupts
from .common import (
    human_bytes,
    human_count,
    is_tty,
    print_json,
    print_table,
    set_threads,
    sigterm_unwinds,
    status,
    torch_dtype,
    utf8_arg,
    utf8_text,
)
from .embed_cmd import embed
from .eval_cmd import eval_model
from .options import (
    FLAG,
    SPECULATIVE,
    Debug,
    DType,
    DTypeOpt,
    ExpertPolicyOpt,
    ExpertPredictionOpt,
    Json,
    JsonList,
    KVCacheOpt,
    MaxMemory,
    ModelArg,
    RequiredModelArg,
    Threads,
    TraceOut,
)
from .ps_cmd import ps, stop
from .quantize_cmd import quantize
from .run_cmd import run
from .serve_cmd import serve
from .worker_cmd import worker

app = typer.Typer(
    name="infer",
    help="Run large language models locally, on the CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# ------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------


def _version(value: bool) -> None:
    if value:
        print(f"infer {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option(
            "--version", metavar=FLAG, callback=_version, is_eager=True, help="Print the version."
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """Run large language models locally, on the CPU."""


app.command()(run)
app.command()(embed)


@app.command()
def pull(
    model: RequiredModelArg,
    force: Annotated[
        bool, typer.Option("--force", metavar=FLAG, help="Fetch again even if cached.")
    ] = False,
    debug: Debug = False,
) -> None:
    """Download a model into the cache (progress on stderr); print its path."""
    from ..runtime.registry import pull as pull_model

    with sigterm_unwinds():  # a killed download removes its temporaries
        path = pull_model(model, force=force, progress=True).path
    print(path)


@app.command(name="list")
def list_models(
    all_models: Annotated[
        bool,
        typer.Option(
            "--all", "-a", metavar=FLAG, help="Every model of the registry, marking those on disk."
        ),
    ] = False,
    json_out: JsonList = False,
    debug: Debug = False,
) -> None:
    """List the models on disk (--all: every model one can run by name)."""
    from ..runtime.registry import list_cached, load_registry

    models = list_cached()
    if all_models:
        on_disk = {m.name for m in models}
        entries = list(load_registry().values())
        if json_out:
            print_json(
                [
                    {
                        "name": e.name,
                        "aliases": e.aliases,
                        "repo": e.repo,
                        "cached": e.name in on_disk,
                    }
                    for e in entries
                ]
            )
            return
        rows = [
            [e.name, ", ".join(e.aliases) or "-", e.repo, "yes" if e.name in on_disk else "-"]
            for e in entries
        ]
        print_table(["NAME", "ALIASES", "REPO", "ON DISK"], rows)
        return
    if json_out:
        print_json(
            [
                {
                    "name": m.name,
                    "size": m.size,
                    "format": m.format,
                    "quantization": m.quantization,
                    "path": str(m.path),
                }
                for m in models
            ]
        )
        return
    if not models:
        print(
            "no models yet: `infer pull <model>` fetches one (`infer list --all` names them)",
            file=sys.stderr,
        )
        return
    rows = [
        [m.name, human_bytes(m.size), m.format, m.quantization or "-", str(m.path)] for m in models
    ]
    print_table(["NAME", "SIZE", "FORMAT", "QUANT", "PATH"], rows)


@app.command()
def rm(model: RequiredModelArg, debug: Debug = False) -> None:
    """Delete a downloaded model from disk (our cache or the Hugging Face cache)."""
    from ..runtime.registry import remove_cached

    for path in remove_cached(model):
        print(f"removed {path}", file=sys.stderr)


@app.command()
def info(
    model: ModelArg = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            metavar=FLAG,
            help="Check the file's sha256 against the one recorded when it was fetched "
            "(exit 2 on a mismatch), instead of describing it.",
        ),
    ] = False,
    json_out: Json = False,
    debug: Debug = False,
) -> None:
    """Describe a model from its metadata, without loading its weights."""
    from ..runtime.files.model_file import open_model_file
    from ..runtime.registry import recorded_sha256, resolve
    from ..runtime.wheels import file_sha256

    resolved = resolve(model, download=False)
    if verify:
        expected = recorded_sha256(resolved)
        actual = file_sha256(resolved.path)
        if actual != expected:
            raise InferError(f"{resolved.path}: sha256 mismatch ({actual}, recorded {expected})")
        if json_out:
            print_json({"name": resolved.name, "path": str(resolved.path), "sha256": actual})
        else:
            print(f"{resolved.path}: sha256 ok ({actual})")
        return
    mi = open_model_file(resolved.path)  # its headers alone: no torch
    a = mi.args
    data = {
        "name": resolved.name,
        "architecture": a.model_type,
        "architectures": mi.config.get("architectures"),
        "parameters": a.n_params,
        "layers": a.n_layers,
        "hidden_size": a.dim,
        "intermediate_size": a.hidden_dim,
        "heads": a.n_heads,
        "kv_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "context_length": a.max_seq_len,
        "vocab_size": a.vocab_size,
        "rope_theta": a.rope_theta,
        "tied_embeddings": a.tie_embeddings,
        "experts": a.n_experts,
        "experts_per_token": a.n_experts_per_tok,
        "expert_intermediate_size": a.moe_hidden_dim,
        "shared_expert_intermediate_size": a.shared_expert_dim,
        "moe_layers": a.n_moe_layers,
        "active_parameters": a.n_active_params,
        "format": mi.format,
        "quantization": mi.quantization,
        "file_bytes": mi.file_bytes,
        "path": str(mi.path),
    }
    if json_out:
        print_json(data)
        return
    rows = [
        ["architecture", f"{a.model_type} ({', '.join(data['architectures'] or ['?'])})"],
        ["parameters", f"{human_count(a.n_params)} ({a.n_params:,})"],
        ["layers", str(a.n_layers)],
        ["hidden size", str(a.dim)],
        ["ffn size", str(a.hidden_dim)],
        ["heads / kv heads", f"{a.n_heads} / {a.n_kv_heads} (head dim {a.head_dim})"],
        ["context length", str(a.max_seq_len)],
        ["vocab", str(a.vocab_size)],
        ["rope theta", f"{a.rope_theta:g}"],
        ["tied embeddings", "yes" if a.tie_embeddings else "no"],
        *_expert_rows(a),
        ["format", mi.format],
        ["quantization", mi.quantization],
        ["on disk", f"{human_bytes(mi.file_bytes)} ({mi.file_bytes:,} bytes)"],
        ["path", str(mi.path)],
    ]
    print_table(None, rows, title=resolved.name if is_tty() else None)


def _expert_rows(a) -> list[list[str]]:
    """`infer info`'s mixture-of-experts lines (none for a dense model)."""
    if not a.n_experts:
        return []
    shared = f" + a shared expert of {a.shared_expert_dim}" if a.shared_expert_dim else ""
    return [
        ["experts", f"{a.n_experts} per MoE layer, {a.n_experts_per_tok} a token{shared}"],
        ["expert ffn size", str(a.moe_hidden_dim)],
        ["MoE layers", f"{a.n_moe_layers} of {a.n_layers}"],
        ["active parameters", f"{human_count(a.n_active_params)} ({a.n_active_params:,})"],
    ]


@app.command()
def bench(
    model: ModelArg = None,
    n_prompt: Annotated[
        int, typer.Option("--n-prompt", "-p", min=1, help="Prompt tokens to prefill.")
    ] = 128,
    n_gen: Annotated[int, typer.Option("--n-gen", "-n", min=1, help="Tokens to decode.")] = 64,
    repeats: Annotated[
        int, typer.Option("--repeats", "-r", min=1, help="Timed runs (the median is shown).")
    ] = 3,
    threads: Threads = None,
    dtype: DTypeOpt = DType.float32,
    kv_cache: KVCacheOpt = None,
    roofline: Annotated[
        bool,
        typer.Option(
            "--roofline",
            metavar=FLAG,
            help="Also measure memory read bandwidth, the decode ceiling it sets "
            "(bandwidth / weight bytes per token), and split decode time into linear "
            "layers vs the rest.",
        ),
    ] = False,
    parallel: Annotated[
        int,
        typer.Option(
            "--parallel",
            "-np",
            min=1,
            help="Also decode N sequences at once, one batched step a token for all (as "
            "`infer serve --parallel N` runs concurrent answers): their tokens a second "
            "in all, against one sequence's.",
        ),
    ] = 1,
    max_memory: MaxMemory = None,
    expert_policy: ExpertPolicyOpt = None,
    expert_prediction: ExpertPredictionOpt = None,
    trace: TraceOut = None,
    replay: Annotated[
        Path | None,
        typer.Option(
            "--replay",
            metavar="TRACE",
            help="Instead of running a model: replay a routing trace (run --trace) through "
            "each expert policy at 25/50/75 % of experts cached, with and without its "
            "predictions, and print hit rates, prefetch precision/recall and reads.",
            show_default=False,
        ),
    ] = None,
    lookup: Annotated[
        bool,
        typer.Option(
            "--lookup",
            metavar=FLAG,
            help="Measure speculative decoding by prompt lookup instead: acceptance, tokens "
            "per checking pass, and decode speed against plain decoding, in alternating "
            "rounds (-r) of a greedy answer of up to -n tokens to --prompt.",
            rich_help_panel=SPECULATIVE,
        ),
    ] = False,
    draft: Annotated[
        str | None,
        typer.Option(
            "--draft",
            metavar="DRAFT",
            help="The same as --lookup, the guesses from the model DRAFT.",
            show_default=False,
            rich_help_panel=SPECULATIVE,
        ),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option(
            "--prompt",
            metavar="TEXT",
            help="With --lookup or --draft: the chat prompt. Default: a copy task (check "
            "the spelling of a paragraph).",
            show_default=False,
            rich_help_panel=SPECULATIVE,
        ),
    ] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option(
            "--prompt-file",
            metavar="FILE",
            help="With --lookup or --draft: FILE's text follows --prompt after a blank line "
            "(as `infer run` reads stdin): e.g. --prompt 'Add docstrings' --prompt-file x.py.",
            show_default=False,
            rich_help_panel=SPECULATIVE,
        ),
    ] = None,
    json_out: Json = False,
    debug: Debug = False,
) -> None:
    """Measure load time, prefill and decode speed, memory and bandwidth.

    With --lookup or --draft: what speculative decoding gains."""
    from dataclasses import asdict

    if lookup or draft is not None:
        if replay or roofline or max_memory or trace or parallel > 1:
            raise InferError(
                "--lookup and --draft take none of --replay, --roofline, --max-memory, "
                "--trace, --parallel"
            )
        text = _bench_prompt(prompt, prompt_file)
        _speculative_bench(
            model, lookup, draft, text, n_gen, repeats, threads, dtype, kv_cache, json_out
        )
        return
    if prompt is not None or prompt_file is not None:
        raise InferError("--prompt and --prompt-file go with --lookup or --draft")
    if replay is not None:
        if model is not None:
            raise InferError("--replay takes a trace, not a model: drop MODEL")
        _replay(replay, json_out)
        return
    budget = parse_size(max_memory) if max_memory is not None else None
    from ..runtime.registry import resolve

    resolved = resolve(model)

    from ..runtime.bench import run_bench

    set_threads(threads)
    with status(f"benchmarking {resolved.name}"):
        result = run_bench(
            resolved.path,
            n_prompt=n_prompt,
            n_gen=n_gen,
            repeats=repeats,
            dtype=torch_dtype(dtype),
            name=resolved.name,
            roofline=roofline,
            max_memory=budget,
            expert_policy=expert_policy and expert_policy.value,
            trace=trace,
            expert_prediction=expert_prediction and expert_prediction.value,
            kv_cache=kv_cache and kv_cache.value,
            parallel=parallel,
        )
    if json_out:
        print_json(asdict(result))
        return
    print_table(["METRIC", "VALUE"], result.rows(), title=f"infer bench: {resolved.name}")


def _bench_prompt(prompt: str | None, path: Path | None) -> str | None:
    """--prompt, then a blank line and --prompt-file's text: the speculative bench's prompt."""
    text = utf8_arg(prompt, "--prompt")
    if path is not None:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InferError(f"--prompt-file {path}: cannot read it ({e.strerror})") from None
        text = "\n\n".join(p for p in (text, utf8_text(data, str(path)).rstrip()) if p)
    return text


def _speculative_bench(
    model, lookup, draft, text, n_gen, repeats, threads, dtype, kv_cache, json_out
):
    """bench --lookup / --draft: speculative against plain decoding."""
    if lookup and draft is not None:
        raise InferError("give --lookup or --draft, not both")
    from ..runtime.registry import resolve

    resolved = resolve(model)
    drafts = resolve(draft) if draft is not None else None
    from ..runtime.bench_speculative import COPY_TASK, run_speculative_bench

    set_threads(threads)
    with status(f"benchmarking {resolved.name}"):
        result = run_speculative_bench(
            resolved.path,
            lookup=lookup,
            draft=drafts and drafts.path,
            prompt=text or COPY_TASK,
            n_gen=n_gen,
            rounds=repeats,
            dtype=torch_dtype(dtype),
            name=resolved.name,
            draft_name=drafts and drafts.name,
            kv_cache=kv_cache and kv_cache.value,
        )
    if json_out:
        print_json(result.as_dict())
        return
    title = f"infer bench: {resolved.name}, speculative"
    print_table(["METRIC", "VALUE"], result.rows(), title=title)


def _replay(path: Path, json_out: bool) -> None:
    from ..offload.trace import Trace, compare

    trace = Trace.load(path)
    rows = compare(trace)
    if json_out:
        print_json({"trace": str(path), "tokens": trace.n_tokens, "rows": rows})
        return
    table = [
        [
            r["policy"],
            f"{100 * r['cached']:.0f} % ({sum(r['slots'])})",
            "yes" if r["prefetch"] else "no",
            f"{r['hit_rate']:.3f}",
            f"{r['precision']:.3f} / {r['recall']:.3f}" if r["prefetch"] else "-",
            f"{r['reads_per_token']:.2f}",
        ]
        for r in rows
    ]
    title = f"{path.name}: {trace.n_tokens} tokens, {trace.n_layers} MoE layers"
    headers = ["POLICY", "CACHED", "PREFETCH", "HIT RATE", "PRECISION / RECALL", "READS/TOKEN"]
    print_table(headers, table, title=title if is_tty() else None)


app.command("eval")(eval_model)
app.command()(quantize)
app.command()(serve)
app.command()(ps)
app.command()(stop)
app.command()(worker)


# ------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------


def _debug_requested(argv: list[str]) -> bool:
    """--debug anywhere before `--`, or INFER_DEBUG set to anything but 0."""
    args = argv[: argv.index("--")] if "--" in argv else argv
    return "--debug" in args or os.environ.get("INFER_DEBUG", "") not in ("", "0")


def _fail(err: BaseException, exit_code: int, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    message = " ".join(str(err).split())
    if not isinstance(err, InferError):
        message = f"{type(err).__name__}: {message}" if message else type(err).__name__
        if not debug:
            message += " (--debug shows the traceback)"
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


def main(interrupted: list | None = None) -> None:
    """Run the command line; `interrupted` (cli/__init__.py) records each Ctrl-C."""
    # torch's OpenMP workers otherwise spin after every op and take the cores our
    # kernels' thread pool needs, slowing decoding many times over.
    # Set before torch is imported (commands import it lazily); the user's value wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = sys.argv[1:]
    debug = _debug_requested(argv)
    # On a terminal, Typer reports usage errors itself (usage, hint, a box), as it shows
    # the help for a bare `infer`. Elsewhere they reach us, to read as one line.
    standalone = sys.stderr.isatty() or not argv
    interrupted = record_interrupts() if interrupted is None else interrupted
    try:
        code = app(prog_name="infer", standalone_mode=standalone)
    except typer.TyperException as err:  # click's errors; usage errors exit 2
        message = " ".join(err.format_message().split())
        print(f"error: {message[:1].lower()}{message[1:]}", file=sys.stderr)
        sys.exit(err.exit_code)
    except typer.Abort:  # click's name for Ctrl-C, among others
        if interrupted:
            sys.exit(130)
        print("error: aborted", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:  # noqa: BLE001  (anything unexpected: one line, exit 1)
        if interrupted and not debug:
            sys.exit(130)
        _fail(err, err.exit_code if isinstance(err, InferError) else 1, debug)
    # Not standalone, the app returns instead of exiting: the code of an Exit (--help).
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
