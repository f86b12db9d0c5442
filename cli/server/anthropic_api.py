"""Anthropic's Messages API, /v1/messages and /v1/messages/count_tokens, as llama-server
and ollama serve it for clients written against it.

Messages hold text, tool_use (an assistant's calls), tool_result (their results) and
thinking blocks; tools are {name, description, input_schema}. The answer is content
blocks: a thinking model's thoughts (thinking), its text, its calls (tool_use). A stream
is server-sent events: message_start, each block's start / deltas / stop, message_delta
with the stop reason, message_stop. Errors are {"type": "error", "error": {...}}.
"""

from __future__ import annotations

import json
import uuid

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ...runtime.model.tool_calls import ToolCall
from .errors import ApiError
from .requests import (
    AnswerRequest,
    Finished,
    call_id,
    choose_tools,
    collect,
    get,
    prepare,
    read_json,
    run,
    sampling_of,
    stop_of,
    text_content,
)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
}


def error_response(err: ApiError) -> JSONResponse:
    kind = ERROR_TYPES.get(err.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    return JSONResponse(body, status_code=err.status)


# -- the request ------------------------------------------------------------------------


def _text(content, where: str) -> str:
    """A string, or text blocks."""
    if isinstance(content, list):
        content = [
            {"type": "text", "text": b.get("text", "")}
            if isinstance(b, dict) and b.get("type") == "text"
            else b
            for b in content
        ]
    return text_content(content, where)


def _messages(body: dict) -> list[dict]:
    """The chat the template renders: the system prompt, then each message; an assistant's
    tool_use blocks are its tool_calls, a user's tool_result blocks tool messages."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where} must have the role user or assistant", "messages")
        content = m.get("content")
        if not isinstance(content, list):
            out.append({"role": m["role"], "content": _text(content, where)})
            continue
        texts, calls, results, thought = [], [], [], ""
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                texts.append(get(block, "text", str, ""))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(400, f"{at} must have a tool_use_id", "messages")
                result = _text(block.get("content", ""), at)
                results.append(
                    {"role": "tool", "tool_call_id": block["tool_use_id"], "content": result}
                )
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                thought += block.get("thinking", "") if kind == "thinking" else ""
            else:
                raise ApiError(
                    400, f"{at}: blocks of type {kind!r} are not supported here", "messages"
                )
        out.extend(results)
        if texts or calls or not results:
            msg = {"role": m["role"], "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thought:
                msg["reasoning_content"] = thought
            out.append(msg)
    return out


def _tool_use(block: dict, where: str) -> dict:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise ApiError(400, f"{where} must have a name and an input object", "messages")
    call = {
        "type": "function",
        "function": {"name": block["name"], "arguments": block.get("input", {})},
    }
    if isinstance(block.get("id"), str):
        call["id"] = block["id"]
    return call


def _tools(body: dict) -> list[dict] | None:
    out = []
    for i, tool in enumerate(get(body, "tools", list, [])):
        custom = isinstance(tool, dict) and tool.get("type", "custom") == "custom"
        if not custom or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ApiError(
                400,
                f"tools[{i}]: only custom tools with a name are supported, not {kind!r}",
                "tools",
            )
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ApiError(400, f"tools[{i}].input_schema must be a JSON schema object", "tools")
        fn = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict, req: AnswerRequest) -> None:
    """tool_choice: {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}."""
    choice = get(body, "tool_choice", dict, {"type": "auto"})
    kind, name = choice.get("type"), choice.get("name")
    if kind in ("auto", "none", "any"):
        return choose_tools(req, "required" if kind == "any" else kind)
    if kind != "tool" or not isinstance(name, str):
        raise ApiError(
            400, "tool_choice type must be auto, any, none or tool (with a name)", "tool_choice"
        )
    choose_tools(req, "required", name)


def _answer_request(body: dict) -> AnswerRequest:
    max_tokens = get(body, "max_tokens", int, None, check=lambda v: v >= 1, must="at least 1")
    req = AnswerRequest(
        model=get(body, "model", str, None),
        messages=_messages(body),
        max_tokens=-1 if max_tokens is None else max_tokens,
        sampling=sampling_of(body),
        stop=stop_of(body.get("stop_sequences"), "stop_sequences"),
        stream=get(body, "stream", bool, False),
        tools=_tools(body),
    )
    _tool_choice(body, req)
    thinking = get(body, "thinking", dict, None)
    if thinking is not None:  # Qwen3's switch: "enabled" or "disabled"
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise ApiError(400, "thinking.type must be enabled or disabled", "thinking")
        req.template_vars = {"enable_thinking": kind == "enabled"}
    return req


# -- the response -----------------------------------------------------------------------


def _stop_reason(f: Finished, calls: list[ToolCall]) -> tuple[str, str | None]:
    a = f.answer
    if calls:
        return "tool_use", None
    if a.finish_reason == "length":
        return "max_tokens", None
    if a.stop_string:
        return "stop_sequence", a.stop_string
    return "end_turn", None


def _usage(f: Finished | None) -> dict:
    if f is None:
        return {"input_tokens": 0, "output_tokens": 0}
    a = f.answer
    return {
        "input_tokens": a.prompt_tokens - a.cached_tokens,
        "cache_read_input_tokens": a.cached_tokens,
        "output_tokens": len(a.tokens),
    }


def _tool_use_block(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": call_id(),
        "name": call.name,
        "input": call.arguments,
    }


async def messages(request: Request):
    app = request.app.state
    body = await read_json(request)
    req = _answer_request(body)
    p = await prepare(app.pool, req)
    message = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": req.model or p.loaded.name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }
    if not req.stream:
        text, finished = await collect(p, app.metrics, request)
        thought, text, calls = p.parts(text)
        content = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        if text or not calls:
            content.append({"type": "text", "text": text})
        content += [_tool_use_block(c) for c in calls]
        reason, sequence = _stop_reason(finished, calls)
        return JSONResponse(
            {**message, "content": content, "stop_reason": reason, "stop_sequence": sequence,
             "usage": _usage(finished)}
        )  # fmt: skip

    splitter = p.splitter()
    blocks: list[str] = []  # the kind of each block started

    def event(kind: str, **fields) -> dict:
        return {"event": kind, "data": json.dumps({"type": kind, **fields})}

    def piece(kind: str, text: str):
        """Events for `text` of a thinking or text block, starting it (and stopping the
        block before) if it is not the open one."""
        if not blocks or blocks[-1] != kind:
            if blocks:
                yield event("content_block_stop", index=len(blocks) - 1)
            blocks.append(kind)
            start = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            yield event("content_block_start", index=len(blocks) - 1, content_block=start)
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        yield event("content_block_delta", index=len(blocks) - 1, delta=delta)

    def pieces(thought: str, shown: str):
        if thought:
            yield from piece("thinking", thought)
        if shown:
            yield from piece("text", shown)

    async def events():
        yield event("message_start", message={**message, "usage": _usage(None)})
        try:
            async for item in run(p, app.metrics):
                if isinstance(item, Finished):
                    thought, rest, calls = splitter.finish()
                    for e in pieces(thought, rest):
                        yield e
                    if not calls and "text" not in blocks:
                        for e in piece("text", ""):  # an empty answer is an empty text block
                            yield e
                    if blocks:
                        yield event("content_block_stop", index=len(blocks) - 1)
                    for call in calls:
                        block = _tool_use_block(call)
                        blocks.append("tool_use")
                        at = len(blocks) - 1
                        yield event(
                            "content_block_start", index=at, content_block={**block, "input": {}}
                        )
                        delta = {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(call.arguments),
                        }
                        yield event("content_block_delta", index=at, delta=delta)
                        yield event("content_block_stop", index=at)
                    reason, sequence = _stop_reason(item, calls)
                    yield event(
                        "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                        usage=_usage(item),
                    )  # fmt: skip
                    yield event("message_stop")
                else:
                    for e in pieces(*splitter.feed(item)):
                        yield e
        except ApiError as err:  # after the headers went out: an error event ends it
            error = {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}
            yield event("error", error=error)

    return EventSourceResponse(events(), ping=15, shutdown_grace_period=3)


async def count_tokens(request: Request):
    """/v1/messages/count_tokens: the prompt's tokens, tools and system included."""
    body = await read_json(request)
    req = _answer_request(body)
    p = await prepare(request.app.state.pool, req)
    p.loaded.pending.discard(p)  # never run
    return JSONResponse({"input_tokens": len(p.ids)})


routes = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
