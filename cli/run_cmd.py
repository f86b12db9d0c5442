"""`infer run`: answer a prompt, or chat on a terminal, in this process or through a
running `infer serve` (cli/client.py). Registered by main.py as `app.command()(run)`.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import asdict
from typing import Annotated

import typer

from .. import InferError
from ..offload.budget import parse_size
from .common import (
    is_tty,
    print_json,
    quiet_broken_pipe,
    read_format,
    read_grammar,
    set_threads,
    sigterm_unwinds,
    status,
    torch_dtype,
    utf8_arg,
    utf8_text,
)
from .options import (
    FLAG,
    Ctx,
    Debug,
    Draft,
    DType,
    DTypeOpt,
    ExpertPolicyOpt,
    ExpertPredictionOpt,
    Format,
    GrammarFile,
    Json,
    KVCacheOpt,
    Lookup,
    MaxMemory,
    MaxTokens,
    MinP,
    ModelArg,
    RepeatPenalty,
    Seed,
    ServerHost,
    Temperature,
    Threads,
    TokenFile,
    TopK,
    TopP,
    TraceOut,
    Verbose,
    Workers,
)

DEFAULT_CTX = 4096


def _save_trace(lm, path) -> None:
    """Write the routing trace a run recorded (--trace), if it recorded any."""
    if path is not None and lm.routing is not None and lm.routing.tokens:
        lm.routing.trace().save(path)
        print(f"trace: {lm.routing.tokens} tokens routed, saved to {path}", file=sys.stderr)


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
    kv_cache: KVCacheOpt = None,
    max_memory: MaxMemory = None,
    expert_policy: ExpertPolicyOpt = None,
    expert_prediction: ExpertPredictionOpt = None,
    trace: TraceOut = None,
    fmt: Format = None,
    grammar_file: GrammarFile = None,
    think: Annotated[
        bool | None,
        typer.Option(
            "--think/--no-think",
            help="A thinking model (Qwen3): think before answering, or answer at once. "
            "Default: the model's. Thoughts show dimmed on a terminal, never on a pipe.",
            show_default=False,
        ),
    ] = None,
    lookup: Lookup = False,
    draft: Draft = None,
    json_out: Json = False,
    verbose: Verbose = False,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            metavar=FLAG,
            help="Load the model in this process even when a server is running. "
            "Implied by --threads, --dtype, --kv-cache, --max-memory, --trace, --expert-*, "
            "--lookup and --draft.",
        ),
    ] = False,
    host: ServerHost = None,
    workers: Workers = None,
    token_file: TokenFile = None,
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
    if interactive and (fmt is not None or grammar_file is not None):
        which = "--format" if fmt is not None else "--grammar-file"
        raise InferError(f"{which} needs a prompt: give PROMPT or pipe text to stdin")
    if fmt is not None and grammar_file is not None:
        raise InferError("give --format or --grammar-file, not both")
    if lookup and draft is not None:
        raise InferError("give --lookup or --draft, not both")
    schema = read_format(fmt)  # a bad file fails before the model loads
    grammar = read_grammar(grammar_file)
    if workers is not None:
        if (max_memory, expert_policy, expert_prediction, trace) != (None,) * 4:
            raise InferError(
                "--workers takes none of --max-memory, --expert-*, --trace "
                "(each worker has its own --max-memory)"
            )
        if token_file is None:
            raise InferError("--workers needs --token-file: the secret the workers share")

    budget = parse_size(max_memory) if max_memory is not None else None
    from .chat import ChatSettings, LocalModel, chat_loop

    settings = ChatSettings(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, seed=seed, repeat_penalty=repeat_penalty, system=system,
        verbose=verbose, format=schema, grammar=grammar, think=think,
    )  # fmt: skip
    from .chat import ThoughtDisplay

    thoughts = ThoughtDisplay(sys.stdout, None if json_out or not sys.stdout.isatty() else _write)
    show = (lambda _: None) if json_out else thoughts.then(_write)
    loads_here = (
        threads, max_memory, expert_policy, expert_prediction, trace, draft, workers, kv_cache
    ) != (None,) * 8 or dtype != DType.float32 or lookup  # fmt: skip
    from .client import served_model

    chat_model = None if local or loads_here else served_model(host, model, ctx, interactive)
    if chat_model is not None and not interactive:
        from .client import NotServed

        try:
            answer = _answer_once(chat_model, prompt, no_chat, settings, show, thoughts)
        except NotServed:
            chat_model = None  # a file the server may not read: load it here
            if verbose:
                print("note: the server does not serve this file; loading it here", file=sys.stderr)
        else:
            _finish(answer, chat_model, answer.load_s, json_out, verbose)
            return
    lm = drafter = None
    if chat_model is None:
        from ..runtime.registry import resolve

        with sigterm_unwinds():  # before importing torch: a wrong name fails at once
            resolved = resolve(model)
            drafts = resolve(draft) if draft is not None else None
        n_threads = set_threads(threads)
        with status(f"loading {resolved.name}"):
            if workers is not None:
                lm = _load_pipelined(model, resolved, workers, token_file, dtype, ctx, kv_cache)
            else:
                lm = _load_here(
                    resolved, dtype, ctx, budget, expert_policy, expert_prediction, trace, kv_cache
                )
        drafter = _drafter(lm, resolved, lookup, drafts, dtype, ctx, threads, kv_cache)
        if verbose:
            print(
                f"loaded {resolved.name} in {lm.load_seconds:.2f} s "
                f"(context {lm.model.max_seq_len}, {n_threads} threads, {dtype.value})",
                file=sys.stderr,
            )
            for plan in (lm.plan, lm.experts and lm.experts.plan):
                if plan is not None:
                    print(f"memory: {plan.describe()}", file=sys.stderr)
            if lm.stages is not None:
                print(f"stages: {lm.stages.describe()}", file=sys.stderr)
        chat_model = LocalModel(resolved.name, lm, drafter)
    try:
        if interactive:
            if is_tty():
                print(f"{chat_model.name}: /help for commands, Ctrl-D to quit", file=sys.stderr)
            chat_loop(chat_model, settings)
        else:
            answer = _answer_once(chat_model, prompt, no_chat, settings, show, thoughts)
            _finish(answer, chat_model, lm.load_seconds, json_out, verbose, drafter)
    finally:
        if lm is not None:
            _save_trace(lm, trace)
            if lm.stages is not None:
                lm.stages.close()


def _load_here(resolved, dtype, ctx, budget, expert_policy, expert_prediction, trace, kv_cache):
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
        kv_cache=kv_cache and kv_cache.value,
    )
    if ctx is not None and ctx > lm.model.max_seq_len:  # the loader clamped it
        print(
            f"warning: --ctx {ctx} is more than the {lm.model.max_seq_len} tokens "
            f"{resolved.name} was trained on; using {lm.model.max_seq_len}",
            file=sys.stderr,
        )
    return lm


def _load_pipelined(model, resolved, workers: str, token_file, dtype, ctx, kv_cache):
    """The embeddings and output layer here, the blocks (and their KV caches, of
    `kv_cache`) on the workers."""
    from ..runtime.pipeline.coordinator import load_pipelined
    from ..runtime.pipeline.handshake import read_token
    from ..runtime.registry import DEFAULT_MODEL
    from .worker_cmd import parse_workers

    addresses, token = parse_workers(workers), read_token(token_file)
    reference = model or DEFAULT_MODEL
    return load_pipelined(
        reference, resolved.path, addresses, token, torch_dtype(dtype), ctx or DEFAULT_CTX,
        kv_cache=kv_cache and kv_cache.value,
    )  # fmt: skip


def _drafter(lm, resolved, lookup: bool, drafts, dtype, ctx, threads, kv_cache):
    """The drafter of --lookup or --draft (speculative decoding), or None; a draft model's
    cache is of --kv-cache's format too. A draft of another tokenizer fails before its
    weights load."""
    from ..runtime.files.sources import open_source
    from ..runtime.speculative import LookupDrafter, ModelDrafter, check_draft_tokenizer

    if lookup:
        return LookupDrafter()
    if drafts is None:
        return None
    if drafts.path == resolved.path:  # a model as its own draft: one copy of the weights
        draft_lm = lm
    else:
        tokenizer = open_source(drafts.path).tokenizer()
        check_draft_tokenizer(tokenizer, lm.tokenizer, drafts.name, resolved.name)
        with status(f"loading {drafts.name}"):
            draft_lm = _load_here(drafts, dtype, ctx, None, None, None, None, kv_cache)
    return ModelDrafter(draft_lm.model, lm.model.args.vocab_size, threads=threads)


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _answer_once(chat_model, prompt: str, raw: bool, settings, show, thoughts):
    """One answer to PROMPT: completed as raw text, or as the chat's first turn (a
    thinking model's thoughts to `thoughts`)."""
    if raw:
        return chat_model.complete(prompt, settings, show)
    messages = [{"role": "system", "content": settings.system}] if settings.system else []
    try:
        answer, _ = chat_model.answer(
            [*messages, {"role": "user", "content": prompt}], settings, show, thoughts
        )
    finally:
        thoughts.end()
    return answer


def _finish(answer, chat_model, load_s, json_out: bool, verbose: bool, drafter=None) -> None:
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
                **({"thinking": answer.thinking} if answer.thinking else {}),
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
                **({"speculation": asdict(drafter.stats)} if drafter is not None else {}),
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
        if drafter is not None:
            print(drafter.stats.describe(), file=sys.stderr)
