"""`infer serve`: keep models loaded behind the OpenAI, ollama, Anthropic and
llama-server HTTP APIs (cli/server/). Registered by main.py as `app.command()(serve)`.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from .. import InferError
from ..offload.budget import parse_size
from .common import torch_dtype
from .options import (
    Ctx,
    Debug,
    Draft,
    DType,
    DTypeOpt,
    KVCacheOpt,
    Lookup,
    MaxMemory,
    Threads,
    TokenFile,
    Workers,
)

DEFAULT_PORT = 11435  # beside ollama's 11434
DEFAULT_HOST = "127.0.0.1"


def serve(
    models: Annotated[
        list[str] | None,
        typer.Argument(
            help="Models to load at start (names, .gguf files or model folders). Others "
            "load on first use: registry models on disk, and files under --models-dir.",
            metavar="[MODEL]...",
            show_default=False,
        ),
    ] = None,
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Address to listen on. Other than loopback, set --api-key too."
        ),
    ] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port.")] = (DEFAULT_PORT),
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="INFER_API_KEY",
            help="Require `Authorization: Bearer KEY` on every request (or INFER_API_KEY).",
            show_default=False,
        ),
    ] = None,
    cors_origins: Annotated[
        list[str] | None,
        typer.Option(
            "--cors-origin",
            metavar="ORIGIN",
            help="Also let web pages from ORIGIN (https://app.example, or * for any) call the "
            "server from a browser; local pages, apps and browser extensions always may.",
            show_default=False,
        ),
    ] = None,
    keep_alive: Annotated[
        str,
        typer.Option(
            "--keep-alive",
            metavar="DURATION",
            help="Unload a model after this long idle (5m, 1h, 30s; -1: never). A "
            "request's keep_alive overrides it for its model.",
        ),
    ] = "5m",
    models_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--models-dir",
            metavar="DIR",
            help="Requests may name model files and folders under DIR (repeatable).",
            show_default=False,
        ),
    ] = None,
    parallel: Annotated[
        int,
        typer.Option(
            "--parallel",
            "-np",
            "--slots",
            min=1,
            help="Answers each model runs at once, in one batched decode step; as many "
            "KV caches (slots) of --ctx positions, which keep their conversations' "
            "prompts for reuse. Requests beyond them wait their turn.",
        ),
    ] = 4,
    prefill_chunk: Annotated[
        int,
        typer.Option(
            "--prefill-chunk",
            min=1,
            help="Prompt tokens computed between two decode steps, new requests' "
            "together: their prompts pause the running answers for one chunk at a time.",
        ),
    ] = 256,
    cache_ram: Annotated[
        str,
        typer.Option(
            "--cache-ram",
            metavar="SIZE",
            help="Memory each model keeps the conversations its slots gave up in (their "
            "KV caches), so that a prompt that starts as one did is not computed again; "
            "counted in the model's memory. 0: none.",
        ),
    ] = "1GiB",
    lookup: Lookup = False,
    draft: Draft = None,
    ctx: Ctx = None,
    dtype: DTypeOpt = DType.float32,
    kv_cache: KVCacheOpt = None,
    max_memory: MaxMemory = None,
    threads: Threads = None,
    workers: Workers = None,
    token_file: TokenFile = None,
    debug: Debug = False,
) -> None:
    """Serve models over HTTP: the OpenAI, ollama, Anthropic and llama-server APIs.

    The OpenAI API under /v1/..., ollama's under /api/..., Anthropic's Messages API at
    /v1/messages and llama-server's /completion and /infill.

    `infer run` uses a running server when it finds one (INFER_HOST, default
    127.0.0.1:11435). Stop with Ctrl-C or SIGTERM.
    """
    from .server.pool import ServeSettings, parse_keep_alive

    try:
        keep = parse_keep_alive(keep_alive)
    except ValueError as e:
        raise InferError(f"--keep-alive: {e}") from None
    for d in models_dir or []:
        if not d.is_dir():
            raise InferError(f"--models-dir {d}: not a directory")
    if not _is_loopback(host) and api_key is None:
        print(
            f"warning: listening on {host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    budget = parse_size(max_memory) if max_memory is not None else None
    try:
        cache_bytes = 0 if cache_ram.strip() == "0" else parse_size(cache_ram)
    except InferError as e:
        raise InferError(f"--cache-ram: {e}") from None

    from ..runtime.registry import resolve
    from .common import set_threads
    from .server.app import serve as run_server

    if lookup and draft is not None:
        raise InferError("give --lookup or --draft, not both")
    for name in [*(models or []), *([draft] if draft is not None else [])]:
        resolve(name, download=False)  # a wrong name fails before anything loads
    addresses = token = None
    if workers is not None:
        from ..runtime.pipeline.handshake import read_token
        from .worker_cmd import parse_workers

        if len(models or []) != 1 or max_memory is not None:
            raise InferError(
                "--workers serves one MODEL, without --max-memory (each worker has its own)"
            )
        if token_file is None:
            raise InferError("--workers needs --token-file: the secret the workers share")
        addresses, token = parse_workers(workers), read_token(token_file)
    n_threads = set_threads(threads)
    settings = ServeSettings(
        models=list(models or []),
        model_dirs=list(models_dir or []),
        ctx=ctx or 4096,
        dtype=torch_dtype(dtype),
        kv_cache=kv_cache and kv_cache.value,
        max_memory=budget,
        parallel=parallel,
        prefill_chunk=prefill_chunk,
        cache_bytes=cache_bytes,
        lookup=lookup,
        draft=draft,
        keep_alive=keep,
        threads=n_threads,
        workers=addresses,
        token=token,
        cors_origins=list(cors_origins or []),
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_server(settings, host, port, api_key)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
