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
import shlex
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
    quiet_broken_pipe,
    read_format,
    set_threads,
    sigterm_unwinds,
    status,
    torch_dtype,
    utf8_arg,
    utf8_text,
)
from .eval_cmd import eval_model
from .options import (
    FLAG,
    Ctx,
    Debug,
    DType,
    DTypeOpt,
    ExpertPolicyOpt,
    ExpertPredictionOpt,
    Format,
    Json,
    JsonList,
    MaxMemory,
    MaxTokens,
    MinP,
    ModelArg,
    RepeatPenalty,
    RequiredModelArg,
    Seed,
    Temperature,
    Threads,
    TopK,
    TopP,
    TraceOut,
    Verbose,
)
from .quantize_cmd import quantize
from .serve_cmd import serve

app = typer.Typer(
    name="infer",
    help="Run large language models locally, on the CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

DEFAULT_CTX = 4096


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def _save_trace(lm, path) -> None:
    """Write the routing trace a run recorded (--trace), if it recorded any."""
    if path is not None and lm.routing is not None and lm.routing.tokens:
        lm.routing.trace().save(path)
        print(f"trace: {lm.routing.tokens} tokens routed, saved to {path}", file=sys.stderr)


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


def _prompt_in_place_of_model(model: str | None) -> None:
    """With no prompt, MODEL may be a prompt given alone: say so rather than "empty
    prompt" (it is never taken as one: MODEL is always a model)."""
    from ..runtime.registry import DEFAULT_MODEL, names_a_model

    if model is None or names_a_model(model):
        return
    raise InferError(
        f"no model named {model!r}: MODEL comes before PROMPT "
        f"(infer run {DEFAULT_MODEL} {shlex.quote(model)})"
    )


@app.command()
@quiet_broken_pipe()
def run(
    model: ModelArg = None,
    prompt: Annotated[
        str | None,
        typer.Argument(
            help="The prompt. Without it: chat on a terminal, or read the prompt from stdin.",
            metavar="PROMPT",
            show_default=False,
        ),
    ] = None,
    prompt_option: Annotated[
        str | None,
        typer.Option(
            "--prompt",
            "-p",
            help="The prompt, as llama.cpp takes it (instead of PROMPT).",
            show_default=False,
        ),
    ] = None,
    max_tokens: MaxTokens = 512,
    temperature: Temperature = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepeatPenalty = 1.0,
    seed: Seed = None,
    system: Annotated[
        str | None, typer.Option("--system", help="System message for the chat template.")
    ] = None,
    no_chat: Annotated[
        bool,
        typer.Option(
            "--no-chat", metavar=FLAG, help="Complete the prompt as raw text, no chat template."
        ),
    ] = False,
    threads: Threads = None,
    ctx: Ctx = None,
    dtype: DTypeOpt = DType.float32,
    max_memory: MaxMemory = None,
    expert_policy: ExpertPolicyOpt = None,
    expert_prediction: ExpertPredictionOpt = None,
    trace: TraceOut = None,
    fmt: Format = None,
    json_out: Json = False,
    verbose: Verbose = False,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            metavar=FLAG,
            help="Load the model in this process even when a server is running. "
            "Implied by --threads, --dtype, --max-memory, --trace and --expert-*.",
        ),
    ] = False,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            metavar="HOST:PORT",
            help="The `infer serve` to ask (or INFER_HOST). Default: 127.0.0.1:11435, "
            "if one runs there.",
            show_default=False,
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """Answer a prompt, or chat when run on a terminal without one.

    The prompt is PROMPT, or stdin when it is piped, or PROMPT, a blank line and
    stdin when both are given. Only the answer goes to stdout. When `infer serve`
    runs, a prompt is answered by it (the model stays loaded there).
    """
    if prompt is not None and prompt_option is not None:
        raise InferError("give the prompt once: as PROMPT or with --prompt, not both")
    prompt = prompt if prompt_option is None else prompt_option
    prompt, system = utf8_arg(prompt, "PROMPT"), utf8_arg(system, "--system")
    interactive = prompt is None and sys.stdin.isatty()
    if not interactive:
        piped = None if sys.stdin.isatty() else utf8_text(sys.stdin.buffer.read(), "stdin")
        piped = piped and piped.replace("\r\n", "\n").rstrip()  # as text mode read it
        prompt = "\n\n".join(p for p in (prompt, piped) if p)
        if not prompt.strip():
            _prompt_in_place_of_model(model)
            raise InferError("empty prompt (give PROMPT or pipe text to stdin)")
    if no_chat and system:
        raise InferError("--system needs the chat template; drop --no-chat")
    if interactive and json_out:
        raise InferError("--json needs a prompt: give PROMPT or pipe text to stdin")
    if interactive and fmt is not None:
        raise InferError("--format needs a prompt: give PROMPT or pipe text to stdin")
    schema = read_format(fmt)  # a bad file fails before the model loads

    budget = parse_size(max_memory) if max_memory is not None else None
    from .chat import ChatSettings, LocalModel, chat_loop

    settings = ChatSettings(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, seed=seed, repeat_penalty=repeat_penalty, system=system,
        verbose=verbose, format=schema,
    )  # fmt: skip
    show = (lambda _: None) if json_out else _write
    loads_here = (
        threads, max_memory, expert_policy, expert_prediction, trace
    ) != (None,) * 5 or dtype != DType.float32  # fmt: skip
    chat_model = None if local or loads_here else _server_model(host, model, ctx, interactive)
    if chat_model is not None and not interactive:
        from .client import NotServed

        try:
            answer = _answer_once(chat_model, prompt, no_chat, settings, show)
        except NotServed:
            chat_model = None  # a file the server may not read: load it here
            if verbose:
                print("note: the server does not serve this file; loading it here", file=sys.stderr)
        else:
            _finish(answer, chat_model, answer.load_s, json_out, verbose)
            return
    lm = None
    if chat_model is None:
        from ..runtime.registry import resolve

        with sigterm_unwinds():  # before importing torch: a wrong name fails at once
            resolved = resolve(model)
        n_threads = set_threads(threads)
        with status(f"loading {resolved.name}"):
            lm = _load_here(resolved, dtype, ctx, budget, expert_policy, expert_prediction, trace)
        if verbose:
            print(
                f"loaded {resolved.name} in {lm.load_seconds:.2f} s "
                f"(context {lm.model.max_seq_len}, {n_threads} threads, {dtype.value})",
                file=sys.stderr,
            )
            for plan in (lm.plan, lm.experts and lm.experts.plan):
                if plan is not None:
                    print(f"memory: {plan.describe()}", file=sys.stderr)
        chat_model = LocalModel(resolved.name, lm)
    try:
        if interactive:
            if is_tty():
                print(f"{chat_model.name}: /help for commands, Ctrl-D to quit", file=sys.stderr)
            chat_loop(chat_model, settings)
        else:
            answer = _answer_once(chat_model, prompt, no_chat, settings, show)
            _finish(answer, chat_model, lm.load_seconds, json_out, verbose)
    finally:
        if lm is not None:
            _save_trace(lm, trace)


def _load_here(resolved, dtype, ctx, budget, expert_policy, expert_prediction, trace):
    """Load the model in this process, warning when --ctx is past its training."""
    from ..runtime.loader import load_model

    lm = load_model(
        resolved.path,
        torch_dtype(dtype),
        max_seq_len=ctx or DEFAULT_CTX,
        max_memory=budget,
        expert_policy=expert_policy and expert_policy.value,
        record_routing=trace is not None,
        expert_prediction=expert_prediction and expert_prediction.value,
    )
    if ctx is not None and ctx > lm.model.max_seq_len:  # the loader clamped it
        print(
            f"warning: --ctx {ctx} is more than the {lm.model.max_seq_len} tokens "
            f"{resolved.name} was trained on; using {lm.model.max_seq_len}",
            file=sys.stderr,
        )
    return lm


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _server_model(host, model, ctx, check: bool):
    """The model behind a running `infer serve` (cli/client.py RemoteModel), or None when
    no server listens (or, with `check`, when it does not serve this model)."""
    from ..runtime.registry import DEFAULT_MODEL
    from .client import NotServed, RemoteModel, connect, model_reference, server_address

    address, port, named = server_address(host)
    conn = connect(address, port)
    if conn is None:
        if named:
            print(f"note: no server at {address}:{port}; running here", file=sys.stderr)
        return None
    conn.close()
    name = model_reference(model) if model else DEFAULT_MODEL
    remote = RemoteModel(address, port, name, ctx, os.environ.get("INFER_API_KEY"))
    if check:
        try:
            remote.info_rows()  # an unknown name fails here, before the chat starts
        except NotServed:
            return None
    return remote


def _answer_once(chat_model, prompt: str, raw: bool, settings, show):
    """One answer to PROMPT: completed as raw text, or as the chat's first turn."""
    if raw:
        return chat_model.complete(prompt, settings, show)
    messages = [{"role": "system", "content": settings.system}] if settings.system else []
    answer, _ = chat_model.answer([*messages, {"role": "user", "content": prompt}], settings, show)
    return answer


def _finish(answer, chat_model, load_s: float, json_out: bool, verbose: bool) -> None:
    """What `run` prints after a one-shot answer, and its exit status."""
    if answer.finish_reason == "interrupted":
        if not json_out:
            print(flush=True)
        raise typer.Exit(130)
    if json_out:
        print_json(
            {
                "model": chat_model.name,
                "text": answer.text,
                "tokens_generated": answer.n_generated,
                "prompt_tokens": answer.prompt_tokens,
                "finish_reason": answer.finish_reason,
                "timings": {
                    "load_s": round(load_s, 4),
                    "ttft_s": round(answer.ttft_s, 4),
                    "prefill_tok_s": round(answer.prefill_tok_s, 2),
                    "decode_s": round(answer.decode_s, 4),
                    "decode_tok_s": round(answer.decode_tok_s, 2),
                },
            }
        )
    else:
        print("" if answer.text.endswith("\n") else "\n", end="", flush=True)
    if note := answer.context_note():
        print(note, file=sys.stderr)
    if verbose:
        print(answer.stats_line(), file=sys.stderr)
        if line := chat_model.stream_line():
            print(line, file=sys.stderr)


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
    from ..runtime.files.sources import open_source
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
    mi = open_source(resolved.path)
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
    json_out: Json = False,
    debug: Debug = False,
) -> None:
    """Measure load time, prefill and decode speed, memory and bandwidth."""
    from dataclasses import asdict

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
        )
    if json_out:
        print_json(asdict(result))
        return
    print_table(["METRIC", "VALUE"], result.rows(), title=f"infer bench: {resolved.name}")


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
