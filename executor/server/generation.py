"""One request's path from the engine thread to its HTTP response, and the state the handlers
share (``ServerState``: the engine, the counters, the live generations).

Threads. Uvicorn runs one asyncio event loop that parses requests, tokenizes prompts and writes
responses; all model work happens on the engine thread of ``executor.serving.ServingEngine``,
which batches every running request into each step (continuous batching). A request is submitted
with a callback that the engine thread calls with each ``TokenEvent``; the callback only hands the
event to the loop (``_Mailbox``: one ``loop.call_soon_threadsafe`` per batch of events) into the
request's own queue, so the engine never touches asyncio objects and never waits on a client.

Back-pressure. The engine thread never blocks on HTTP: a slow reader only makes its own queue
grow, and that queue is bounded by the request's ``max_tokens``. When several events are queued
the response drains them all and writes one chunk, so a slow client gets fewer, larger chunks
instead of holding up the batch; the socket writes themselves wait on uvicorn's flow control.
Requests beyond the batch limits wait in the scheduler (first come, first served), at most
``ServerLimits.max_waiting`` of them (``serve --max-waiting``): past that a request gets 429 with
``Retry-After`` at once rather than an unbounded wait; a waiting stream gets SSE comments
(``streaming.QUEUED_COMMENT``) until its first token, so that clients and proxies see it alive.
A chat waits for one of the server's chat template render workers (``ServerState.renders``) at
most ``chat.RENDER_WAIT_S``, then gets 503 with ``Retry-After``.

Disconnects. Each generating request has a watcher task on the ASGI ``receive`` channel; when
the client goes away (``http.disconnect``) it wakes the request's queue, which then aborts the
request in the engine (``ServingEngine.abort``) so its KV blocks return to the pool at once, even
while the request is still waiting for its first token. Every exit path (a finished request, a
stop string, an error, a cancelled task) goes through the same abort, which the engine makes
idempotent.

Text. Token ids become text through a ``StreamDecoder`` (never a split UTF-8 character); stop
strings are matched on that text by ``StopMatcher``. End-of-generation tokens finish the request
with ``"stop"`` and add no text.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import Receive
from strata.common.errors import StrataError
from strata.executor.chat import RenderPool
from strata.executor.grammar import GRAMMAR_FAILED
from strata.executor.sampling import SamplingParams
from strata.executor.server.metrics import ServerMetrics
from strata.executor.server.protocol import APIError, ServerLimits, engine_error
from strata.executor.server.stop import StopMatcher
from strata.executor.serving import GenerationRequest, TokenEvent, TokenLogprob

if TYPE_CHECKING:
    from strata.executor.chat import ChatTemplate
    from strata.executor.serving import ServingEngine


class Disconnected(Exception):
    """The client went away."""


_DISCONNECTED = object()  # queue sentinel put by the disconnect watcher
_SHUTDOWN = object()  # queue sentinel put when the server stops with the request still running


@dataclass
class Piece:
    """Text that is ready to send, and the finish reason once the request is done.

    ``logprobs``: for a request that asked for them, ``(token id, TokenLogprob)`` of each token
    read since the last piece (its text may still be held back by the UTF-8 decoder or a
    possible stop string); an end-of-generation token left out of the text is left out here too.
    """

    text: str
    finish_reason: str | None = None
    logprobs: list[tuple[int, TokenLogprob]] | None = None


class Generation:
    """One request's path from the engine thread to the HTTP response.

    Args:
        state: the server's state.
        request_id: the engine's request id (also the response's ``id``).
        prompt_ids: the prompt's token ids (checked against the context already).
        max_tokens: most tokens to generate.
        params: sampling parameters.
        stop: stop strings.
        ignore_eos: keep generating past end-of-generation tokens.
        logprobs: None, or the alternatives per token whose log-probabilities to report.
        grammar: None, or the llguidance grammar every generated token must fit.
        keep: control tokens written into the text as their own text rather than dropped (a
            tool-call format's markers, ``server.tool_calls.control_markers``; end-of-generation
            tokens are never text).
    """

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        params: SamplingParams,
        stop: list[str],
        ignore_eos: bool,
        logprobs: int | None = None,
        grammar: str | None = None,
        keep: frozenset[int] = frozenset(),
    ):
        self.state = state
        self.request_id = request_id
        self.request = GenerationRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            params=params,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            grammar=grammar,
        )
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False
        self._ignore_eos = ignore_eos
        self._queue: asyncio.Queue = asyncio.Queue()
        self._decoder = state.engine.tokenizer.stream_decoder()
        self._keep = keep
        self._stop = StopMatcher(stop)
        self._t_submit = 0.0
        self._t_first: float | None = None
        self._t_last = 0.0

    def submit(self) -> None:
        """Hand the request to the engine.

        Raises:
            APIError: 400 for a request the engine refuses (StrataError), 503 while the server
                shuts down or after a cluster plan's rank stopped (its message), 500 otherwise.
        """
        if self.state.closing:
            self.finished = True
            raise APIError(503, "the server is shutting down; retry elsewhere", "server_error")
        failure = self.state.engine.failure  # a cluster plan's rank stopped: nothing can run
        if failure is not None:
            self.finished = True
            raise APIError(503, failure, "server_error")
        self.state.check_queue()
        mailbox = self.state.mailbox(asyncio.get_running_loop())
        put = self._queue.put_nowait

        def on_event(event: TokenEvent) -> None:  # on the engine thread
            mailbox.post(put, (time.perf_counter(), event))

        self._t_submit = time.perf_counter()
        try:
            self.state.engine.submit(self.request, on_event)
        except StrataError as e:
            self.finished = True
            raise APIError(400, str(e)) from None
        except Exception as e:
            self.finished = True
            raise engine_error(f"the engine refused the request: {e}") from e
        self.state.live.add(self)
        self.state.metrics.prompt_tokens += self.prompt_tokens

    @property
    def first_token_at(self) -> float | None:
        """When the engine produced the first token (``time.perf_counter`` seconds), or None
        before it (the access log's TTFT)."""
        return self._t_first

    def client_gone(self) -> None:
        """Called by the disconnect watcher: wakes ``pieces``, which stops the request."""
        self._queue.put_nowait(_DISCONNECTED)

    def shut_down(self) -> None:
        """Called when the server stops: ``pieces`` ends the request with a 503 error."""
        self._queue.put_nowait(_SHUTDOWN)

    async def watch(self, receive: Receive) -> None:
        """Wait for ``http.disconnect`` on ``receive`` (run as a task; cancel it when done)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone()
                return

    def close(self) -> None:
        """Abort the request in the engine unless it finished (frees its KV blocks)."""
        self.state.live.discard(self)
        if not self.finished:
            self.finished = True
            self.state.engine.abort(self.request_id)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text as it becomes safe to send; the last piece carries the finish reason.

        Raises:
            Disconnected: the client went away (the caller closes the generation).
            APIError: the engine failed on this request (500) or was shut down (503).
        """
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():  # a slow reader gets what piled up as one chunk
                batch.append(self._queue.get_nowait())
            piece = self._consume(batch)
            if piece.text or piece.finish_reason or piece.logprobs:
                yield piece
            if piece.finish_reason:
                return

    def _consume(self, batch: list) -> Piece:
        text: list[str] = []
        lps: list[tuple[int, TokenLogprob]] | None = None if self.request.logprobs is None else []
        eog = self.state.engine.tokenizer.eog_ids
        for item in batch:
            if item is _DISCONNECTED:
                raise Disconnected
            if item is _SHUTDOWN:
                raise APIError(503, "the server is shutting down; retry elsewhere", "server_error")
            t, event = item
            self.prompt_tokens = event.prompt_tokens
            self.cached_tokens = event.cached_tokens
            for k, tok in enumerate(event.token_ids):
                self._count_token(t)
                if tok in eog and not self._ignore_eos:
                    continue  # the end-of-generation token ends the reply, it is not in its text
                if lps is not None and event.logprobs is not None:
                    lps.append((tok, event.logprobs[k]))
                emit, hit = self._stop.push(self._text_of(tok))
                text.append(emit)
                if hit:
                    self._finish()
                    self.close()  # frees the blocks now; later events are not read
                    return Piece("".join(text), "stop", lps)
            if event.finish_reason == "error":
                self.finished = True
                if (event.error or "").startswith(GRAMMAR_FAILED):  # the request's own grammar
                    raise APIError(400, event.error or "")
                raise engine_error(f"the engine failed on this request: {event.error}")
            if event.finish_reason == "abort":
                self.finished = True
                raise APIError(
                    503, "the request was aborted: the server is shutting down", "server_error"
                )
            if event.finish_reason:
                self.finished = True
                emit, hit = self._stop.push(self._decoder.flush())
                text.append(emit if hit else emit + self._stop.flush())
                self._finish()
                reason = "stop" if hit or event.finish_reason == "stop" else "length"
                return Piece("".join(text), reason, lps)
        return Piece("".join(text), None, lps)

    def _text_of(self, tok: int) -> str:
        """The text a generated token completes (a kept control token: its own text, after any
        incomplete character before it)."""
        if tok in self._keep:
            return self._decoder.flush() + self.state.engine.tokenizer.token_text(tok)
        return self._decoder.push(tok)

    def _count_token(self, t: float) -> None:
        self.completion_tokens += 1
        self.state.metrics.generation_tokens += 1
        if self._t_first is None:
            self._t_first = t
            self.state.metrics.ttft.observe(t - self._t_submit)
        self._t_last = t

    def _finish(self) -> None:
        if self._t_first is not None and self.completion_tokens > 1:
            self.state.metrics.tpot.observe(
                (self._t_last - self._t_first) / (self.completion_tokens - 1)
            )

    def usage(self) -> dict:
        """OpenAI's ``usage`` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class _Mailbox:
    """Token events from the engine thread to the event loop, one wake-up per batch of them.

    ``loop.call_soon_threadsafe`` writes to the loop's self-pipe to wake it; called per event,
    a step of 16 sequences costs 16 wake-ups and 16 loop iterations. Here the first event of a
    batch schedules one delivery and the events that follow it before the loop runs ride along,
    in order (with a wake-up per event, a 16-sequence step took about twice as long behind HTTP
    as in-process: docs/kernels.md, "Host costs around the pass").
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []

    def post(self, put: Callable[[Any], None], item: Any) -> None:
        """Have the loop call ``put(item)`` (from any thread; a closed loop drops it)."""
        with self._lock:
            self._items.append((put, item))
            wake = len(self._items) == 1
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for put, item in items:
            put(item)


RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 (seconds): requests finish in seconds, so a place opens soon."""


@dataclass
class ServerState:
    """What the handlers share.

    Attributes:
        engine: the started serving engine.
        model_name: the name clients use in ``model``.
        metrics: the server's counters.
        created: when the server started (Unix seconds), for ``/v1/models``.
        live: the generations submitted and not closed yet.
        closing: the server is shutting down (new generations get 503).
        limits: what one client may take (``serve``'s options).
        chat_template: the template of chat completions (``serve --chat-template``, or a
            built-in for a GGUF without one); None: the GGUF's.
        renders: the server's chat template render workers (``serve --render-workers``; made
            with one worker, started on the first chat, where not given).
    """

    engine: ServingEngine
    model_name: str
    metrics: ServerMetrics
    created: int
    live: set[Generation] = field(default_factory=set)
    chat_template: ChatTemplate | None = None
    closing: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    renders: RenderPool = field(default_factory=RenderPool)
    _mailbox: _Mailbox | None = None

    def check_queue(self) -> None:
        """Refuse a new generation when ``limits.max_waiting`` already wait beyond the plan's
        ``max_num_seqs`` running ones (every live generation is running or waiting).

        Raises:
            APIError: 429 with ``Retry-After``.
        """
        batch = getattr(self.engine, "batch", None)  # a stand-in engine in tests may have none
        if batch is None:
            return
        waiting = len(self.live) - batch.max_num_seqs
        if waiting >= self.limits.max_waiting:
            raise APIError(
                429,
                f"the server is busy: {batch.max_num_seqs} requests running and "
                f"{max(waiting, 0)} waiting (serve --max-waiting {self.limits.max_waiting}); "
                f"retry after {RETRY_AFTER_S} s",
                "server_error",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        """The hand-off of engine events to ``loop`` (made on first use, one per server)."""
        if self._mailbox is None:
            self._mailbox = _Mailbox(loop)
        return self._mailbox

    async def drain(self, timeout: float, forced: Callable[[], bool]) -> None:
        """Stop taking requests, give running ones ``timeout`` seconds to finish, then end the
        rest with a 503 error (their KV blocks are freed as they close).

        Args:
            timeout: seconds to wait, at most.
            forced: returns True when waiting should stop at once (a second Ctrl-C).
        """
        self.closing = True
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline and not forced():
            await asyncio.sleep(0.05)
        for gen in list(self.live):
            gen.shut_down()
