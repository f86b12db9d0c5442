"""`infer worker`: hold some of a model's blocks for a coordinator on another machine
(`infer run/serve --workers`). Registered by main.py as `app.command()(worker)`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from .. import InferError
from ..offload.budget import parse_size
from .common import set_threads
from .options import Debug, Threads, TokenFile

DEFAULT_PORT = 11436
# Without --max-memory a worker offers this share of the memory available when it starts
OFFER_SHARE = 0.8


def worker(
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="The address to listen on; only this one (give the machine's address on "
            "the trusted network that links it to the coordinator).",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="The port to listen on; 0: any.")
    ] = DEFAULT_PORT,
    token_file: TokenFile = None,
    max_memory: Annotated[
        str | None,
        typer.Option(
            "--max-memory",
            metavar="SIZE",
            help="Memory this worker offers, e.g. 12GB: the coordinator gives it layers in "
            "proportion; layers beyond it stream from this machine's disk (infer's own "
            "format; others are refused). Default: 80% of the memory available when it "
            "starts.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            metavar="PATH",
            help="The model's file or directory on this machine. Default: the model as "
            "the coordinator names it, found here. Either way it must be the same file "
            "(compared by sha256).",
            show_default=False,
        ),
    ] = None,
    speed: Annotated[
        float | None,
        typer.Option(
            "--speed",
            metavar="GB/S",
            min=0.001,
            help="The memory read bandwidth to count this worker at, which decode speed "
            "follows: the coordinator gives each worker layers in proportion to it, "
            "within the memory each offers. Default: measured when the worker starts "
            "(give it when several workers share one machine).",
            show_default=False,
        ),
    ] = None,
    threads: Threads = None,
    debug: Debug = False,
) -> None:
    """Hold a range of a model's blocks for a coordinator (`infer run --workers`).

    Waits for coordinators, one at a time. Each proves the shared secret in the token
    file, names the model (this machine's copy must be the same file) and the layers
    to hold; hidden states then pass through them over torch.distributed (gloo). The
    links must be on a trusted network: gloo's traffic is not authenticated.
    """
    # c10d logs every dropped connection with a C++ stack; the worker says it in one line.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch loads
    from ..runtime.pipeline.handshake import read_token
    from ..runtime.pipeline.stage import WorkerSettings, serve_worker

    if token_file is None:
        raise InferError("--token-file is required: the secret the coordinator proves")
    token = read_token(token_file)
    if model is not None and not model.exists():
        raise InferError(f"--model {model}: no such file or directory")
    if max_memory is not None:
        budget = parse_size(max_memory)
    else:
        import psutil

        budget = int(OFFER_SHARE * psutil.virtual_memory().available)
    set_threads(threads)
    if host not in ("127.0.0.1", "::1", "localhost"):
        _say(f"listening on {host}: the links must be on a trusted network")
    settings = WorkerSettings(host, port, token, budget, model, threads, speed)
    serve_worker(settings, log=_say)


def _say(message: str) -> None:
    print(f"worker: {message}", file=sys.stderr, flush=True)


def parse_workers(text: str) -> list[tuple[str, int]]:
    """--workers "h1:p1,h2:p2" ([v6]:p too) as (host, port) pairs."""
    out = []
    for item in text.split(","):
        host, sep, port = item.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InferError(f"--workers: {item.strip()!r} is not HOST:PORT")
        out.append((host, int(port)))
    return out
