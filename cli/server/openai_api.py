"""The OpenAI API: /v1/chat/completions (with tool calls, and a thinking model's thoughts
in reasoning_content as llama-server gives them), /v1/completions, /v1/embeddings,
/v1/models.

Streams are server-sent events (`data: {...}` chunks, then `data: [DONE]`); errors
are `{"error": {"message", "type", "param", "code"}}` with the HTTP status.
"""

from __future__ import annotations

import array
import base64
import json
import time
import uuid

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ...runtime.generate import Penalties
from ...runtime.model.tool_calls import ToolCall
from .embeddings import embed_inputs, embedding_inputs, shortened
from .errors import ApiError
from .requests import (
    NUMBER,
    AnswerRequest,
    Finished,
    call_id,
    choose_tools,
    collect_all,
    effort_of,
    get,
    grammar_of,
    logprobs_of,
    messages_of,
    prepare,
    read_json,
    run_all,
    sampling_of,
    stop_of,
    tools_of,
)

MAX_CHOICES = 16  # answers a request may ask for (n)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def error_response(err: ApiError) -> JSONResponse:
    kind = ERROR_TYPES.get(
        err.status, "server_error" if err.status >= 500 else "invalid_request_error"
    )
    body = {"error": {"message": err.message, "type": kind, "param": err.param, "code": None}}
    return JSONResponse(body, status_code=err.status)


def _finish_reason(reason: str, calls: list[ToolCall] | None = None) -> str:
    return "tool_calls" if calls else "length" if reason == "length" else "stop"


def _tool_calls(calls: list[ToolCall], streamed: bool = False) -> list[dict]:
    """OpenAI's tool_calls: each with an id, its arguments as a JSON string (and in a
    stream's delta, its index)."""
    out = []
    for i, c in enumerate(calls):
        call = {
            "id": call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        out.append({"index": i, **call} if streamed else call)
    return out


def _tool_choice(body: dict, req: AnswerRequest) -> None:
    """tool_choice: "auto" (the default), "none", "required", or {"type": "function",
    "function": {"name": NAME}}."""
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", "none", "required"):
        return choose_tools(req, choice)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ApiError(
            400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}', "tool_choice",
        )  # fmt: skip
    choose_tools(req, "required", name)


def _logprobs(req: AnswerRequest, entries: list[dict], chat: bool) -> dict | None:
    """A choice's logprobs: the chat API's {"content": [...]}, or the legacy API's
    parallel lists (text_offset within the answer)."""
    if req.logprobs is None:
        return None
    if chat:
        return {"content": entries}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _logit_bias(bias: dict) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": value from -100 to 100}; the ids are checked against the
    model's vocabulary once it is known (prepare)."""
    out = []
    for key, value in bias.items():
        ok = key.isdigit() and isinstance(value, NUMBER) and not isinstance(value, bool)
        if not ok or not -100 <= value <= 100:
            raise ApiError(
                400, "logit_bias maps token ids to numbers from -100 to 100", "logit_bias"
            )
        out.append((int(key), float(value)))
    return tuple(out)


def _usage(finished: list[Finished]) -> dict:
    """The prompt counted once, every answer's tokens (n of them) added up."""
    a = finished[0].answer
    completion = sum(len(f.answer.tokens) for f in finished)
    return {
        "prompt_tokens": a.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": a.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": a.cached_tokens},
    }


def _response_format(body: dict) -> str | dict | None:
    """response_format: {"type": "text"}, {"type": "json_object"}, or {"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
    rf = get(body, "response_format", dict, None)
    if rf is None:
        return None
    kind = get(rf, "type", str, "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = get(rf, "json_schema", dict, None)
        schema = get(spec or {}, "schema", dict, None)
        if schema is None:
            raise ApiError(
                400, "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )  # fmt: skip
        return schema
    raise ApiError(
        400, f"response_format.type must be text, json_object or json_schema, not {kind!r}",
        "response_format",
    )  # fmt: skip


def _answer_request(body: dict, chat: bool) -> AnswerRequest:
    max_tokens = get(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is None:
        max_tokens = get(body, "max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, not {max_tokens}", "max_tokens")
    sampling = sampling_of(body)
    in_range = (lambda v: -2 <= v <= 2, "from -2 to 2")
    penalties = Penalties(
        repeat=get(body, "repeat_penalty", NUMBER, 1.0, check=lambda v: v > 0, must="more than 0"),
        frequency=get(body, "frequency_penalty", NUMBER, 0.0, check=in_range[0], must=in_range[1]),
        presence=get(body, "presence_penalty", NUMBER, 0.0, check=in_range[0], must=in_range[1]),
        bias=_logit_bias(get(body, "logit_bias", dict, {})),
    )
    stream_options = get(body, "stream_options", dict, {})
    get(stream_options, "include_usage", bool)  # type-checked here, read by the stream
    req = AnswerRequest(
        model=get(body, "model", str, None),
        max_tokens=-1 if max_tokens is None else max_tokens,
        sampling=sampling,
        penalties=None if penalties.off else penalties,
        stop=stop_of(body.get("stop")),
        stream=get(body, "stream", bool, False),
        format=_response_format(body),
        format_param="response_format",
    )
    grammar_of(body, req)
    if chat:
        req.messages = messages_of(body)
        req.tools = tools_of(body)
        _tool_choice(body, req)
        # variables for the template, as vLLM and llama-server take them
        req.template_vars = get(body, "chat_template_kwargs", dict, None)
        effort_of(get(body, "reasoning_effort", str, None), req, "reasoning_effort")
        # llama-server's: "none" leaves a thinking model's thoughts in the content
        req.thoughts_apart = get(body, "reasoning_format", str, "auto") != "none"
        req.logprobs = logprobs_of(body, get(body, "logprobs", bool, False))
    else:
        # the legacy API's logprobs: how many alternatives (0 or more), or null
        req.logprobs = logprobs_of(body, body.get("logprobs") is not None, "logprobs")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string (one prompt per request)", "prompt")
        req.prompt = prompt
        req.suffix = get(body, "suffix", str, None) or None  # fill in the middle
    return req


async def _complete(request: Request, chat: bool):
    app = request.app.state
    body = await read_json(request)
    n = get(
        body, "n", int, 1, check=lambda v: 1 <= v <= MAX_CHOICES, must=f"from 1 to {MAX_CHOICES}"
    )
    req = _answer_request(body, chat)
    p = await prepare(app.pool, req)
    # n answers to one prompt, decoded together; with a seed, answer i samples with seed + i
    seed = req.sampling.seed
    ps = [p, *(p.another(None if seed is None else seed + i) for i in range(1, n))]
    kind = "chat.completion" if chat else "text_completion"
    common = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": kind,
        "created": int(time.time()),
        "model": req.model or p.loaded.name,
        "system_fingerprint": "infer",
    }
    if not req.stream:
        choices = []
        results = await collect_all(ps, app.metrics, request)
        for i, (q, (content, finished)) in enumerate(zip(ps, results)):
            thought, content, calls = q.parts(content)
            reason = _finish_reason(finished.answer.finish_reason, calls)
            logprobs = _logprobs(req, q.answer_logprobs(finished.answer), chat)
            choice = {"index": i, "finish_reason": reason, "logprobs": logprobs}
            if chat:
                choice["message"] = {
                    "role": "assistant",
                    "content": (content or None) if calls else content,
                }
                if thought:
                    choice["message"]["reasoning_content"] = thought
                if calls:
                    choice["message"]["tool_calls"] = _tool_calls(calls)
            else:
                choice["text"] = content
            choices.append(choice)
        usage = _usage([f for _, f in results])
        return JSONResponse({**common, "choices": choices, "usage": usage})

    include_usage = bool(get(body, "stream_options", dict, {}).get("include_usage"))
    common["object"] = "chat.completion.chunk" if chat else "text_completion"
    unsent: list[list[dict]] = [[] for _ in ps]  # each answer's logprobs not yet sent

    def chunk(i: int, piece: str | None, reason: str | None = None, delta: dict | None = None):
        logprobs = None
        if piece:
            logprobs, unsent[i] = _logprobs(req, unsent[i], chat), []
        choice: dict = {"index": i, "finish_reason": reason, "logprobs": logprobs}
        if chat:
            choice["delta"] = delta or ({} if piece is None else {"content": piece})
        else:
            choice["text"] = piece or ""
        return json.dumps({**common, "choices": [choice]})

    def pieces(i: int, thought: str, text: str):
        if thought:
            yield {"data": chunk(i, thought, delta={"reasoning_content": thought})}
        if text:
            yield {"data": chunk(i, text)}

    splitters = [q.splitter() for q in ps]

    async def events():
        if chat:
            for i in range(n):
                first = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                }
                yield {"data": json.dumps({**common, "choices": [first]})}
        finished: list[Finished] = []
        try:
            async for i, item, entries in run_all(ps, app.metrics):
                unsent[i].extend(entries)
                if isinstance(item, Finished):
                    thought, rest, calls = splitters[i].finish()
                    for event in pieces(i, thought, rest):
                        yield event
                    if calls:
                        delta = {"tool_calls": _tool_calls(calls, streamed=True)}
                        yield {"data": chunk(i, None, delta=delta)}
                    yield {"data": chunk(i, None, _finish_reason(item.answer.finish_reason, calls))}
                    finished.append(item)
                else:
                    for event in pieces(i, *splitters[i].feed(item)):
                        yield event
            if include_usage:
                yield {"data": json.dumps({**common, "choices": [], "usage": _usage(finished)})}
        except ApiError as err:  # after the headers went out: an error event, then the end
            yield {"data": json.dumps({"error": {"message": err.message, "type": "server_error"}})}
        yield {"data": "[DONE]"}

    # On SIGTERM the answers are cancelled and end their stream themselves: give them the
    # time to send their last chunks, rather than cutting the response off (less than
    # uvicorn's 5 s).
    return EventSourceResponse(events(), ping=15, shutdown_grace_period=3)


async def chat_completions(request: Request):
    return await _complete(request, chat=True)


async def completions(request: Request):
    return await _complete(request, chat=False)


async def embeddings(request: Request):
    """/v1/embeddings: input (a string, strings, token ids), encoding_format float or
    base64 (the openai package asks for base64), dimensions (the first N, at unit length)."""
    body = await read_json(request)
    inputs = embedding_inputs(body.get("input"), "input")
    fmt = get(body, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise ApiError(
            400, f"encoding_format must be float or base64, not {fmt!r}", "encoding_format"
        )
    dims = get(body, "dimensions", int, None, check=lambda v: v >= 1, must="at least 1")
    model = get(body, "model", str, None)
    loaded, vectors, n = await embed_inputs(request.app.state.pool, model, inputs)
    data = []
    for i, v in enumerate(shortened(vectors, dims)):
        if fmt == "base64":
            v = base64.b64encode(array.array("f", v).tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": v})
    usage = {"prompt_tokens": n, "total_tokens": n}
    return JSONResponse(
        {"object": "list", "data": data, "model": model or loaded.name, "usage": usage}
    )


async def models(request: Request):
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "infer"}
        for name in request.app.state.model_names()
    ]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request):
    """/v1/models/{name}: a model this server would serve (404 for any other)."""
    name = request.path_params["name"]
    request.app.state.pool.resolve(name)
    return JSONResponse(
        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "infer"}
    )


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{name:path}", model, methods=["GET"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
]
