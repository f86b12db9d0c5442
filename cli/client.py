"""`infer run` as a client of a running `infer serve`: the same answer, without importing
torch or loading the model in this process.

Speaks the server's ollama API (/api/chat, /api/generate: newline-delimited JSON with
the timings in the last line) over the standard library's http.client, which costs
nothing to import. Only the standard library is imported here.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from .. import InferError

DEFAULT_ADDRESS = "127.0.0.1:11435"  # serve_cmd's default host and port


def server_address(host: str | None) -> tuple[str, int, bool]:
    """(host, port, named): --host, else INFER_HOST, else the default; `named` when
    --host names it (an unreachable server the command line names is worth a note)."""
    text = host or os.environ.get("INFER_HOST") or DEFAULT_ADDRESS
    url = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = url.port or 11435
    except ValueError:
        raise InferError(f"{'--host' if host else 'INFER_HOST'} {text!r}: bad port") from None
    return url.hostname or "127.0.0.1", port, host is not None


def connect(host: str, port: int, timeout: float = 0.25) -> http.client.HTTPConnection | None:
    """A connection to the server, or None when nothing listens there."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
    except OSError:
        conn.close()
        return None
    conn.sock.settimeout(None)  # an answer may take long between tokens
    return conn


@dataclass
class RemoteAnswer:
    """What the server's last line says, in the terms `infer run` prints."""

    text: str = ""
    thinking: str = ""  # a thinking model's thoughts, apart from text
    prompt_tokens: int = 0
    cached_tokens: int = 0
    n_generated: int = 0
    finish_reason: str = "stop"
    load_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    dropped: int = 0  # a chat's oldest messages the server dropped to fit the context
    asked: int = -1  # num_predict: a "length" answer shorter than this filled the context

    @property
    def prefill_tok_s(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.n_generated / self.decode_s if self.decode_s > 0 else 0.0

    def context_note(self) -> str | None:
        if self.finish_reason == "length" and (self.asked < 0 or self.n_generated < self.asked):
            return "note: the context is full (raise --ctx)"
        return None

    def stats_line(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"prompt {self.prompt_tokens} tok{cached}, {self.prefill_tok_s:.1f} tok/s | "
            f"generated {self.n_generated} tok, {self.decode_tok_s:.1f} tok/s | "
            f"TTFT {self.ttft_s:.2f} s | {self.finish_reason}"
        )


class NotServed(Exception):
    """The server does not serve this model (a file outside its folders): run locally."""


def ask(
    conn: http.client.HTTPConnection,
    body: dict,
    chat: bool,
    on_text: Callable[[str], None],
    api_key: str | None = None,
    on_thought: Callable[[str], None] | None = None,
) -> RemoteAnswer:
    """POST the request and stream the answer into `on_text` (a thinking model's
    thoughts into `on_thought`). Ctrl-C closes the connection (the server cancels the
    answer) and returns what came so far."""
    headers = auth_headers(api_key)
    path = "/api/chat" if chat else "/api/generate"
    answer = RemoteAnswer(asked=body.get("options", {}).get("num_predict", -1))
    try:
        conn.request("POST", path, json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise response_error(resp, body.get("model"))
        while line := resp.readline():
            msg = json.loads(line)
            if "error" in msg:
                raise InferError(str(msg["error"]), exit_code=1)
            part = msg["message"] if chat else msg
            if thought := part.get("thinking"):
                answer.thinking += thought
                if on_thought:
                    on_thought(thought)
            piece = part["content"] if chat else part.get("response", "")
            if piece:
                answer.text += piece
                on_text(piece)
            if msg.get("done"):
                _read_done(answer, msg)
                break
    except KeyboardInterrupt:
        answer.finish_reason = "interrupted"
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        raise InferError(f"the server's answer broke off: {e}", exit_code=1) from None
    finally:
        conn.close()
    return answer


def response_error(resp: http.client.HTTPResponse, model) -> Exception:
    try:
        message = json.loads(resp.read()).get("error", "")
    except ValueError:
        message = ""
    if resp.status == 404 and model and "not served here" in message:
        return NotServed(message)
    message = message or f"HTTP {resp.status}"
    if resp.status == 401:
        message += " (set INFER_API_KEY)"
    return InferError(message, exit_code=2 if 400 <= resp.status < 500 else 1)


def _read_done(answer: RemoteAnswer, msg: dict) -> None:
    ns = 1e9
    cached = int(msg.get("prompt_cache_count", 0))
    answer.cached_tokens = cached
    answer.prompt_tokens = int(msg.get("prompt_eval_count", 0)) + cached
    answer.n_generated = int(msg.get("eval_count", 0))
    answer.finish_reason = msg.get("done_reason") or "stop"
    answer.load_s = msg.get("load_duration", 0) / ns
    answer.ttft_s = msg.get("prompt_eval_duration", 0) / ns
    answer.decode_s = msg.get("eval_duration", 0) / ns
    answer.dropped = int(msg.get("messages_dropped", 0))


def auth_headers(api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


class RemoteModel:
    """The chat's model behind a server (cli/chat.py ChatModel): each turn sends the
    whole conversation, whose earlier turns the server's prefix cache still holds."""

    def __init__(self, host: str, port: int, name: str, ctx: int | None, api_key: str | None):
        self.host, self.port, self.name, self.ctx, self.api_key = host, port, name, ctx, api_key

    def _connect(self) -> http.client.HTTPConnection:
        conn = connect(self.host, self.port)
        if conn is None:
            raise InferError(f"the server at {self.host}:{self.port} is gone", exit_code=1)
        return conn

    def answer(
        self, messages: list[dict], settings, on_text, on_thought=None
    ) -> tuple[RemoteAnswer, int]:
        options = settings.options()
        if self.ctx:
            options["num_ctx"] = self.ctx
        body = request_body(
            self.name, options, messages, fmt=settings.format, grammar=settings.grammar
        )
        if settings.think is not None:
            body["think"] = settings.think
        answer = ask(self._connect(), body, True, on_text, self.api_key, on_thought)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        del messages[first : first + answer.dropped]  # as the server did
        return answer, answer.dropped

    def complete(self, prompt: str, settings, on_text) -> RemoteAnswer:
        options = settings.options()
        if self.ctx:
            options["num_ctx"] = self.ctx
        body = request_body(
            self.name, options, None, prompt, fmt=settings.format, grammar=settings.grammar
        )
        return ask(self._connect(), body, False, on_text, self.api_key)

    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """Each text's embedding from the server's /api/embed, and the tokens it read."""
        body: dict = {"model": self.name, "input": texts}
        if self.ctx:
            body["options"] = {"num_ctx": self.ctx}
        conn = self._connect()
        try:
            conn.request("POST", "/api/embed", json.dumps(body), auth_headers(self.api_key))
            resp = conn.getresponse()
            if resp.status != 200:
                raise response_error(resp, self.name)
            out = json.loads(resp.read())
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise InferError(f"the server's answer broke off: {e}", exit_code=1) from None
        finally:
            conn.close()
        return out["embeddings"], int(out.get("prompt_eval_count", 0))

    def info_rows(self) -> list[list[str]]:
        conn = self._connect()
        try:
            conn.request(
                "POST", "/api/show", json.dumps({"model": self.name}), auth_headers(self.api_key)
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise response_error(resp, None)
            show = json.loads(resp.read())
        finally:
            conn.close()
        info, details = show.get("model_info", {}), show.get("details", {})
        arch = info.get("general.architecture", "?")
        return [
            ["architecture", arch],
            ["parameters", str(details.get("parameter_size", "?"))],
            ["context length", str(info.get(f"{arch}.context_length", "?"))],
            ["quantization", str(details.get("quantization_level", "?"))],
            ["server", f"{self.host}:{self.port}"],
        ]

    def stream_line(self) -> str | None:
        return None


def request_body(
    model: str,
    options: dict,
    messages: list[dict] | None,
    prompt: str = "",
    fmt=None,
    grammar: str | None = None,
) -> dict:
    """A streamed /api/chat body with `messages`, else an /api/generate one completing
    `prompt` as raw text; `fmt`: "json" or a JSON schema the answer must follow, or
    `grammar` a GBNF grammar (llama-server's field, which `infer serve` takes too)."""
    body: dict = {"model": model, "stream": True, "options": options}
    if fmt is not None:
        body["format"] = fmt
    if grammar is not None:
        body["grammar"] = grammar
    if messages is not None:
        body["messages"] = messages
    else:
        body.update(prompt=prompt, raw=True)
    return body


def model_reference(model: str) -> str:
    """A model as the server should read it: an existing path made absolute (the
    server's working directory is not ours), a name as it is."""
    if os.path.exists(os.path.expanduser(model)):
        return os.path.abspath(os.path.expanduser(model))
    return model


def served_model(host: str | None, model: str | None, ctx: int | None, check: bool = False):
    """The model behind a running `infer serve` (a RemoteModel), or None when no server
    listens (or, with `check`, when it does not serve this model)."""
    from ..runtime.registry import DEFAULT_MODEL

    address, port, named = server_address(host)
    conn = connect(address, port)
    if conn is None:
        if named:
            print(f"note: no server at {address}:{port}; running here", file=sys.stderr)
        return None
    conn.close()
    name = model_reference(model) if model else DEFAULT_MODEL
    remote = RemoteModel(address, port, name, ctx, os.environ.get("INFER_API_KEY"))
    if check:
        try:
            remote.info_rows()  # an unknown name fails here, before the chat starts
        except NotServed:
            return None
    return remote
