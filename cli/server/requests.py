"""What both APIs share: reading a JSON body with typed fields, the answer request
both turn theirs into, and running it on a model's scheduler as an async stream.

Unknown fields are ignored, as clients send many; a known field of the wrong type or
out of range is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import anyio
from starlette.requests import ClientDisconnect, Request

from ... import InferError
from ...runtime.answer import Answer, answer_room, fit_chat
from ...runtime.generate import Penalties
from ...runtime.model.thinking import ThoughtSplitter, opens_thought, split_thoughts
from ...runtime.model.tool_calls import CallSplitter, ToolCall, call_schema, parse_calls, tool_names
from ...runtime.scheduler import Job, Sampling
from ...runtime.structured import compile_format, compile_grammar, compile_tool_call
from .errors import ApiError
from .pool import Loaded, ModelPool, parse_keep_alive

NUMBER = (int, float)


async def read_json(request: Request) -> dict:
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before the whole body came: nothing to answer
        raise ApiError(499, "the client closed the connection") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def get(body: dict, key: str, types, default=None, *, check=None, must: str = ""):
    """`body[key]` if present and not null, checked against `types` (bool is never a
    number) and `check`; else `default`. A number comes back as a float; an integer
    must fit in 64 bits (torch's seeds and sizes)."""
    value = body.get(key)
    if value is None:
        return default
    names = {
        str: "a string",
        bool: "true or false",
        int: "an integer",
        float: "a number",
        dict: "an object",
        list: "a list",
    }
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        expected = " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))
        raise ApiError(400, f"{key} must be {expected}, not {json.dumps(value)[:40]}", key)
    if isinstance(value, int) and not isinstance(value, bool):
        if float in types:
            value = float(value) if value.bit_length() <= 1000 else math.inf
        elif not -(2**63) <= value < 2**63:
            raise ApiError(400, f"{key} is out of range: {str(value)[:40]}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{key} must be a finite number", key)
    if check is not None and not check(value):
        raise ApiError(400, f"{key} must be {must}, not {json.dumps(body[key])[:40]}", key)
    return value


def sampling_of(fields: dict) -> Sampling:
    """The sampling settings both APIs name alike (OpenAI's body, ollama's options)."""
    positive = {"check": lambda v: v >= 0, "must": "at least 0"}
    unit = {"check": lambda v: 0 <= v <= 1, "must": "from 0 to 1"}
    return Sampling(
        temperature=get(fields, "temperature", NUMBER, 0.8, **positive),
        top_k=get(fields, "top_k", int, 40, **positive),
        top_p=get(fields, "top_p", NUMBER, 0.95, **unit),
        min_p=get(fields, "min_p", NUMBER, 0.05, **unit),
        seed=get(fields, "seed", int, None),
    )


def text_content(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts of which only text is
    understood."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}: only text content is supported, not {kind}", where)
            texts.append(get(part, "text", str, ""))
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", where)


def messages_of(body: dict) -> list[dict]:
    """The chat as templates take it: role and text content, an assistant's tool_calls
    (arguments as objects) and reasoning_content, a tool result's tool_call_id and name."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a role", "messages")
        # OpenAI's newer clients send their instructions as "developer": templates know
        # them as "system"
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": text_content(m.get("content"), where)}
        calls = get(m, "tool_calls", list, [])
        if calls:
            msg["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        for key in ("tool_call_id", "name", "tool_name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        # An earlier answer's thoughts as clients send them back (ollama's thinking,
        # OpenAI's reasoning_content): Qwen3's template writes those of a turn in progress.
        thought = m.get("thinking") or m.get("reasoning_content")
        if isinstance(thought, str) and thought:
            msg["reasoning_content"] = thought
        out.append(msg)
    return out


def _tool_call(call, where: str) -> dict:
    """An earlier call, OpenAI's (arguments a JSON string) or ollama's (an object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} must be an object with a function and its name", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ApiError(400, f"{where}: arguments is not valid JSON", "messages") from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object", "messages")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def tools_of(body: dict) -> list[dict] | None:
    """`tools`, both APIs' shape: [{"type": "function", "function": {"name", "description",
    "parameters"}}]; None when none are given."""
    tools = get(body, "tools", list, [])
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(fn, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("parameters", {}), dict)
        ):
            raise ApiError(
                400,
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                f'"parameters": {{...}}}}}}',
                "tools",
            )
    return tools or None


def stop_of(value, key: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ApiError(400, f"{key} must be a string or a list of strings", key)


def call_id() -> str:
    """A new tool call's id: nine letters and digits, the only ids Mistral's templates
    take back (others raise in the template: the next turn would be a 400)."""
    return uuid.uuid4().hex[:9]


def choose_tools(req: AnswerRequest, mode: str, name: str | None = None) -> None:
    """Each API's tool_choice, read: "auto" (the model may call a tool), "none" (no tools
    offered), "required" (the answer is a call: of `name`, if given)."""
    if mode == "auto" or req.tools is None:
        return
    if mode == "none":
        req.tools = None
        return
    if name is not None and name not in tool_names(req.tools):
        raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    req.call_required, req.call_name = True, name
    if req.format is not None or req.grammar is not None:
        raise ApiError(
            400, f"give {req.format_param} or grammar, or a required tool call, not both",
            "tool_choice",
        )  # fmt: skip


EFFORTS = ("none", "minimal", "low", "medium", "high")


def effort_of(effort: str | None, req: AnswerRequest, key: str) -> None:
    """OpenAI's reasoning effort as a thinking template's switch: "none" answers at once,
    any other thinks first (Qwen3's enable_thinking); nothing when not given."""
    if effort is None:
        return
    if effort not in EFFORTS:
        raise ApiError(400, f"{key} must be one of {', '.join(EFFORTS)}, not {effort!r}", key)
    req.template_vars = {"enable_thinking": effort != "none", **(req.template_vars or {})}


def grammar_of(body: dict, req: AnswerRequest) -> None:
    """`grammar`: a llama.cpp grammar (GBNF), as llama-server takes it; not with a format."""
    req.grammar = get(body, "grammar", str, None) or None
    if req.grammar is not None and req.format is not None:
        raise ApiError(400, f"give {req.format_param} or grammar, not both", "grammar")


def keep_alive_of(body: dict) -> float | None | bool:
    """ollama's keep_alive in seconds (None: forever), or False when not given."""
    if body.get("keep_alive") is None:
        return False
    try:
        return parse_keep_alive(body["keep_alive"])
    except ValueError as e:
        raise ApiError(400, str(e), "keep_alive") from None


@dataclass
class AnswerRequest:
    """One answer either API asks for, in the scheduler's terms."""

    model: str | None
    messages: list[dict] | None = None  # a chat, or
    prompt: str | None = None  # raw text to complete
    suffix: str | None = None  # the code after the gap: the prompt is the code before it
    files: list[tuple[str, str]] = field(default_factory=list)  # (name, text): FIM context
    middle: str = ""  # the start of the middle, already written (llama.cpp's infill prompt)
    prompt_ids: list[int] | None = None  # a prompt given as token ids (llama-server's)
    max_tokens: int = -1  # < 0: until the model stops or the context is full
    sampling: Sampling = field(default_factory=Sampling)
    penalties: Penalties | None = None
    stop: tuple[str, ...] = ()
    context: int | None = None
    keep_alive: float | None | bool = False
    stream: bool = False
    truncate: bool = False  # drop a chat's oldest messages when it does not fit (ollama)
    format: str | dict | None = None  # "json" or a JSON schema the answer must follow
    format_param: str = "format"  # the field it came from, for errors
    grammar: str | None = None  # a llama.cpp grammar (GBNF) the answer must follow
    tools: list[dict] | None = None  # offered to the model (a chat's template lists them)
    template_vars: dict | None = None  # more for the chat template (Qwen3's enable_thinking)
    think: bool | None = None  # ollama's think: true is a 400 for a model that cannot
    thoughts_apart: bool = True  # a thinking model's thoughts apart from its answer's text
    logprobs: int | None = None  # each token's log probability, and this many others'
    call_required: bool = False  # the answer must be a call (of call_name, if given)
    call_name: str | None = None


@dataclass(eq=False)  # hashed by identity, for Loaded.pending
class Prepared:
    """A request made ready: its model, prompt ids, and the job's fields."""

    loaded: Loaded
    ids: list[int]
    request: AnswerRequest
    dropped: int = 0  # oldest messages dropped to fit the context
    constraint: object | None = None  # the format's or grammar's matcher, one per answer
    logprobs: list = field(default_factory=list)  # TokenLogprobs of text not yet sent

    def take_logprobs(self) -> list[dict]:
        """The log probabilities of the tokens since the last call, as both APIs give
        them: token, logprob, bytes, top_logprobs."""
        entries, self.logprobs = self.logprobs, []
        return [logprob_json(self.loaded.lm.tokenizer, e) for e in entries]

    def answer_logprobs(self, answer: Answer) -> list[dict]:
        """Every token's of a whole answer (a response that is not streamed)."""
        return [logprob_json(self.loaded.lm.tokenizer, e) for e in answer.logprobs]

    # Whether the answer's thoughts come apart from its text (a chat with a thinking
    # model's template), and whether the prompt opened the thought already.
    thoughts: bool = False
    thought_open: bool = False

    def parts(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """A whole answer's thoughts, its text, and its tool calls (none unless the
        request offered tools)."""
        thought, text = split_thoughts(text, self.thought_open) if self.thoughts else ("", text)
        tools = self.request.tools
        text, calls = parse_calls(text, tool_names(tools)) if tools else (text, [])
        return thought, text, calls

    def another(self, seed: int | None) -> Prepared:
        """A further answer to the same prompt (OpenAI's n), sampled with `seed`: its own
        job, grammar position and log probabilities. Call it before this one runs."""
        req = replace(self.request, sampling=replace(self.request.sampling, seed=seed))
        constraint = self.constraint.copy() if self.constraint is not None else None
        other = replace(self, request=req, constraint=constraint, logprobs=[])
        self.loaded.pending.add(other)
        return other

    def splitter(self) -> AnswerSplitter:
        return AnswerSplitter(
            ThoughtSplitter(self.thought_open) if self.thoughts else None,
            CallSplitter(tool_names(self.request.tools)) if self.request.tools else None,
        )


class AnswerSplitter:
    """An answer's text as it streams, into what both APIs send apart: `feed` gives the
    (thoughts, text) to send now; text that may begin a tool call is held until it is
    known to be one. `finish` gives the rest, and the calls."""

    def __init__(self, thoughts: ThoughtSplitter | None, calls: CallSplitter | None):
        self._thoughts, self._calls = thoughts, calls

    def feed(self, piece: str) -> tuple[str, str]:
        thought, text = self._thoughts.feed(piece) if self._thoughts else ("", piece)
        return thought, self._calls.feed(text) if self._calls and text else text

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        thought, text = self._thoughts.finish() if self._thoughts else ("", "")
        if self._calls is None:
            return thought, text, []
        shown = self._calls.feed(text) if text else ""
        rest, calls = self._calls.finish()
        return thought, shown + rest, calls


def logprob_json(tok, e) -> dict:
    def one(token: int, logprob: float) -> dict:
        raw = tok.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}


def logprobs_of(body: dict, on: bool, key: str = "top_logprobs") -> int | None:
    """How many alternatives each token's log probability comes with, or None (off)."""
    top = get(body, key, int, 0, check=lambda v: 0 <= v <= 20, must="from 0 to 20")
    return top if on else None


async def prepare(pool: ModelPool, req: AnswerRequest) -> Prepared:
    """Load the model, encode the prompt and check it fits (4xx before anything streams)."""
    loaded = await pool.get(req.model, req.keep_alive)
    tok = loaded.lm.tokenizer
    if req.think and not tok.thinks:
        raise ApiError(400, f"{loaded.name} does not support thinking", "think")
    limit = min(req.context or loaded.context, loaded.context)
    dropped = 0
    if req.messages is not None:
        # Without truncation every message must fit: a budget of all the context.
        room = answer_room(limit, req.max_tokens) if req.max_tokens > 0 else 0
        budget = limit - room if req.truncate else math.inf
        if req.tools is not None and tok.tool_format is None:
            raise ApiError(400, f"{loaded.name} does not support tools", "tools")
        try:
            ids, dropped = fit_chat(tok, req.messages, budget, req.tools, req.template_vars)
        except InferError as e:  # the template refused these messages
            raise ApiError(400, str(e), "messages") from None
    elif req.suffix is not None:  # fill in the middle
        if tok.fim_ids is None:
            raise ApiError(400, f"{loaded.name} does not support insert", "suffix")
        ids = tok.encode_infill(req.prompt or "", req.suffix, req.files, req.middle)
    elif req.prompt_ids is not None:
        if any(not 0 <= t < tok.vocab_size for t in req.prompt_ids):
            raise ApiError(400, "prompt has a token id past the vocabulary", "prompt")
        ids = list(req.prompt_ids)
    else:
        ids = tok.encode(req.prompt or "")
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    if req.penalties and any(t >= tok.vocab_size for t, _ in req.penalties.bias):
        raise ApiError(
            400, f"logit_bias names a token id past the vocabulary ({tok.vocab_size})", "logit_bias"
        )
    if len(ids) > limit:
        raise ApiError(
            400,
            f"the prompt is {len(ids)} tokens, longer than the context of {limit} tokens",
            "messages" if req.messages is not None else "prompt",
        )
    constraint = None
    compile_args, param = None, ""
    if req.format is not None:
        compile_args, param = (compile_format, tok, req.format), req.format_param
    elif req.grammar is not None:
        compile_args, param = (compile_grammar, tok, req.grammar), "grammar"
    elif req.call_required and req.tools:
        fmt = tok.tool_format
        schema = call_schema(req.tools, req.call_name, fmt.key)
        compile_args, param = (compile_tool_call, tok, schema, fmt.tagged), "tools"
    if compile_args is not None:  # off the event loop: the first one builds an index
        try:
            grammar = await anyio.to_thread.run_sync(*compile_args)
        except InferError as e:
            raise ApiError(400, f"{param}: {e}", param) from None
        constraint = grammar.matcher()
    prepared = Prepared(loaded, ids, req, dropped, constraint)
    if req.messages is not None and req.thoughts_apart and tok.thinks:
        prepared.thoughts = True
        # A constrained answer is the grammar's from its first token: no thought is open
        # (it has one only where the grammar writes the tags)
        prepared.thought_open = constraint is None and opens_thought(tok.decode(ids[-16:]))
    loaded.pending.add(prepared)  # until `run` ends (or it is dropped, never run)
    return prepared


@dataclass
class Finished:
    answer: Answer
    queued_s: float  # waiting for the model before prefill began


async def run(p: Prepared, metrics) -> AsyncIterator[str | Finished]:
    """Submit the answer to the model's scheduler; yield text pieces (with logprobs, their
    tokens' are then in p.take_logprobs()), then Finished. Closing the iterator early (a
    client gone) cancels the job and frees its slot."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def on_event(kind: str, value) -> None:  # on the scheduler's thread
        try:
            if kind == "done":  # counted here: a client gone no longer reads the events
                loop.call_soon_threadsafe(metrics.answered, value, queued())
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def queued() -> float:
        return (job.started or job.submitted) - job.submitted

    req = p.request
    job = Job(
        p.ids,
        req.max_tokens,
        on_event,
        req.sampling,
        req.penalties,
        req.stop,
        req.context,
        p.constraint,
        req.logprobs,
    )
    if p.loaded.scheduler.stopped:
        raise ApiError(
            503, "the model was unloaded: the server is stopping, or its keep-alive ended"
        )
    p.loaded.scheduler.submit(job)
    try:
        while True:
            kind, value = await events.get()
            if kind == "logprobs":  # the next piece's tokens': take_logprobs() gives them
                p.logprobs.extend(value)
            elif kind == "text":
                yield value
            elif kind == "done":
                yield Finished(value, queued())
                return
            elif isinstance(value, InferError):  # the request's fault unless it says
                raise ApiError(getattr(value, "http_status", 400), str(value)) from value
            else:  # a bug: its traceback for the log, a 500 for the client
                traceback.print_exception(value, file=sys.stderr)
                raise ApiError(500, f"internal error: {type(value).__name__}: {value}")
    finally:
        job.cancel()  # no-op once done; a client gone mid-answer frees the slot at once
        p.loaded.touch()
        p.loaded.pending.discard(p)


async def run_all(ps: list[Prepared], metrics) -> AsyncIterator[tuple[int, str | Finished, list]]:
    """Several answers run at once (OpenAI's n), merged as they come: (index, item, the
    logprobs of a text piece's tokens). Closing it early cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, p: Prepared) -> None:
        try:
            async for item in run(p, metrics):
                queue.put_nowait((i, item, p.take_logprobs() if isinstance(item, str) else []))
        except Exception as e:  # noqa: BLE001  (raised where the answers are read)
            queue.put_nowait((i, e, []))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(ps)]
    try:
        left = len(ps)
        while left:
            i, item, entries = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= isinstance(item, Finished)
            yield i, item, entries
    finally:
        for t in tasks:
            t.cancel()


async def collect(p: Prepared, metrics, request: Request) -> tuple[str, Finished]:
    """The whole answer, for a response that is not streamed."""
    return (await collect_all([p], metrics, request))[0]


async def collect_all(ps: list[Prepared], metrics, request: Request) -> list[tuple[str, Finished]]:
    """Whole answers (OpenAI's n: several at once). Starlette does not tell a handler that
    its client went away, so this listens for the disconnect itself and cancels the
    answers then, freeing their slots (as a stream's end does)."""

    async def answer(p: Prepared) -> tuple[str, Finished]:
        text, finished = [], None
        async for item in run(p, metrics):
            if isinstance(item, Finished):
                finished = item
            else:
                text.append(item)
        return "".join(text), finished

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for t in tasks:
            t.cancel()

    tasks = [asyncio.ensure_future(answer(p)) for p in ps]
    watcher = asyncio.ensure_future(watch())
    try:
        return list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:
        if not watcher.done():
            raise  # the server is cancelling this handler
        raise ApiError(499, "the client closed the connection") from None
    finally:
        watcher.cancel()
        for t in tasks:  # one answer failed: the others stop too
            t.cancel()
