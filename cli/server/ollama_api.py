"""The ollama API: /api/chat (with tool calls, and a thinking model's thoughts in
`thinking`), /api/generate, /api/embed, /api/embeddings, /api/tags, /api/ps, /api/show,
/api/version.

Streams are newline-delimited JSON objects, the last with `"done": true` and ollama's
timings in nanoseconds; errors are `{"error": "message"}` with the HTTP status.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ... import __version__
from ...runtime.generate import Penalties
from ...runtime.model.tool_calls import ToolCall
from .embeddings import embed_inputs, embedding_inputs, shortened
from .errors import ApiError
from .requests import (
    NUMBER,
    AnswerRequest,
    Finished,
    collect,
    get,
    grammar_of,
    keep_alive_of,
    logprobs_of,
    messages_of,
    prepare,
    read_json,
    run,
    sampling_of,
    stop_of,
    tools_of,
)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse({"error": err.message}, status_code=err.status)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _answer_request(body: dict) -> AnswerRequest:
    options = get(body, "options", dict, {})
    num_predict = get(options, "num_predict", int, -1)
    if num_predict == 0 or num_predict < -2:
        raise ApiError(
            400, f"num_predict must be at least 1, or -1, not {num_predict}", "num_predict"
        )
    sampling = sampling_of(options)
    penalties = Penalties(
        repeat=get(
            options, "repeat_penalty", NUMBER, 1.0, check=lambda v: v > 0, must="more than 0"
        ),
        frequency=get(options, "frequency_penalty", NUMBER, 0.0),
        presence=get(options, "presence_penalty", NUMBER, 0.0),
        last_n=get(options, "repeat_last_n", int, 64, check=lambda v: v >= -1, must="-1 or more"),
    )
    return AnswerRequest(
        logprobs=logprobs_of(body, get(body, "logprobs", bool, False)),
        model=get(body, "model", str, None),
        max_tokens=num_predict if num_predict > 0 else -1,
        sampling=sampling,
        penalties=None if penalties.off else penalties,
        stop=stop_of(options.get("stop"), "options.stop"),
        context=get(options, "num_ctx", int, None, check=lambda v: v >= 1, must="at least 1"),
        keep_alive=keep_alive_of(body),
        stream=get(body, "stream", bool, True),
        truncate=get(body, "truncate", bool, True),
        format=_format(body),
    )


def _format(body: dict) -> str | dict | None:
    """format: "json", or a JSON schema object; "" (some clients send it) is none."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json" or isinstance(fmt, dict):
        return fmt
    raise ApiError(400, 'format must be "json" or a JSON schema object', "format")


def _done_fields(f: Finished, load_s: float, t0: float, dropped: int) -> dict:
    a, ns = f.answer, 1e9
    extra = {"messages_dropped": dropped} if dropped else {}  # not ollama's: truncation
    return {
        **extra,
        "done": True,
        "done_reason": "length" if a.finish_reason == "length" else "stop",
        "total_duration": int((time.perf_counter() - t0) * ns),
        "load_duration": int(load_s * ns),
        "prompt_eval_count": a.prompt_tokens - a.cached_tokens,
        "prompt_eval_duration": int((f.queued_s + a.ttft_s) * ns),
        "eval_count": len(a.tokens),
        "eval_duration": int(a.decode_s * ns),
        "prompt_cache_count": a.cached_tokens,  # not in ollama: tokens the prefix cache held
    }


async def _answer(request: Request, chat: bool):
    app = request.app.state
    t0 = time.perf_counter()
    body = await read_json(request)
    req = _answer_request(body)
    grammar_of(body, req)  # not ollama's: llama-server's, for `infer run --grammar-file`
    name = req.model or app.pool.default_name
    think = get(body, "think", bool, None)  # Qwen3 and the like: whether to think first
    req.template_vars = None if think is None else {"enable_thinking": think}
    req.think = think
    if chat:
        req.messages = messages_of(body) if body.get("messages") else None
        req.tools = tools_of(body)
    else:
        prompt = get(body, "prompt", str, "")
        system = get(body, "system", str, None)
        req.suffix = get(body, "suffix", str, None) or None  # "" is none, as in ollama
        if req.suffix is not None or prompt and get(body, "raw", bool, False):
            req.prompt = prompt
        elif prompt:
            req.messages = [{"role": "system", "content": system}] if system else []
            req.messages.append({"role": "user", "content": prompt})
    if req.messages is None and req.prompt is None:
        # No prompt: load (or with keep_alive 0, unload) the model, as ollama does.
        loaded = await app.pool.get(req.model, req.keep_alive)
        reason = "load"
        if req.keep_alive == 0:  # at once, or after the answers in flight (the reaper)
            if not loaded.in_use:
                await app.pool.unload(loaded)
            reason = "unload"
        out = {"model": name, "created_at": _now(), "done": True, "done_reason": reason}
        out["message" if chat else "response"] = (
            {"role": "assistant", "content": ""} if chat else ""
        )
        return JSONResponse(out)
    t_load = time.perf_counter()
    p = await prepare(app.pool, req)
    load_s = time.perf_counter() - t_load  # loading the model, if it was not, and encoding

    def message(piece: str, calls: list[ToolCall] | None = None, thought: str = "") -> dict:
        out = {"model": name, "created_at": _now()}
        if chat:
            out["message"] = {"role": "assistant", "content": piece}
            if thought:
                out["message"]["thinking"] = thought
            if calls:  # ollama's: arguments as an object
                out["message"]["tool_calls"] = [
                    {"function": {"name": c.name, "arguments": c.arguments}} for c in calls
                ]
        else:
            out["response"] = piece
            if thought:
                out["thinking"] = thought
        return out

    if not req.stream:
        text, finished = await collect(p, app.metrics, request)
        thought, text, calls = p.parts(text)
        done = _done_fields(finished, load_s, t0, p.dropped)
        if req.logprobs is not None:
            done["logprobs"] = p.answer_logprobs(finished.answer)
        return JSONResponse({**message(text, calls, thought), **done})

    splitter = p.splitter()

    async def lines():
        try:
            async for item in run(p, app.metrics):
                if isinstance(item, Finished):
                    thought, rest, calls = splitter.finish()
                    if thought or rest or calls:
                        yield json.dumps({**message(rest, calls, thought), "done": False}) + "\n"
                    out = {**message(""), **_done_fields(item, load_s, t0, p.dropped)}
                else:
                    thought, piece = splitter.feed(item)
                    if not (thought or piece):
                        continue
                    out = {**message(piece, thought=thought), "done": False}
                    if req.logprobs is not None:
                        out["logprobs"] = p.take_logprobs()
                yield json.dumps(out) + "\n"
        except ApiError as err:  # after the headers went out: an error line ends it
            yield json.dumps({"error": err.message}) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def chat(request: Request):
    return await _answer(request, chat=True)


async def generate(request: Request):
    return await _answer(request, chat=False)


def _details(source) -> dict:
    args = source.args
    return {
        "format": source.format,
        "family": args.model_type,
        "families": [args.model_type],
        "parameter_size": _size(args.n_params),
        "quantization_level": source.quantization,
    }


def _size(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


async def tags(request: Request):
    from ...runtime.registry import list_cached

    models = []
    for m in list_cached():
        modified = datetime.fromtimestamp(m.path.stat().st_mtime, timezone.utc)
        models.append(
            {
                "name": m.name,
                "model": m.name,
                "modified_at": modified.isoformat().replace("+00:00", "Z"),
                "size": m.size,
                "digest": "",
                "details": {"format": m.format, "quantization_level": m.quantization or ""},
            }
        )
    return JSONResponse({"models": models})


async def ps(request: Request):
    models = []
    for m in request.app.state.pool.loaded.values():
        left = m.expires_in()
        forever = datetime(2318, 1, 1, tzinfo=timezone.utc)  # ollama's "never" is far ahead
        expires = forever if left is None else datetime.now(timezone.utc) + timedelta(seconds=left)
        models.append(
            {
                "name": m.name,
                "model": m.name,
                "size": m.size,
                "digest": "",
                "details": _details(m.lm.source),
                "expires_at": expires.isoformat().replace("+00:00", "Z"),
                "size_vram": 0,
                "context_length": m.context,
            }
        )
    return JSONResponse({"models": models})


async def show(request: Request):
    from ...runtime.files.sources import open_source

    body = await read_json(request)
    name = get(body, "model", str, None) or get(body, "name", str, None)
    resolved = request.app.state.pool.resolve(name)
    source = open_source(resolved.path)
    args = source.args
    arch = args.model_type
    tok = source.tokenizer()
    return JSONResponse(
        {
            "license": "",
            "modelfile": f"FROM {resolved.path}\n",
            "parameters": "",
            "template": tok.chat_template or "",
            "details": _details(source),
            "model_info": {
                "general.architecture": arch,
                "general.parameter_count": args.n_params,
                f"{arch}.context_length": args.max_seq_len,
                f"{arch}.embedding_length": args.dim,
                f"{arch}.block_count": args.n_layers,
                f"{arch}.attention.head_count": args.n_heads,
                f"{arch}.attention.head_count_kv": args.n_kv_heads,
                f"{arch}.vocab_size": args.vocab_size,
            },
            "capabilities": ["completion"]
            + (["tools"] if tok.tool_format else [])
            + (["insert"] if tok.fim_ids else [])
            + (["thinking"] if tok.thinks else []),
        }
    )


async def embed(request: Request):
    """/api/embed: input (a string or strings) -> embeddings at unit length; truncate
    (true) cuts an input to the context, dimensions keeps the first N."""
    t0 = time.perf_counter()
    body = await read_json(request)
    inputs = embedding_inputs(body.get("input"), "input")
    if not all(isinstance(x, str) for x in inputs):
        raise ApiError(400, "input must be a string or a list of strings", "input")
    dims = get(body, "dimensions", int, None, check=lambda v: v >= 1, must="at least 1")
    loaded, vectors, n, load_s = await _embed(
        request, body, inputs, get(body, "truncate", bool, True)
    )
    return JSONResponse(
        {
            "model": get(body, "model", str, None) or loaded.name,
            "embeddings": shortened(vectors, dims),
            "total_duration": int((time.perf_counter() - t0) * 1e9),
            "load_duration": int(load_s * 1e9),
            "prompt_eval_count": n,
        }
    )


async def embeddings(request: Request):
    """/api/embeddings, ollama's first: prompt -> embedding, not scaled to unit length."""
    body = await read_json(request)
    prompt = get(body, "prompt", str, "")
    if not prompt:
        return JSONResponse({"embedding": []})  # as ollama answers an empty prompt
    _, (vector,), _, _ = await _embed(request, body, [prompt], True, normalize=False)
    return JSONResponse({"embedding": vector})


async def _embed(request: Request, body: dict, inputs, truncate: bool, normalize: bool = True):
    options = get(body, "options", dict, {})
    t0 = time.perf_counter()
    pool = request.app.state.pool
    model = get(body, "model", str, None)
    loaded = await pool.get(model, keep_alive_of(body))  # loaded (and timed) first
    load_s = time.perf_counter() - t0
    context = get(options, "num_ctx", int, None, check=lambda v: v >= 1, must="at least 1")
    loaded, vectors, n = await embed_inputs(
        pool, model, inputs, truncate=truncate, normalize=normalize, context=context
    )
    return loaded, vectors, n, load_s


async def version(request: Request):
    return JSONResponse({"version": __version__})


routes = [
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/version", version, methods=["GET"]),
    Route("/api/embed", embed, methods=["POST"]),
    Route("/api/embeddings", embeddings, methods=["POST"]),
]
