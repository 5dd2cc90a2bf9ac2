"""The application: the route table, API-key check, request counting and error handlers
(``create_app``), and running it under uvicorn until Ctrl-C or SIGTERM (``serve``).

Shutdown. On Ctrl-C or SIGTERM new generations get 503 and ``/health`` turns 503; running ones
get ``GRACEFUL_SHUTDOWN_S`` seconds to finish, then end with a 503 error (a final error event
when streaming); only then is the engine closed. A second Ctrl-C or SIGTERM ends the wait at
once: the running generations end with their 503 and the engine closes, its pass in progress
stopping within one block even in the middle of a prefill (``executor.serving``, "Stopping
promptly"), so the process exits within about a second.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import ipaddress
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from strata.common.errors import StrataError
from strata.common.gguf_file import SPLIT_NAME
from strata.executor.chat import DEFAULT_RENDER_WORKERS, RenderPool
from strata.executor.server.access_log import AccessLog
from strata.executor.server.generation import ServerState
from strata.executor.server.metrics import ServerMetrics
from strata.executor.server.protocol import APIError, ServerLimits
from strata.executor.server.routes import (
    chat_completions,
    completions,
    get_model,
    health,
    list_models,
    metrics,
    reset_prefix_cache,
)

if TYPE_CHECKING:
    from strata.executor.chat import ChatTemplate
    from strata.executor.serving import ServingEngine

GRACEFUL_SHUTDOWN_S = 5
"""Seconds running requests get to finish after Ctrl-C / SIGTERM before they are aborted."""

MAX_HEADER_BYTES = 64 * 2**10
"""Largest request head (request line and headers) read, in bytes; a larger one gets 431 and
the connection is closed. Real heads are well under 8 KiB (nginx refuses lines over 8 KiB,
Node.js heads over 16 KiB); without a cap a client could send one header of gigabytes."""

MAX_HEADERS = 100
"""Most header fields in a request (Apache's LimitRequestFields default); more get 431."""

KEEP_ALIVE_S = 5.0
"""Seconds an idle keep-alive connection stays open after a response (uvicorn's default)."""

DEFAULT_MAX_CONNECTIONS = 512
"""Default of ``serve --max-connections``: open connections (and requests in progress) past which
a new request gets 503 at once. Above the default batch plus ``DEFAULT_MAX_WAITING`` (256), and
well under the usual limit of 1024 open files per process."""

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/reset_prefix_cache",
)
"""The endpoints counted by name in ``strata_requests_total`` (any other path counts as
``other``; ``/v1/models/NAME`` as ``/v1/models``)."""


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"unknown route: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; use {allowed}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message).response(exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # A bug, not bad input: the traceback goes to the log, the client gets an error object.
    return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()


class _Gate:
    """ASGI middleware: the API key check on ``/v1/*`` and ``/reset_prefix_cache``, and the
    request counter by status."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500  # what an exception that escapes the app becomes

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            keyed = path.startswith("/v1") or path == "/reset_prefix_cache"
            if keyed and self.api_key and not self._authorized(scope):
                error = APIError(
                    401,
                    "invalid or missing API key; send the header 'Authorization: Bearer KEY'",
                    "authentication_error",
                    code="invalid_api_key",
                )
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            endpoint = path if path in ENDPOINTS else "other"
            if path.startswith("/v1/models/"):
                endpoint = "/v1/models"
            self.metrics.requests[(endpoint, status)] += 1

    def _authorized(self, scope: Scope) -> bool:
        # Compared as bytes: the header's raw bytes against the key's UTF-8, so that a
        # non-ASCII key sent as UTF-8 (as clients send it) matches; decoding the header as
        # Latin-1 and encoding it again as UTF-8 never would.
        assert self.api_key is not None
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(b" \t"), self.api_key.encode()
                )
        return False


def create_app(
    engine: ServingEngine,
    model_name: str,
    api_key: str | None = None,
    chat_template: ChatTemplate | None = None,
    access_log: bool = True,
    limits: ServerLimits | None = None,
    render_workers: int = DEFAULT_RENDER_WORKERS,
) -> Starlette:
    """The ASGI application over a started ``ServingEngine``.

    Args:
        engine: the serving engine (started by the caller, closed by the caller).
        model_name: the model's name in requests and ``/v1/models``.
        api_key: when given, every ``/v1/*`` and ``/reset_prefix_cache`` request needs
            ``Authorization: Bearer api_key``.
        chat_template: the chat completions' template in place of the GGUF's (given, or a
            built-in for a GGUF without one).
        access_log: write one line per request on stderr (``server.access_log``); False:
            none (``serve --quiet``).
        limits: the waiting-queue limit and body read timeout (default: ``ServerLimits()``).
        render_workers: chat template render workers (``chat.RenderPool``, started as chats
            need them; ``app.state.strata.renders.close()`` stops them).

    Raises:
        ChatError: ``render_workers`` outside 1..``chat.MAX_RENDER_WORKERS``.
    """
    server_metrics = ServerMetrics()
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        ],
        middleware=[  # outermost first: the log sees the key check's 401s too
            Middleware(AccessLog, enabled=access_log),
            Middleware(_Gate, api_key=api_key, metrics=server_metrics),
        ],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.strata = ServerState(
        engine,
        model_name,
        server_metrics,
        int(time.time()),
        chat_template=chat_template,
        limits=limits or ServerLimits(),
        renders=RenderPool(render_workers),
    )
    return app


# --------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port).

    Raises:
        StrataError: the host does not resolve or the address is in use or not allowed.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StrataError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise StrataError(
            f"cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host"
        ) from None
    return sock


def _refusal(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP response that closes the connection, with an OpenAI error object."""
    body = APIError(status, message).response().body
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


HTTPTOOLS_MISSING = "httptools is missing: reinstall with `bash scripts/setup.sh`"
"""The error of a server started without httptools (a pinned dependency, pyproject.toml)."""


def require_httptools() -> None:
    """Refuse to serve without httptools: uvicorn would fall back to h11, which caps a request
    head's size but has no head timeout (a client sending one byte a minute holds a connection
    for ever), so the server never runs without the checks of :func:`_guarded_protocol`.

    Raises:
        StrataError: httptools (or uvicorn's protocol over it) cannot be imported;
            ``HTTPTOOLS_MISSING``.
    """
    try:
        importlib.import_module("uvicorn.protocols.http.httptools_impl")
    except ImportError:
        raise StrataError(HTTPTOOLS_MISSING) from None


def _guarded_protocol(read_timeout_s: float) -> type:
    """uvicorn's httptools protocol with the limits uvicorn lacks: a request head (request line
    and headers) of at most ``MAX_HEADER_BYTES`` and ``MAX_HEADERS`` fields (else 431), sent
    within ``read_timeout_s`` seconds of the connection opening or of the last response
    (else 408; a connection that sent nothing is just closed). Each check closes the connection.
    Bytes are counted as they arrive, so at most one read (256 KiB) past the cap is buffered.
    There is no fallback: uvicorn's h11 protocol has no head timeout, so without httptools the
    server does not start (``serve`` checks first, :func:`require_httptools`).

    Raises:
        StrataError: httptools is missing (``HTTPTOOLS_MISSING``).
    """
    require_httptools()
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpTools(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()

        def _await_head(self) -> None:
            old = getattr(self, "_head_timer", None)
            if old is not None:
                old.cancel()
            self._in_head, self._head_bytes, self._head_fields = True, 0, 0
            self._refused, self._body_pending = False, False
            self._head_timer = self.loop.call_later(read_timeout_s, self._head_timeout)

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self._in_head, self._refused = False, True
            self._head_timer.cancel()
            if not self.transport.is_closing():
                self.transport.write(_refusal(status, reason, message))
                self.transport.close()

        def _head_timeout(self) -> None:
            if not self._in_head or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a pipelined request is being answered: not waiting on the client
            if self._head_bytes == 0:
                self.transport.close()  # idle: nothing to answer
                return
            self._refuse(
                408,
                "Request Timeout",
                f"the request head did not arrive within {read_timeout_s:g} s; send it whole",
            )

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if not self._in_head or self.transport.is_closing():
                return
            if self._head_bytes > MAX_HEADER_BYTES:
                self._refuse(
                    431,
                    "Request Header Fields Too Large",
                    f"the request head is over {MAX_HEADER_BYTES >> 10} KiB; send shorter headers",
                )

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_fields += 1
            if self._head_fields > MAX_HEADERS and not self._refused:
                self._refuse(
                    431,
                    "Request Header Fields Too Large",
                    f"the request has over {MAX_HEADERS} header fields; send fewer",
                )
            if not self._refused:
                super().on_header(name, value)

        def on_message_begin(self) -> None:
            self._head_fields = 0  # each pipelined request's fields are its own
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head, self._body_pending = False, True
            self._head_timer.cancel()
            if not self._refused:  # else the rest of what was read is parsed and dropped
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._body_pending = False
            if not self._refused:
                super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self._body_pending:  # answered before its body came (a 401, 404, 503): the
                self.transport.close()  # rest of the body is not the next request's head
                return
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

    return GuardedHttpTools


def _loopback(sock: socket.socket) -> bool:
    """Whether ``sock`` is bound to a loopback address (127.0.0.0/8, ::1)."""
    address = sock.getsockname()[0]
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _uvicorn_server(
    app: Starlette, ready: Callable[[], None], max_connections: int = DEFAULT_MAX_CONNECTIONS
):
    from types import FrameType

    import uvicorn

    state: ServerState = app.state.strata

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                ready()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            running = len(state.live)
            wait = (
                f": 1 running request gets up to {GRACEFUL_SHUTDOWN_S:g} s to finish"
                if running == 1
                else f": {running} running requests get up to {GRACEFUL_SHUTDOWN_S:g} s to finish"
                if running
                else ""
            )
            print(f"shutting down{wait}", file=sys.stderr, flush=True)
            # End running generations ourselves (a final error event, blocks freed) rather than
            # leaving them to uvicorn, which cancels their tasks after its own timeout.
            await state.drain(GRACEFUL_SHUTDOWN_S, lambda: self.force_exit)
            await super().shutdown(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # uvicorn forces the exit on a second SIGINT only; a second SIGTERM does too.
            if self.should_exit:
                self.force_exit = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises Ctrl-C / SIGTERM after its graceful shutdown, which would kill
            # the process before the engine is closed; stop quietly instead.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    http = _guarded_protocol(state.limits.read_timeout_s)  # no h11 fallback: it has no head timeout
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,  # ours, with tokens and times: server.access_log
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=http,  # type: ignore[arg-type]
        timeout_keep_alive=KEEP_ALIVE_S,  # type: ignore[arg-type]
        limit_concurrency=max_connections,
    )
    return Server(config)


def _close(serving, engine) -> None:
    """Stop the serving engine. On a cluster plan a rank that hangs (stopped, not dead: MLX's
    ring raises only when a peer's socket closes) holds the engine thread in a receive for
    ever; after ``GRACEFUL_SHUTDOWN_S`` the ranks are killed, which ends it, and failing that
    (a rank on another host) the process exits without it (a daemon thread)."""
    if engine.ranks is None:
        serving.close()
        return
    if serving.close(timeout=GRACEFUL_SHUTDOWN_S):
        return
    print(
        "a rank of the cluster does not answer (stopped or hung): stopping the ranks",
        file=sys.stderr,
        flush=True,
    )
    engine.pipeline.fail("the server stopped while a rank did not answer")  # nothing more sent
    engine.ranks.kill()
    if not serving.close(timeout=GRACEFUL_SHUTDOWN_S):
        print("the engine thread is still waiting on the ring; exiting without it", file=sys.stderr)


def default_model_name(loaded) -> str:
    """The plan's catalog model name, else the GGUF file's stem (a split model's without its
    ``-0000K-of-0000N`` shard suffix: the set's name)."""
    src = loaded.plan.model
    if src.name:
        return src.name
    name = Path(src.path or loaded.gguf.path).name
    m = SPLIT_NAME.match(name)
    return m["prefix"] if m else Path(name).stem


def serve(
    plan_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    batch_invariant: bool = False,
    *,
    model: str | None = None,
    check: Callable[[], str | Path] | None = None,
    chat_template: ChatTemplate | None = None,
    access_log: bool = True,
    limits: ServerLimits | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    render_workers: int = DEFAULT_RENDER_WORKERS,
) -> None:
    """Load a plan and serve it until Ctrl-C or SIGTERM (``strata serve``).

    Prints ``serving MODEL on http://HOST:PORT`` to stderr once requests are accepted.
    ``batch_invariant``: ``ServingEngine``'s mode of that name (``--batch-invariant``);
    ``model``: the GGUF file where it is not where the plan says (``--model``); ``check``:
    asked once the socket is bound, before the plan is loaded (a model given in place of a
    plan is planned, ``strata check``'s question asked): the plan file to load;
    ``chat_template``: the chat completions' template in place of the GGUF's (``--chat-template``;
    None: the GGUF's, else the built-in one for its architecture, said on stderr);
    ``access_log``: one line per request on stderr (False: ``--quiet``); ``limits``: the
    waiting-queue limit and read timeout (``--max-waiting``, ``--read-timeout``);
    ``max_connections``: open connections past which requests get 503 (``--max-connections``);
    ``render_workers``: chat template render workers (``--render-workers``; one started before
    requests are taken, the rest as chats overlap, all killed when the server stops).
    Warns on stderr when the address is not a loopback one and no API key is set.

    Raises:
        StrataError: httptools is missing (``HTTPTOOLS_MISSING``), the address cannot be used,
            or the plan cannot be loaded.
    """
    from strata.executor.chat import chat_template_for
    from strata.executor.engine import Engine
    from strata.executor.plan_loader import load_plan
    from strata.executor.serving import ServingEngine

    require_httptools()  # before binding and loading: the server never runs without its checks
    sock = bind_socket(host, port)  # before loading: a busy port fails in a second, not after
    if api_key is None and not _loopback(sock):
        print(
            f"warning: serving on {host} without an API key: anyone who can reach this address "
            "can use the model; set --api-key-file FILE (or $STRATA_API_KEY), or serve on "
            "127.0.0.1",
            file=sys.stderr,
            flush=True,
        )
    try:
        if check is not None:
            plan_path = check()
        loaded = load_plan(plan_path, model)
        engine = Engine(loaded)
        try:
            serving = ServingEngine(engine, batch_invariant=batch_invariant)
            try:
                if engine.config.warm_up_row_buckets:
                    print("building kernels for every batch size ...", file=sys.stderr, flush=True)
                warm = serving.start()
                if warm:
                    print(f"kernels built in {warm:.1f} s", file=sys.stderr, flush=True)
                name = model_name or default_model_name(loaded)
                template = chat_template_for(
                    engine.tokenizer, loaded.desc.architecture.name, chat_template
                )
                if template is not None and template.fallback:
                    print(f"chat completions: {template.name} (the GGUF has none)", file=sys.stderr)
                    chat_template = template
                bound = sock.getsockname()[1]
                shown = f"[{host}]" if ":" in host else host
                app = create_app(
                    serving, name, api_key, chat_template, access_log, limits, render_workers
                )
                renders: RenderPool = app.state.strata.renders
                try:
                    renders.start()  # the first chat pays no start-up

                    def ready() -> None:
                        print(
                            f"serving {name} on http://{shown}:{bound}", file=sys.stderr, flush=True
                        )

                    _uvicorn_server(app, ready, max_connections).run(sockets=[sock])
                finally:
                    renders.close()  # no worker outlives the server, even one mid-render
            finally:
                _close(serving, engine)
                print("stopped", file=sys.stderr, flush=True)
        finally:
            engine.close()
    finally:
        sock.close()
