"""llama-server's own endpoints, for clients written against it: /completion, /infill
(llama.vim and llama.vscode complete code through it), /tokenize, /detokenize, /props.

Their fields are llama-server's (n_predict, n_probs, input_prefix...); a stream is
server-sent events of {"content", "stop"}, the last with "stop": true and the timings.
Errors are OpenAI's shape, as llama-server's are.
"""

from __future__ import annotations

import json

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ...runtime.generate import Penalties
from .errors import ApiError
from .requests import (
    NUMBER,
    AnswerRequest,
    Finished,
    collect,
    get,
    grammar_of,
    logprobs_of,
    prepare,
    read_json,
    run,
    sampling_of,
    stop_of,
)


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _answer_request(body: dict) -> AnswerRequest:
    fields = dict(body)
    if isinstance(fields.get("seed"), int) and fields["seed"] < 0:
        fields.pop("seed")  # -1: a random seed
    n_predict = get(body, "n_predict", int, -1, check=lambda v: v != 0, must="-1 or more")
    penalties = Penalties(
        repeat=get(body, "repeat_penalty", NUMBER, 1.0, check=lambda v: v > 0, must="more than 0"),
        frequency=get(body, "frequency_penalty", NUMBER, 0.0),
        presence=get(body, "presence_penalty", NUMBER, 0.0),
        last_n=get(body, "repeat_last_n", int, 64, check=lambda v: v >= -1, must="-1 or more"),
    )
    schema = get(body, "json_schema", dict, None)
    req = AnswerRequest(
        model=get(body, "model", str, None),
        max_tokens=n_predict if n_predict > 0 else -1,
        sampling=sampling_of(fields),
        penalties=None if penalties.off else penalties,
        stop=stop_of(body.get("stop")),
        stream=get(body, "stream", bool, False),
        format=schema,
        format_param="json_schema",
        logprobs=logprobs_of(body, body.get("n_probs", 0) != 0, "n_probs"),
    )
    grammar_of(body, req)
    return req


def _stop_type(a) -> str:
    if a.finish_reason == "length":
        return "limit"
    return "word" if a.stop_string else "eos"


def _final(f: Finished, model: str) -> dict:
    """The fields of a finished answer, as llama-server gives them."""
    a = f.answer
    prompt_s = f.queued_s + a.ttft_s
    computed = a.prompt_tokens - a.cached_tokens
    return {
        "stop": True,
        "model": model,
        "tokens_predicted": len(a.tokens),
        "tokens_evaluated": a.prompt_tokens,
        "tokens_cached": a.cached_tokens,
        "truncated": False,
        "stop_type": _stop_type(a),
        "stopping_word": a.stop_string,
        "timings": {
            "prompt_n": computed,
            "prompt_ms": prompt_s * 1e3,
            "prompt_per_second": computed / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": len(a.tokens),
            "predicted_ms": a.decode_s * 1e3,
            "predicted_per_second": a.n_decoded / a.decode_s if a.decode_s > 0 else 0.0,
        },
    }


async def _complete(request: Request, req: AnswerRequest):
    app = request.app.state
    p = await prepare(app.pool, req)
    model = req.model or p.loaded.name
    if not req.stream:
        text, finished = await collect(p, app.metrics, request)
        out = {"content": text, **_final(finished, model)}
        if req.logprobs is not None:
            out["completion_probabilities"] = p.answer_logprobs(finished.answer)
        return JSONResponse(out)

    async def events():
        try:
            async for item in run(p, app.metrics):
                if isinstance(item, Finished):
                    yield {"data": json.dumps({"content": "", **_final(item, model)})}
                else:
                    out = {"content": item, "stop": False}
                    if req.logprobs is not None:
                        out["completion_probabilities"] = p.take_logprobs()
                    yield {"data": json.dumps(out)}
        except ApiError as err:  # after the headers went out: an error event ends it
            yield {"data": json.dumps({"error": {"message": err.message, "type": "server_error"}})}

    return EventSourceResponse(events(), ping=15, shutdown_grace_period=3)


async def completion(request: Request):
    """/completion: prompt (text or token ids) -> its continuation."""
    body = await read_json(request)
    req = _answer_request(body)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and not _token_ids(prompt):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        req.prompt = prompt
    elif _token_ids(prompt) and prompt:
        req.prompt_ids = prompt
    else:
        raise ApiError(400, "prompt must be a string or token ids (one prompt a request)", "prompt")
    return await _complete(request, req)


async def infill(request: Request):
    """/infill: the code around the cursor (input_prefix, input_suffix), what is typed of
    the middle already (prompt), and other files for context (input_extra: [{filename,
    text}]) -> the middle."""
    body = await read_json(request)
    req = _answer_request(body)
    req.prompt = get(body, "input_prefix", str, "")
    req.suffix = get(body, "input_suffix", str, "")
    req.middle = get(body, "prompt", str, "")
    for i, chunk in enumerate(get(body, "input_extra", list, [])):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str):
            raise ApiError(400, f"input_extra[{i}] must be {{filename, text}}", "input_extra")
        req.files.append((get(chunk, "filename", str, "tmp"), chunk.get("text", "")))
    return await _complete(request, req)


async def tokenize(request: Request):
    """/tokenize: content -> tokens (with_pieces: each with its text)."""
    body = await read_json(request)
    tok = await _tokenizer(request, body)
    content = get(body, "content", str, "")
    ids = tok.encode(content, add_special=get(body, "add_special", bool, False))
    if get(body, "with_pieces", bool, False):
        pieces = [tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
        return JSONResponse({"tokens": [{"id": i, "piece": s} for i, s in zip(ids, pieces)]})
    return JSONResponse({"tokens": ids})


async def detokenize(request: Request):
    """/detokenize: tokens -> content."""
    body = await read_json(request)
    tok = await _tokenizer(request, body)
    ids = body.get("tokens", [])
    if not _token_ids(ids) or any(not 0 <= t < tok.vocab_size for t in ids):
        raise ApiError(400, "tokens must be token ids of the model's vocabulary", "tokens")
    return JSONResponse({"content": tok.decode(ids)})


async def props(request: Request):
    """/props: what llama-server's clients read of it, for a model (?model=NAME; default
    the server's): its context a slot, slots, template and file."""
    from ... import __version__

    loaded = await request.app.state.pool.get(request.query_params.get("model"), False)
    loaded.touch()
    return JSONResponse(
        {
            "default_generation_settings": {"n_ctx": loaded.context},
            "total_slots": len(loaded.scheduler.slots),
            "model_path": str(loaded.resolved.path),
            "chat_template": loaded.lm.tokenizer.chat_template or "",
            "build_info": f"infer {__version__}",
        }
    )


async def _tokenizer(request: Request, body: dict):
    loaded = await request.app.state.pool.get(get(body, "model", str, None), False)
    loaded.touch()
    return loaded.lm.tokenizer


routes = [
    Route("/completion", completion, methods=["POST"]),
    Route("/completions", completion, methods=["POST"]),
    Route("/infill", infill, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/props", props, methods=["GET"]),
]
