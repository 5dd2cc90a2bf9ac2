"""A generation's HTTP response: server-sent events as its text becomes ready (``EventStream``,
ending with ``data: [DONE]``), or the whole text collected (``collect``). Both abort the
generation in the engine when the client goes away or the response ends any other way."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from strata.executor.server import access_log
from strata.executor.server.generation import Disconnected, Generation
from strata.executor.server.protocol import APIError
from strata.executor.serving import TokenLogprob

QUEUED_COMMENT = b": queued\n\n"
"""An SSE comment (clients ignore it) sent to a stream waiting for its first token."""

QUEUED_COMMENT_S = 3.0
"""Seconds between ``QUEUED_COMMENT``s while a stream waits for its first token: clients and
proxies commonly drop a connection silent for 30-60 s; a few seconds also tells a watching user
the request is queued, not lost."""


class EventStream(Response):
    """A server-sent-event response for one generation, aborting it if the client goes away.

    Args:
        generation: the submitted generation.
        chunks: the JSON objects to send, one ``data:`` event each (``[DONE]`` is added).
    """

    media_type = "text/event-stream"

    def __init__(self, generation: Generation, chunks: AsyncIterator[dict]):
        self.generation = generation
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        access_log.track(scope, self.generation)
        watcher = asyncio.create_task(self.generation.watch(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in self._with_comments(send):
                    await send(
                        {"type": "http.response.body", "body": _sse(chunk), "more_body": True}
                    )
            except APIError as e:  # the status is sent already: the error is the last event
                access_log.note(scope, f"stream ended with error {e.status}: {e.message}")
                await send(
                    {"type": "http.response.body", "body": _sse(e.body()), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except (Disconnected, OSError):
            access_log.note(scope, "client disconnected")  # the generation is aborted below
        except asyncio.CancelledError:
            access_log.note(scope, "cancelled")
            raise
        finally:
            watcher.cancel()
            self.generation.close()
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _with_comments(self, send: Send) -> AsyncIterator[dict]:
        """``self.chunks``, sending ``QUEUED_COMMENT`` every ``QUEUED_COMMENT_S`` seconds that
        none comes while the generation has no token yet."""
        chunks = aiter(self.chunks)
        while self.generation.first_token_at is None:  # a task per chunk only until then
            step = asyncio.ensure_future(anext(chunks))
            try:
                while not (await asyncio.wait({step}, timeout=QUEUED_COMMENT_S))[0]:
                    if self.generation.first_token_at is None:
                        comment = {"type": "http.response.body", "body": QUEUED_COMMENT}
                        await send({**comment, "more_body": True})
            finally:
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
            try:
                chunk = step.result()
            except StopAsyncIteration:
                return
            yield chunk
        async for chunk in chunks:
            yield chunk


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def collect(
    generation: Generation, request: Request
) -> tuple[str, str, list[tuple[int, TokenLogprob]] | None]:
    """The whole text, finish reason and logprob entries (None unless asked for) of a
    non-streamed generation; aborts it if the client disconnects while it runs."""
    access_log.track(request.scope, generation)
    watcher = asyncio.create_task(generation.watch(request.receive))
    text: list[str] = []
    lps: list[tuple[int, TokenLogprob]] | None = None
    try:
        async for piece in generation.pieces():
            text.append(piece.text)
            if piece.logprobs is not None:
                lps = lps if lps is not None else []
                lps.extend(piece.logprobs)
            if piece.finish_reason:
                if generation.request.logprobs is not None and lps is None:
                    lps = []
                return "".join(text), piece.finish_reason, lps
        raise AssertionError("pieces() ended without a finish reason")
    except Disconnected:
        access_log.note(request.scope, "client disconnected")
        # Nobody reads the answer; 499 (nginx's "client closed request") shows in /metrics.
        raise APIError(499, "the client closed the request") from None
    finally:
        watcher.cancel()
        generation.close()
