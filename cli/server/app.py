"""The ASGI app: both APIs' routes, /health and /metrics, and what every request passes
through (an API key, a body-size limit, the request counters). `serve` runs it under
uvicorn until SIGTERM or Ctrl-C, which cancel the answers in flight and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ... import __version__
from . import anthropic_api, llamacpp_api, ollama_api, ollama_models, openai_api, responses_api
from .errors import ApiError
from .metrics import Metrics
from .pool import ModelPool, ServeSettings

MAX_BODY = 16 * 1024 * 1024  # bytes: far beyond any context's worth of text

# Origins whose web pages may call the server from a browser, as ollama lets them by
# default: pages served from this machine, desktop apps' and editors' webviews, browser
# extensions. Any other site the user visits may not read its answers.
LOCAL_ORIGINS = (
    r"https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?"
    r"|(app|file|tauri|vscode-webview|vscode-file)://.*"
    r"|(chrome-extension|moz-extension|safari-web-extension)://.*"
)


def _error_response(path: str, err: ApiError):
    """Each API's own error shape; OpenAI's for the rest."""
    if path.startswith("/api/"):
        return ollama_api.error_response(err)
    if path.startswith("/v1/messages"):
        return anthropic_api.error_response(err)
    return openai_api.error_response(err)


class Guard:
    """Pure ASGI middleware (it must not buffer streams): the API key, the body limit,
    and counting each request by path and status."""

    def __init__(self, app, api_key: str | None, metrics: Metrics, paths: set[str]):
        self.app, self.api_key, self.metrics, self.paths = app, api_key, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = 500

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            # /health stays open, for load balancers and supervisors: it tells nothing.
            if self.api_key is not None and path != "/health" and not self._authorized(scope):
                err = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)")
                return await _error_response(path, err)(scope, receive, counted_send)
            headers = dict(scope["headers"])
            length = headers.get(b"content-length", b"0")
            if not length.isdigit() or int(length) > MAX_BODY:
                err = ApiError(413, f"the request body is over {MAX_BODY // 2**20} MiB")
                return await _error_response(path, err)(scope, receive, counted_send)
            await self.app(scope, _limited(receive), counted_send)
        finally:
            self.metrics.request(path if path in self.paths else "other", status)

    def _authorized(self, scope) -> bool:
        """`Authorization: Bearer KEY`, or Anthropic's clients' `x-api-key: KEY`."""
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        key = headers.get(b"x-api-key")
        if key is not None:
            return hmac.compare_digest(key, self.api_key.encode())
        return hmac.compare_digest(bearer, f"Bearer {self.api_key}".encode())


def _limited(receive):
    """`receive` that stops a chunked body (no Content-Length) at MAX_BODY."""
    seen = 0

    async def receive_limited():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY // 2**20} MiB")
        return message

    return receive_limited


def create_app(
    settings: ServeSettings, api_key: str | None = None, on_ready=None, on_fail=None
) -> CORSMiddleware:
    """The app; `.state.pool` holds the models once it has started. `on_ready()` is
    called when the command line's models are loaded; `on_fail(message)`, if given, when
    one of them cannot be (else the start fails with the error)."""
    metrics = Metrics()

    async def health(request: Request):
        pool = request.app.state.pool
        return JSONResponse({"status": "ok", "models_loaded": len(pool.loaded)})

    async def metrics_text(request: Request):
        return PlainTextResponse(
            metrics.render(request.app.state.pool), media_type="text/plain; version=0.0.4"
        )

    async def api_error(request: Request, err: ApiError):
        return _error_response(request.url.path, err)

    async def http_error(request: Request, err: HTTPException):
        return _error_response(request.url.path, ApiError(err.status_code, str(err.detail)))

    async def server_error(request: Request, err: Exception):
        print(f"error: {request.url.path}: {type(err).__name__}: {err}", file=sys.stderr)
        return _error_response(request.url.path, ApiError(500, f"internal error: {err}"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        pool = ModelPool(settings)
        app.state.pool = pool
        reaper = None
        try:
            try:
                for name in settings.models:  # the command line's models are ready at start
                    await pool.get(name)
            except ApiError as err:
                if on_fail is None:
                    raise
                on_fail(err.message)  # the server stops at once, and says why
            else:
                reaper = asyncio.ensure_future(pool.reap())
                if on_ready is not None:
                    on_ready()
            yield
        finally:
            if reaper is not None:
                reaper.cancel()
            pool.cancel_all()
            pool.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        *openai_api.routes,
        *responses_api.routes,
        *anthropic_api.routes,
        *ollama_api.routes,
        *ollama_models.routes,
        *llamacpp_api.routes,
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
    app.state.metrics = metrics
    app.state.model_names = lambda: _model_names(app.state.pool)
    paths = {r.path for r in routes}
    # outermost, so that a browser's preflight (which carries no key) is answered here,
    # and even a refusal reaches the page that asked
    extra = settings.cors_origins
    cors = CORSMiddleware(
        Guard(app, api_key, metrics, paths), allow_origins=extra,
        allow_origin_regex=None if "*" in extra else LOCAL_ORIGINS,
        allow_methods=["*"], allow_headers=["*"],
    )  # fmt: skip
    cors.state = app.state
    return cors


def _model_names(pool: ModelPool) -> list[str]:
    """What /v1/models lists: the command line's models, those loaded, those on disk."""
    from ...runtime.registry import list_cached

    names = [*pool.settings.models, *(m.name for m in pool.loaded.values())]
    names += [m.name for m in list_cached()]
    return list(dict.fromkeys(names))


def serve(settings: ServeSettings, host: str, port: int, api_key: str | None) -> None:
    """Run until SIGTERM or Ctrl-C: stop accepting, cancel what is in flight, exit 0."""
    import socket

    import uvicorn

    from ... import InferError

    try:  # bound here, so that a port in use is one clear line
        sock = socket.create_server((host, port), family=_family(host), reuse_port=False)
    except OSError as e:
        raise InferError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    bound = sock.getsockname()[1]

    def ready() -> None:
        print(f"infer {__version__}: serving on http://{_url_host(host)}:{bound}", file=sys.stderr)

    failed: list[str] = []

    def fail(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    guarded = create_app(settings, api_key, on_ready=ready, on_fail=fail)
    state = guarded.state

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # exit 0, not by re-raising the signal
            if hasattr(state, "pool"):
                state.pool.cancel_all()

    config = uvicorn.Config(
        guarded, log_level="warning", timeout_graceful_shutdown=5, server_header=False
    )
    server = Server(config)
    server.run(sockets=[sock])
    if failed:  # a model of the command line did not load: one line, exit 2
        raise InferError(failed[0])


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
