"""`infer embed`: texts to vectors, through a running `infer serve` when one serves the
model, else in this process. Registered by main.py as `app.command()(embed)`."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from .. import InferError
from .common import print_json, sigterm_unwinds, utf8_arg, utf8_text
from .options import FLAG, Ctx, Debug, Json, RequiredModelArg, ServerHost, Threads


def embed(
    model: RequiredModelArg,
    texts: Annotated[
        list[str] | None,
        typer.Argument(
            help="The texts to embed. Without them: each line of stdin.",
            metavar="[TEXT]...",
            show_default=False,
        ),
    ] = None,
    ctx: Ctx = None,
    threads: Threads = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local", metavar=FLAG, help="Load the model here even when a server is running."
        ),
    ] = False,
    host: ServerHost = None,
    json_out: Json = False,
    debug: Debug = False,
) -> None:
    """Embed each TEXT, or each line of stdin: one JSON array a line.

    Vectors are at unit length, pooled as the model's file says (the mean for a chat
    model). Texts longer than the context are cut to it."""
    texts = [utf8_arg(t, "TEXT") for t in texts or []]
    if not texts and not sys.stdin.isatty():
        lines = utf8_text(sys.stdin.buffer.read(), "stdin").splitlines()
        texts = [line for line in lines if line.strip()]
    if not texts:
        raise InferError("no text: give TEXT or pipe lines to stdin")
    from .client import NotServed, served_model

    remote = None if local or threads is not None else served_model(host, model, ctx)
    if remote is not None:
        try:
            vectors, tokens = remote.embed(texts)
        except NotServed:
            remote = None  # a file the server may not read: embed it here
    if remote is None:
        vectors, tokens = _embed_here(model, texts, ctx, threads)
    if json_out:
        print_json({"model": model, "embeddings": vectors, "prompt_tokens": tokens})
        return
    for v in vectors:
        print(json.dumps(v))


def _embed_here(model: str, texts: list[str], ctx: int | None, threads: int | None):
    from ..runtime.registry import resolve

    with sigterm_unwinds():  # before importing torch: a wrong name fails at once
        resolved = resolve(model)
    from ..runtime.embedding import embed, pooling_of
    from ..runtime.loader import load_model
    from ..runtime.session import Session
    from .common import set_threads

    set_threads(threads)
    lm = load_model(resolved.path, max_seq_len=ctx)
    session, pooling = Session(lm.model), pooling_of(lm.source.config)
    limit = session.max_seq_len
    ids = [lm.tokenizer.encode_embedded(t)[:limit] for t in texts]
    return [embed(session, i, pooling) for i in ids], sum(map(len, ids))
