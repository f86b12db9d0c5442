"""ollama's model management: /api/pull (fetch a model into the cache, as `infer pull`
does) and /api/delete (remove it, as `infer rm`).

A pull runs `infer pull` in a child process: a client that leaves, or a server that
stops, sends it SIGTERM, and it removes its temporaries as the command does (a pull of
parts keeps what it has joined, to go on from). Its progress lines come back as
ollama's {"status": ...} lines, then {"status": "success"} or {"error": ...}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ... import InferError
from .errors import ApiError
from .requests import get, read_json

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BAR = re.compile(r"[\u2500-\u259f|#]+")  # progress bars' glyphs
# "64.0/253.1 MB" (pip's and our bars), "1.13G/2.50G" (the hub's): bytes done of a total
_AMOUNT = re.compile(r"([\d.]+)\s*([kMG]?)i?B?\s*/\s*([\d.]+)\s*([kMG]i?B?|B)\b")
_UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}
# pip's lines about where it looks: nothing a client can use
_NOISE = ("Looking in indexes", "Looking in links", "WARNING: Location")


def _status(line: str) -> dict | None:
    """One progress line as ollama's status object (with completed and total bytes when
    the line has them); None for a line not worth passing on."""
    line = " ".join(_BAR.sub(" ", line).split())
    if not line or line.startswith(_NOISE):
        return None
    status = {"status": line}
    if m := _AMOUNT.search(line):
        total_unit = _UNITS[m[4][0] if m[4][0] in "kMG" else ""]
        done_unit = _UNITS[m[2]] if m[2] else total_unit
        status.update(completed=int(float(m[1]) * done_unit), total=int(float(m[3]) * total_unit))
    return status


def _name(body: dict) -> str:
    name = get(body, "model", str, None) or get(body, "name", str, None)
    if not name:
        raise ApiError(400, "model is required: the name of the model to pull or delete", "model")
    return name


async def pull(request: Request):
    body = await read_json(request)
    name = _name(body)
    stream = get(body, "stream", bool, True)
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "INFER_DEBUG": ""}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infer.cli.main", "pull", name,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip

    async def statuses():
        """{"status"} lines as the pull goes, then success, or the error it ended with."""
        try:
            yield {"status": f"pulling {name}"}
            last = ""
            while chunk := await proc.stderr.read(4096):
                for line in re.split(r"[\r\n]+", _ANSI.sub("", chunk.decode("utf-8", "replace"))):
                    if line := line.strip():
                        last = line
                        status = _status(line)
                        if status and not line.startswith("error: "):  # said once, at the end
                            yield status
            code = await proc.wait()
            if code == 0:
                yield {"status": "success"}
            else:
                message = last.removeprefix("error: ") or f"the pull failed (exit status {code})"
                yield {"error": message, "_status": 400 if code == 2 else 500}
        finally:  # a client gone, or the server stopping: the child cleans up and ends
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                with anyio.CancelScope(shield=True):
                    await proc.wait()

    if not stream:
        final = None
        async for status in statuses():
            final = status
        if "error" in final:
            raise ApiError(final["_status"], final["error"], "model")
        return JSONResponse({"status": "success"})

    async def lines():
        async for status in statuses():
            status.pop("_status", None)
            yield json.dumps(status) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def delete(request: Request):
    from ...runtime.registry import remove_cached

    name = _name(await read_json(request))
    try:
        await anyio.to_thread.run_sync(remove_cached, name)
    except InferError as e:
        raise ApiError(404, str(e), "model") from None
    return Response(status_code=200)


routes = [
    Route("/api/pull", pull, methods=["POST"]),
    Route("/api/delete", delete, methods=["DELETE", "POST"]),
]
