"""Embeddings, as both APIs take them: what to embed, the vectors computed on the
model's scheduler between its decode steps, and their shortening (dimensions)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import traceback

from ... import InferError
from ...runtime.embedding import embed, pooling_of
from ...runtime.scheduler import Call
from .errors import ApiError
from .pool import Loaded, ModelPool


class _Embedding:
    """A request's place in Loaded.pending while its vectors are computed."""


async def embed_inputs(
    pool: ModelPool,
    model: str | None,
    inputs: list[str | list[int]],
    *,
    keep_alive: float | None | bool = False,
    truncate: bool = True,
    normalize: bool = True,
    context: int | None = None,
) -> tuple[Loaded, list[list[float]], int]:
    """Each input's embedding (a text, or token ids), computed on the model's scheduler
    between its decode steps: (the model, the vectors, the tokens read). An input longer
    than the context is cut to it with `truncate`, else a 400."""
    loaded = await pool.get(model, keep_alive)
    marker = _Embedding()
    loaded.pending.add(marker)
    try:
        tok = loaded.lm.tokenizer
        limit = min(context or loaded.context, loaded.context)
        batch = []
        for i, x in enumerate(inputs):
            ids = tok.encode_embedded(x) if isinstance(x, str) else list(x)
            if not ids:
                raise ApiError(400, f"input[{i}] is empty", "input")
            if any(not 0 <= t < tok.vocab_size for t in ids):
                raise ApiError(400, f"input[{i}] has a token id past the vocabulary", "input")
            if len(ids) > limit and not truncate:
                raise ApiError(
                    400,
                    f"input[{i}] is {len(ids)} tokens, longer than the context of {limit} tokens",
                    "input",
                )
            batch.append(ids[:limit])
        pooling = pooling_of(loaded.lm.source.config)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result) -> None:  # on the scheduler's thread
            def put() -> None:
                if not done.done():
                    done.set_result(result)

            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
                loop.call_soon_threadsafe(put)

        def vectors(session) -> list[list[float]]:
            return [embed(session, ids, pooling, normalize) for ids in batch]

        loaded.scheduler.call(Call(vectors, settle))
        result = await done
        if isinstance(result, InferError):
            raise ApiError(getattr(result, "http_status", 400), str(result)) from result
        if isinstance(result, Exception):  # a bug: its traceback for the log, a 500
            traceback.print_exception(result, file=sys.stderr)
            raise ApiError(500, f"internal error: {type(result).__name__}: {result}")
        return loaded, result, sum(map(len, batch))
    finally:
        loaded.touch()
        loaded.pending.discard(marker)


def embedding_inputs(value, key: str) -> list[str | list[int]]:
    """What to embed: a string, a list of strings, token ids, or a list of those (OpenAI
    takes all four; ollama the strings)."""

    def ids(v) -> bool:
        return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)

    if isinstance(value, str) or ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or ids(v) for v in value):
        return value
    raise ApiError(
        400, f"{key} must be a string, a list of strings, or token ids, and not empty", key
    )


def shortened(vectors: list[list[float]], dims: int | None) -> list[list[float]]:
    """Each vector's first `dims` values at unit length again (Matryoshka embeddings);
    all of each when `dims` is None or not less than its length."""
    if dims is None:
        return vectors
    out = []
    for v in vectors:
        v = v[:dims]
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        out.append([x / norm for x in v])
    return out
