"""`infer ps` and `infer stop`: the models a running `infer serve` holds, and unloading
one, as ollama's commands do. Registered by main.py. Only the standard library: neither
imports torch."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Annotated

import typer

from .. import InferError
from .common import human_bytes, print_json, print_table
from .options import Debug, Json, ServerHost


def ps(host: ServerHost = None, json_out: Json = False, debug: Debug = False) -> None:
    """List the models a running server holds: name, size, context, until when."""
    models = _request(host, "GET", "/api/ps")["models"]
    if json_out:
        print_json(models)
        return
    rows = [
        [
            m["name"],
            human_bytes(m["size"]),
            str(m.get("context_length", "-")),
            _until(m["expires_at"]),
        ]
        for m in models
    ]
    print_table(["NAME", "SIZE", "CONTEXT", "UNTIL"], rows)


def stop(
    model: Annotated[str, typer.Argument(help="The loaded model to unload.", metavar="MODEL")],
    host: ServerHost = None,
    debug: Debug = False,
) -> None:
    """Unload a model from a running server now (its answers in flight finish first)."""
    loaded = [m["name"] for m in _request(host, "GET", "/api/ps")["models"]]
    if model not in loaded:
        held = ", ".join(loaded) or "none"
        raise InferError(f"{model!r} is not loaded (loaded: {held})", exit_code=1)
    _request(host, "POST", "/api/generate", {"model": model, "keep_alive": 0})


def _request(host: str | None, method: str, path: str, body: dict | None = None) -> dict:
    from .client import auth_headers, connect, response_error, server_address

    address, port, _ = server_address(host)
    conn = connect(address, port)
    if conn is None:
        raise InferError(f"no server at {address}:{port} (start one: infer serve)", exit_code=1)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, auth_headers(os.environ.get("INFER_API_KEY")))
        resp = conn.getresponse()
        if resp.status != 200:
            raise response_error(resp, None)
        return json.loads(resp.read())
    finally:
        conn.close()


def _until(expires_at: str) -> str:
    """ollama's expiry time as how long from now ("forever" for its far-off year)."""
    when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    left = (when - datetime.now(timezone.utc)).total_seconds()
    if left > 100 * 365 * 86400:
        return "forever"
    minutes, seconds = divmod(max(0, int(left)), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"
