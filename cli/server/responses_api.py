"""OpenAI's Responses API, /v1/responses, without state (as ollama serves it): each
request carries the whole conversation; `previous_response_id` is refused.

The input is a string or a list of items (messages, earlier function_call and
function_call_output items); the output a list of items: the model's reasoning (a
thinking model's thoughts), a message with its output_text, function_call items. A
stream is server-sent events, each naming its type: response.created, the items' and
their parts' added / delta / done events, then response.completed (or .incomplete).
"""

from __future__ import annotations

import json
import time
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
    effort_of,
    get,
    grammar_of,
    prepare,
    read_json,
    run,
    sampling_of,
    text_content,
)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- the request ------------------------------------------------------------------------


def _messages(body: dict) -> list[dict]:
    """The chat the template renders: `instructions` as the system message, then each
    input item as a message; consecutive function_call items are one assistant turn."""
    out = []
    if (instructions := get(body, "instructions", str, None)) is not None:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if (
                last
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise ApiError(400, f"{where} must have a call_id and an output string", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # earlier thoughts: templates leave them out of later turns
        else:
            raise ApiError(400, f"{where}: items of type {kind!r} are not supported", "input")
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or parts of type input_text / output_text."""
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ApiError(400, f"{where}: only text content is supported, not {kind}", "input")
            parts.append({"type": "text", "text": part.get("text", "")})
        content = parts
    return text_content(content, where)


def _function_call(item: dict, where: str) -> dict:
    name, args = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(args, str):
        raise ApiError(400, f"{where} must have a name and arguments as a JSON string", "input")
    try:
        arguments = json.loads(args) if args.strip() else {}
    except ValueError:
        raise ApiError(400, f"{where}: arguments is not valid JSON", "input") from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object", "input")
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(item.get("call_id"), str):
        call["id"] = item["call_id"]
    return call


def _tools(body: dict) -> list[dict] | None:
    """tools, the Responses API's flat shape ({"type": "function", "name", "parameters"})
    as the chat templates take them."""
    out = []
    for i, tool in enumerate(get(body, "tools", list, [])):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ApiError(
                400, f"tools[{i}]: only function tools are supported, not {kind!r}", "tools"
            )
        if not isinstance(tool.get("name"), str) or not isinstance(
            tool.get("parameters", {}), dict
        ):
            raise ApiError(400, f"tools[{i}] must have a name and parameters", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: dict, req: AnswerRequest) -> None:
    """tool_choice: "auto" (the default), "none", "required", or {"type": "function",
    "name": NAME}."""
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", "none", "required"):
        return choose_tools(req, choice)
    name = choice.get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise ApiError(
            400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
            "tool_choice",
        )  # fmt: skip
    choose_tools(req, "required", name)


def _format(body: dict) -> str | dict | None:
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "name", "schema"}."""
    fmt = get(get(body, "text", dict, {}), "format", dict, None)
    kind = get(fmt or {}, "type", str, "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return fmt["schema"]
    raise ApiError(
        400, "text.format must be text, json_object or json_schema with a schema", "text"
    )


def _answer_request(body: dict) -> AnswerRequest:
    if body.get("previous_response_id") is not None:
        raise ApiError(
            400, "previous_response_id is not supported: responses are not stored; "
            "send the whole conversation as input", "previous_response_id",
        )  # fmt: skip
    max_tokens = get(
        body, "max_output_tokens", int, None, check=lambda v: v >= 1, must="at least 1"
    )
    req = AnswerRequest(
        model=get(body, "model", str, None),
        messages=_messages(body),
        max_tokens=-1 if max_tokens is None else max_tokens,
        sampling=sampling_of(body),
        stream=get(body, "stream", bool, False),
        format=_format(body),
        format_param="text.format",
        tools=_tools(body),
    )
    grammar_of(body, req)
    _tool_choice(body, req)
    effort_of(get(get(body, "reasoning", dict, {}), "effort", str, None), req, "reasoning.effort")
    return req


# -- the response -----------------------------------------------------------------------


class Output:
    """A response's output items as they come: the reasoning, the message, the calls."""

    def __init__(self):
        self.items: list[dict] = []
        self.reasoning: dict | None = None
        self.message: dict | None = None

    def reasoning_item(self) -> tuple[dict, bool]:
        """The reasoning item, and whether it is new."""
        if self.reasoning is None:
            self.reasoning = {"type": "reasoning", "id": _id("rs"), "summary": [],
                              "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
            self.items.append(self.reasoning)
            return self.reasoning, True
        return self.reasoning, False

    def message_item(self) -> tuple[dict, bool]:
        if self.message is None:
            self.message = {"type": "message", "id": _id("msg"), "status": "in_progress",
                            "role": "assistant",
                            "content": [{"type": "output_text", "text": "", "annotations": []}]}  # fmt: skip
            self.items.append(self.message)
            return self.message, True
        return self.message, False

    def call_item(self, call: ToolCall) -> dict:
        item = {"type": "function_call", "id": _id("fc"), "call_id": call_id(),
                "name": call.name, "arguments": json.dumps(call.arguments),
                "status": "completed"}  # fmt: skip
        self.items.append(item)
        return item


def _response(
    common: dict, output: Output, finished: Finished | None, status: str | None = None
) -> dict:
    out = {**common, "status": status or "in_progress", "output": output.items}
    if finished is not None:
        a = finished.answer
        cut = a.finish_reason == "length"
        out["status"] = status or ("incomplete" if cut else "completed")
        out["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
        out["usage"] = {
            "input_tokens": a.prompt_tokens,
            "input_tokens_details": {"cached_tokens": a.cached_tokens},
            "output_tokens": len(a.tokens),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": a.prompt_tokens + len(a.tokens),
        }
    return out


async def responses(request: Request):
    app = request.app.state
    body = await read_json(request)
    req = _answer_request(body)
    p = await prepare(app.pool, req)
    common = {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": req.model or p.loaded.name,
        "incomplete_details": None,
        "usage": None,
    }
    output = Output()
    if not req.stream:
        text, finished = await collect(p, app.metrics, request)
        thought, text, calls = p.parts(text)
        if thought:
            output.reasoning_item()[0]["content"][0]["text"] = thought
        if text or not calls:
            message = output.message_item()[0]
            message["content"][0]["text"] = text
            message["status"] = "completed"
        for call in calls:
            output.call_item(call)
        return JSONResponse(_response(common, output, finished))

    splitter = p.splitter()
    sequence = 0

    def event(kind: str, **fields) -> dict:
        nonlocal sequence
        sequence += 1
        return {
            "event": kind,
            "data": json.dumps({"type": kind, "sequence_number": sequence, **fields}),
        }

    def index(item: dict) -> int:
        return output.items.index(item)

    def thoughts(piece: str):
        item, new = output.reasoning_item()
        if new:
            yield event("response.output_item.added", output_index=index(item), item=item)
        item["content"][0]["text"] += piece
        yield event(
            "response.reasoning_text.delta", item_id=item["id"], output_index=index(item),
            content_index=0, delta=piece,
        )  # fmt: skip

    done_items: set[str] = set()

    def text(piece: str):
        yield from close_reasoning()  # the thoughts end where the answer begins
        item, new = output.message_item()
        part = item["content"][0]
        if new:
            yield event(
                "response.output_item.added", output_index=index(item), item={**item, "content": []}
            )
            yield event(
                "response.content_part.added", item_id=item["id"], output_index=index(item),
                content_index=0, part=part,
            )  # fmt: skip
        part["text"] += piece
        yield event(
            "response.output_text.delta", item_id=item["id"], output_index=index(item),
            content_index=0, delta=piece, logprobs=[],
        )  # fmt: skip

    def close_reasoning():
        item = output.reasoning
        if item is not None and item["id"] not in done_items:
            done_items.add(item["id"])
            yield event(
                "response.reasoning_text.done", item_id=item["id"], output_index=index(item),
                content_index=0, text=item["content"][0]["text"],
            )  # fmt: skip
            yield event("response.output_item.done", output_index=index(item), item=item)

    def close_message():
        item = output.message
        if item is not None and item["id"] not in done_items:
            done_items.add(item["id"])
            part = item["content"][0]
            at = {"item_id": item["id"], "output_index": index(item), "content_index": 0}
            yield event("response.output_text.done", **at, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **at, part=part)
            item["status"] = "completed"
            yield event("response.output_item.done", output_index=index(item), item=item)

    def pieces(thought: str, shown: str):
        if thought:
            yield from thoughts(thought)
        if shown:
            yield from text(shown)

    def calls_events(calls: list[ToolCall]):
        for call in calls:
            item = output.call_item(call)
            at = {"output_index": index(item)}
            yield event("response.output_item.added", **at, item={**item, "arguments": ""})
            yield event(
                "response.function_call_arguments.delta", item_id=item["id"], **at,
                delta=item["arguments"],
            )  # fmt: skip
            yield event(
                "response.function_call_arguments.done", item_id=item["id"], **at,
                arguments=item["arguments"],
            )  # fmt: skip
            yield event("response.output_item.done", **at, item=item)

    async def events():
        yield event("response.created", response=_response(common, output, None))
        yield event("response.in_progress", response=_response(common, output, None))
        try:
            async for item in run(p, app.metrics):
                if isinstance(item, Finished):
                    thought, rest, calls = splitter.finish()
                    for e in pieces(thought, rest):
                        yield e
                    if not calls and output.message is None:
                        for e in text(""):  # an empty answer is an empty message
                            yield e
                    for e in (*close_reasoning(), *close_message()):
                        yield e
                    for e in calls_events(calls):
                        yield e
                    done = _response(common, output, item)
                    kind = (
                        "response.incomplete"
                        if done["status"] == "incomplete"
                        else "response.completed"
                    )
                    yield event(kind, response=done)
                else:
                    for e in pieces(*splitter.feed(item)):
                        yield e
        except ApiError as err:  # after the headers went out: a failed response ends it
            failed = {**_response(common, output, None, "failed"),
                      "error": {"code": "server_error", "message": err.message}}  # fmt: skip
            yield event("response.failed", response=failed)

    return EventSourceResponse(events(), ping=15, shutdown_grace_period=3)


routes = [Route("/v1/responses", responses, methods=["POST"])]
