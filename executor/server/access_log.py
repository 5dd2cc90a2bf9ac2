"""The server's access log: one line on stderr per HTTP request, written when its response has
ended (a streamed one when its stream ends), e.g.::

    POST /v1/chat/completions 200 prompt=12 completion=32 ttft=85ms total=1203ms
    GET /health 200 total=0ms
    POST /v1/completions 200 prompt=5 completion=7 ttft=40ms total=311ms (client disconnected)

Fields: method, path, status; for a request that generated, its prompt and completion tokens
(the engine's counts, as in the response's ``usage``) and the time to its first token; the
request's total time. Times are in milliseconds from the moment the request reached the server
(parsing and tokenizing included). What the status cannot tell follows in parentheses: a client
that went away mid-stream, a stream that ended with an error event (its status was sent as 200
before the error), a generation ended by the server's shutdown.

``AccessLog`` is the ASGI middleware that times the request and writes the line; the responses
that run a generation (``streaming.EventStream``, ``streaming.collect``) attach it with
``track`` and say what happened with ``note``. Uvicorn's own access log stays off
(``app._uvicorn_server``); ``serve --quiet`` leaves this one out.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from strata.executor.server.generation import Generation

_KEY = "strata.access"
"""The ASGI scope key of a request's ``_Record``."""


@dataclass
class _Record:
    """What the response tells the log about one request: its generation (None: it generated
    nothing) and what happened that the status does not say."""

    start: float
    generation: Generation | None = None
    note: str | None = None


def track(scope: Scope, generation: Generation) -> None:
    """Attach the request's generation, whose token counts and first token's time the line
    reports (no-op when the access log is off)."""
    record = scope.get(_KEY)
    if record is not None:
        record.generation = generation


def note(scope: Scope, what: str) -> None:
    """Say what happened to the request that its status cannot (``client disconnected``); the
    first note is kept (no-op when the access log is off)."""
    record = scope.get(_KEY)
    if record is not None and record.note is None:
        record.note = what


class AccessLog:
    """ASGI middleware: writes the access-log line of every HTTP request once its response has
    ended (or failed: an exception that escapes the app is logged as status 500).

    Args:
        app: the application.
        enabled: False writes nothing (``serve --quiet``).
    """

    def __init__(self, app: ASGIApp, enabled: bool = True):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        record = _Record(time.perf_counter())
        scope[_KEY] = record
        status = 500  # what an exception that escapes the app becomes

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            line = access_line(scope["method"], scope["path"], status, record)
            try:
                print(line, file=sys.stderr, flush=True)
            except (OSError, ValueError):  # stderr closed or gone: the request is served anyway
                pass


def access_line(method: str, path: str, status: int, record: _Record) -> str:
    """The log line of one request (see the module docstring); times to the millisecond. The
    method and path are percent-encoded again (the server hands them over decoded), so that no
    request writes a line break, a forged line or a terminal escape into the log."""
    end = time.perf_counter()
    parts = [quote(method, safe=""), quote(path, safe=_PATH_SAFE), str(status)]
    gen = record.generation
    if gen is not None:
        parts += [f"prompt={gen.prompt_tokens}", f"completion={gen.completion_tokens}"]
        if gen.first_token_at is not None:
            parts.append(f"ttft={_ms(gen.first_token_at - record.start)}")
    parts.append(f"total={_ms(end - record.start)}")
    line = " ".join(parts)
    return f"{line} ({record.note})" if record.note else line


_PATH_SAFE = "/:@!$&'()*+,;=-._~"
"""Characters a path keeps as they are (RFC 3986's path characters); every other one, spaces and
control characters included, is written as %XX."""


def _ms(seconds: float) -> str:
    return f"{max(0.0, seconds) * 1000:.0f}ms"
