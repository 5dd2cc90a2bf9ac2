"""An OpenAI-compatible HTTP API over the serving engine (``execute.py serve``).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent events
or not), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text format). The
request and response shapes are OpenAI's, so the official clients work unchanged; ``top_k`` and
``ignore_eos`` are extensions, as in vLLM. ``POST /reset_prefix_cache`` (vLLM's route, with the
API key when one is set) empties the prefix cache between benchmark runs: 200 ``{"reset": true}``,
or 409 while requests are running or waiting.

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
Requests beyond the batch limits wait in the scheduler (first come, first served).

Disconnects. Each generating request has a watcher task on the ASGI ``receive`` channel; when
the client goes away (``http.disconnect``) it wakes the request's queue, which then aborts the
request in the engine (``ServingEngine.abort``) so its KV blocks return to the pool at once, even
while the request is still waiting for its first token. Every exit path (a finished request, a
stop string, an error, a cancelled task) goes through the same abort, which the engine makes
idempotent.

Shutdown. On Ctrl-C or SIGTERM new generations get 503 and ``/health`` turns 503; running ones
get ``GRACEFUL_SHUTDOWN_S`` seconds to finish, then end with a 503 error (a final error event
when streaming); only then is the engine closed.

Text. Token ids become text through a ``StreamDecoder`` (never a split UTF-8 character); stop
strings are matched on that text by ``StopMatcher``, which holds back any tail that could be the
start of a stop string, so a stop string never leaks into a chunk and the joined stream equals
the non-streamed text. End-of-generation tokens finish the request with ``"stop"`` and add no
text.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import hmac
import json
import math
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from strata.common.errors import StrataError
from strata.executor.chat import messages_to_ids
from strata.executor.sampling import SamplingParams
from strata.executor.serving import MAX_LOGPROBS, GenerationRequest, TokenEvent, TokenLogprob

if TYPE_CHECKING:
    from strata.executor.serving import ServingEngine

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` of ``/v1/completions`` when the request gives none (OpenAI's default)."""

MAX_BODY_BYTES = 16 * 2**20
"""Largest request body read (a prompt the size of any plan's context is far smaller)."""

GRACEFUL_SHUTDOWN_S = 5
"""Seconds running requests get to finish after Ctrl-C / SIGTERM before they are aborted."""

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/reset_prefix_cache",
)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as an OpenAI error object.

    Args:
        status: HTTP status code.
        message: what is wrong and how to fix it.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault, if one is.
        code: a machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        """The ``{"error": {...}}`` object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """The error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _engine_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="engine_error")


# --------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------


class _Body(BaseModel):
    # strict: "5" is not a number and "true" not a boolean, as in OpenAI's API; unknown fields
    # are ignored because clients send many (user, metadata, ...), as vLLM ignores them. Fields
    # that would change the output and are not implemented (tools, response_format, ...) are
    # declared and refused (check_unsupported), never dropped.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    """``stream_options``."""

    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by both completion endpoints."""

    model: str | None = Field(default=None, description="None: the served model (as vLLM)")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, description="extension; 0 or -1 = all tokens")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(
        default=None, description="token id (as a string) -> bias in [-100, 100]"
    )
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = Field(
        default=False,
        description="extension (vLLM's): logprobs name tokens as 'token_id:N', not as text",
    )

    def params(self, vocab_size: int) -> SamplingParams:
        """Sampling parameters with OpenAI's defaults (temperature 1; a random seed if none).

        Raises:
            APIError: a ``logit_bias`` key that is not a token id of the vocabulary, or a bias
                outside [-100, 100] (400).
        """
        seed = secrets.randbits(63) if self.seed is None else self.seed % 2**64
        bias = []
        for key, value in (self.logit_bias or {}).items():
            digits = key.strip()
            # ASCII digits only (str.isdigit takes "²", which int() refuses), and few of them.
            ok = digits.isascii() and digits.isdigit() and len(digits) <= 18
            tok = int(digits) if ok else -1
            if not 0 <= tok < vocab_size or not -100 <= value <= 100:
                raise APIError(
                    400,
                    f"logit_bias {{{key!r}: {value}}}: keys are token ids 0..{vocab_size - 1} "
                    "(as strings) and biases are in [-100, 100]",
                    param="logit_bias",
                )
            bias.append((tok, float(value)))
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=seed,
            logit_bias=tuple(sorted(bias)),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )

    def stop_strings(self) -> list[str]:
        """The stop strings, empty ones dropped (they would match at once)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprobs_count(self) -> int | None:
        """Alternatives per token whose log-probabilities the response carries (None: no
        logprobs)."""
        return None

    def check_unsupported(self) -> None:
        """Raises APIError for options this server does not implement (the ones that would change
        the output if they were silently dropped)."""
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported; only n=1 (one choice)", param="n")


class TextPart(_Body):
    """One part of a message's content given as a list (text only)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; extra keys (name, tool_calls, ...) reach the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        # OpenAI's API lets only an assistant message (one that carries tool calls) go without
        # content; any other message without text has nothing for the template to render.
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"a {self.role!r} message needs its content (a string or a list of text parts); "
                "only an assistant message may give null"
            )
        return self

    def for_template(self) -> dict:
        """The message as the chat template expects it: ``content`` as one string."""
        d = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        d["content"] = content or ""
        return d


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true; set both", param="top_logprobs")
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            param = "tools" if self.tools else "tool_choice"
            raise APIError(
                400, "tools (function calling) are not supported by this server", param=param
            )
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(
                400,
                'response_format other than {"type": "text"} (JSON mode, structured outputs) '
                "is not supported by this server",
                param="response_format",
            )

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError(
                400, "suffix (insertion) is not supported by this server", param="suffix"
            )
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported; only 1", param="best_of")

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a batch of several prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(
                    400, f"{len(p)} prompts given; send one prompt per request", param="prompt"
                )
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty; give at least one token", param="prompt")
        return p  # type: ignore[return-value]


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the field at fault for a pydantic error."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        msg = err["msg"].removeprefix("Invalid JSON: ")
        if "surrogate" in msg or "end of hex escape" in msg:  # jiter's words for lone halves
            msg += (
                " (a \\uD800-\\uDFFF escape is half a UTF-16 surrogate pair, not a character:"
                " a high one, \\uD800-\\uDBFF, must be followed by a low one, \\uDC00-\\uDFFF;"
                " send such text as UTF-8 or as the whole pair)"
            )
        elif "invalid unicode code point" in msg:  # bytes that are not UTF-8
            msg += " (the body must be UTF-8: re-encode the text, e.g. from Latin-1)"
        elif "invalid escape" in msg:
            msg += (
                " (JSON's escapes are \\\" \\\\ \\/ \\b \\f \\n \\r \\t and \\u with 4 hex digits)"
            )
        return f"the request body is not valid JSON: {msg}", None
    if err["type"] == "model_type" and not err["loc"]:
        return "the request body must be a JSON object", None
    loc, msg = tuple(err["loc"]), err["msg"]
    # A union field gives one error per member, each under the member's type name in its loc
    # ('prompt', 'list[int]'): name the field and what it accepts, or, when the input had a
    # member's shape (a list with a bad item), that member's own error without the type name.
    errors = [x for x in e.errors(include_url=False) if x["loc"][:1] == loc[:1]]
    n = len(_common_prefix([tuple(x["loc"]) for x in errors]))
    kinds = [x["loc"][n] for x in errors if len(x["loc"]) > n]
    shown = 1
    if len(errors) > 1 and len(kinds) == len(errors) and all(map(_is_type_name, kinds)):
        deep = [x for x in errors if len(x["loc"]) > n + 1]
        if deep:
            loc, msg = tuple(deep[0]["loc"][:n]) + tuple(deep[0]["loc"][n + 1 :]), deep[0]["msg"]
        else:
            loc, msg = loc[:n], "Input should be " + " or ".join(dict.fromkeys(kinds))
        shown = len(errors)
    field = ".".join(str(p) for p in loc)
    msg = msg.removeprefix("Value error, ")  # pydantic's wording for our validators' errors
    others = len(e.errors()) - shown
    more = f" (and {others} more)" if others else ""
    return f"{field}: {msg}{more}", field


def _common_prefix(locs: list[tuple]) -> tuple:
    first = locs[0]
    n = 0
    while n < len(first) and all(len(loc) > n and loc[n] == first[n] for loc in locs):
        n += 1
    return first[:n]


def _is_type_name(part: object) -> bool:
    """Whether a pydantic loc element names a union member (``str``, ``list[int]``, ``TextPart``)
    rather than a field or an index."""
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "none") or part[:1].isupper()
    )


async def _parse(request: Request, schema: type[_Body]) -> Any:
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(
                    413,
                    f"the request body is over {MAX_BODY_BYTES // 2**20} MiB; send a shorter one",
                )
    except ClientDisconnect:
        # Gone before its body was read (uvicorn also reports this once a client hangs up
        # before the handler reads a body it had received): 499, as in _collect, not a 500
        # with a traceback.
        raise APIError(499, "the client closed the request") from None
    try:
        return schema.model_validate_json(bytes(body))
    except ValidationError as e:
        message, param = _validation_message(e)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if param is None and kind and kind != "application/json" and not kind.endswith("+json"):
            # curl -d sends application/x-www-form-urlencoded unless told otherwise
            message += f"; the body was sent as {kind}: send JSON, as application/json"
        raise APIError(400, message, param=param) from None


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------


class StopMatcher:
    """Cuts generated text before the first stop string, across chunk boundaries.

    ``push`` returns the text that is safe to send: a tail that could be the start of a stop
    string is held back until the next piece decides it. The pieces returned by ``push`` (and
    ``flush`` at the end when no stop string matched) join to the text cut before the first stop
    string, however the text was split.

    Args:
        stops: the stop strings (non-empty).
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns ``(text safe to send, whether a stop string matched)``; after a match the
        returned text is everything before the stop string and the rest is dropped."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0
        for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, once the text is complete (it did not become a stop string)."""
        held, self._held = self._held, ""
        return held


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count).

    Args:
        buckets: upper bounds, increasing (``+Inf`` is added).
    """

    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Record one value."""
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value

    def lines(self, name: str) -> Iterator[str]:
        """The exposition lines ``name_bucket{le=..}``, ``name_sum``, ``name_count``."""
        total = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            yield f'{name}_bucket{{le="{le}"}} {total}'
        yield f"{name}_sum {self.sum!r}"
        yield f"{name}_count {total}"


class ServerMetrics:
    """The server's own counters (updated on the event loop thread only)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def render(self, engine: dict) -> str:
        """Prometheus text exposition (format 0.0.4) of these counters and ``engine``'s
        (``ServingEngine.metrics()``)."""
        e = defaultdict(int, engine)
        used, total = e["kv_blocks_in_use"], e["kv_blocks_total"]
        query, hit = e["prefix_query_tokens"], e["prefix_hit_tokens"]
        requests = [
            (f'{{endpoint="{ep}",status="{st}"}}', n)
            for (ep, st), n in sorted(self.requests.items())
        ]
        tiers = [(f'{{tier="{t}"}}', b) for t, b in sorted(engine.get("bytes_read", {}).items())]
        # (name, type, help, [(labels, value)]) in exposition order.
        table: list[tuple[str, str, str, Any]] = [
            ("requests_total", "counter", "HTTP requests answered by endpoint and status.",
             requests),
            ("prompt_tokens_total", "counter", "Prompt tokens of submitted requests.",
             [("", self.prompt_tokens)]),
            ("generation_tokens_total", "counter", "Tokens generated.",
             [("", self.generation_tokens)]),
            ("time_to_first_token_seconds", "histogram",
             "Time from submission to the first generated token, seconds.", self.ttft),
            ("time_per_output_token_seconds", "histogram",
             "Mean time per generated token after the first, per request, seconds.", self.tpot),
            ("kv_blocks_in_use", "gauge", "KV-cache blocks in use.", [("", used)]),
            ("kv_blocks_total", "gauge", "KV-cache blocks in the pool.", [("", total)]),
            ("kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.",
             [("", used / total if total else 0.0)]),
            ("prefix_cache_queries_total", "counter",
             "Prompt tokens looked up in the prefix cache.", [("", query)]),
            ("prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.",
             [("", hit)]),
            ("prefix_cache_hit_rate", "gauge", "Prefix-cache hit tokens / query tokens so far.",
             [("", hit / query if query else 0.0)]),
            ("bytes_read_total", "counter", "Weight bytes read, by tier.", tiers),
            ("num_requests_running", "gauge", "Sequences in the running batch.",
             [("", e["running"])]),
            ("num_requests_waiting", "gauge", "Sequences waiting for admission.",
             [("", e["waiting"])]),
            ("preemptions_total", "counter",
             "Sequences preempted (recomputed) for lack of KV blocks.", [("", e["preemptions"])]),
            ("engine_steps_total", "counter", "Engine steps run.", [("", e["steps"])]),
            ("batched_tokens_total", "counter",
             "Tokens run through the model (prefill chunks and decodes).",
             [("", e["batched_tokens"])]),
            ("spec_draft_tokens_total", "counter",
             "Speculative decoding: draft tokens verified (proposed in steps whose sampling "
             "succeeded).", [("", e["spec_proposed_tokens"])]),
            ("spec_accepted_tokens_total", "counter",
             "Speculative decoding: draft tokens accepted by verification.",
             [("", e["spec_accepted_tokens"])]),
            ("spec_verification_steps_total", "counter",
             "Speculative decoding: verifications of one sequence's drafts (each yields the "
             "accepted drafts plus one token).", [("", e["spec_verification_steps"])]),
            ("compiled_pass_traces_total", "counter",
             "Target-model forward passes traced into a compiled graph (executor.pass_graph).",
             [("", e["compiled_pass_traces"])]),
            ("compiled_pass_replays_total", "counter",
             "Target-model forward passes replayed from a compiled graph.",
             [("", e["compiled_pass_replays"])]),
            ("batch_invariant", "gauge",
             "1 when serving batch-invariant (--batch-invariant), else 0.",
             [("", e["batch_invariant"])]),
        ]  # fmt: skip
        out: list[str] = []
        for short, kind, help, samples in table:
            name = f"strata_{short}"
            out += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
            if kind == "histogram":
                out.extend(samples.lines(name))
            else:
                out.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)
        return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


# --------------------------------------------------------------------------------------------
# One generation
# --------------------------------------------------------------------------------------------


class _Disconnected(Exception):
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
        )
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False
        self._ignore_eos = ignore_eos
        self._queue: asyncio.Queue = asyncio.Queue()
        self._decoder = state.engine.tokenizer.stream_decoder()
        self._stop = StopMatcher(stop)
        self._t_submit = 0.0
        self._t_first: float | None = None
        self._t_last = 0.0

    def submit(self) -> None:
        """Hand the request to the engine.

        Raises:
            APIError: 400 for a request the engine refuses (StrataError), 503 while the server
                shuts down, 500 otherwise.
        """
        if self.state.closing:
            self.finished = True
            raise APIError(503, "the server is shutting down; retry elsewhere", "server_error")
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
            raise _engine_error(f"the engine refused the request: {e}") from e
        self.state.live.add(self)
        self.state.metrics.prompt_tokens += self.prompt_tokens

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
            _Disconnected: the client went away (the caller closes the generation).
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
                raise _Disconnected
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
                emit, hit = self._stop.push(self._decoder.push(tok))
                text.append(emit)
                if hit:
                    self._finish()
                    self.close()  # frees the blocks now; later events are not read
                    return Piece("".join(text), "stop", lps)
            if event.finish_reason == "error":
                self.finished = True
                raise _engine_error(f"the engine failed on this request: {event.error}")
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
        watcher = asyncio.create_task(self.generation.watch(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in self.chunks:
                    await send(
                        {"type": "http.response.body", "body": _sse(chunk), "more_body": True}
                    )
            except APIError as e:  # the status is sent already: the error is the last event
                await send(
                    {"type": "http.response.body", "body": _sse(e.body()), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except (_Disconnected, OSError):
            pass  # nobody to tell; the generation is aborted below
        finally:
            watcher.cancel()
            self.generation.close()
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _collect(
    generation: Generation, request: Request
) -> tuple[str, str, list[tuple[int, TokenLogprob]] | None]:
    """The whole text, finish reason and logprob entries (None unless asked for) of a
    non-streamed generation; aborts it if the client disconnects while it runs."""
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
    except _Disconnected:
        # Nobody reads the answer; 499 (nginx's "client closed request") shows in /metrics.
        raise APIError(499, "the client closed the request") from None
    finally:
        watcher.cancel()
        generation.close()


LOGPROB_FLOOR = -9999.0
"""Reported in place of a log-probability of minus infinity (a token the logits rule out), which
JSON cannot carry; vLLM reports the same value."""


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _token_label(tok, token_id: int, as_ids: bool) -> str:
    """How logprobs name a token: ``token_id:N``; else its text (special tokens' too), or, for a
    token holding part of a UTF-8 character, ``bytes:\\xNN...`` as OpenAI names such tokens (as
    text they would all read U+FFFD, and collide as keys of a completion's ``top_logprobs``)."""
    if as_ids:
        return f"token_id:{token_id}"
    data = tok.token_bytes(token_id, skip_special=False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _token_entry(tok, token_id: int, logprob: float, as_ids: bool) -> dict:
    """OpenAI's chat ``logprobs`` entry of one token: its name, log-probability and bytes."""
    return {
        "token": _token_label(tok, token_id, as_ids),
        "logprob": _logprob(logprob),
        "bytes": list(tok.token_bytes(token_id, skip_special=False)),
    }


def chat_logprobs(
    tok, entries: list[tuple[int, TokenLogprob]] | None, as_ids: bool = False
) -> dict | None:
    """A chat choice's ``logprobs`` object (``{"content": [...]}``) for ``entries``; None
    when the request did not ask for logprobs. ``as_ids``: name tokens ``token_id:N``."""
    if entries is None:
        return None
    return {
        "content": [
            {
                **_token_entry(tok, tid, lp.logprob, as_ids),
                "top_logprobs": [_token_entry(tok, a, v, as_ids) for a, v in lp.top],
            }
            for tid, lp in entries
        ]
    }


class TextOffsets:
    """Where each generated token's text starts in a completion's text (characters), for the
    legacy ``text_offset``: the text holds a token's characters once its UTF-8 character is
    complete, and nothing of a special token (as ``Generation`` decodes it).

    Args:
        tok: the tokenizer.
    """

    def __init__(self, tok):
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def next(self, token_id: int) -> int:
        """The offset of ``token_id``'s text, then advance past it."""
        at = self.chars
        self.chars += len(self._utf8.decode(self._tok.token_bytes(token_id)))
        return at


def completion_logprobs(
    tok,
    entries: list[tuple[int, TokenLogprob]] | None,
    offsets: TextOffsets,
    as_ids: bool = False,
) -> dict | None:
    """A completion choice's legacy ``logprobs`` object (``tokens``, ``token_logprobs``,
    ``top_logprobs`` as ``{token: logprob}``, ``text_offset`` from ``offsets``, which carries on
    across a stream's chunks); None when the request did not ask for logprobs. ``as_ids``: name
    tokens ``token_id:N``."""
    if entries is None:
        return None
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for tid, lp in entries:
        out["tokens"].append(_token_label(tok, tid, as_ids))
        out["token_logprobs"].append(_logprob(lp.logprob))
        out["top_logprobs"].append({_token_label(tok, a, as_ids): _logprob(v) for a, v in lp.top})
        out["text_offset"].append(offsets.next(tid))
    return out


# --------------------------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------------------------


class _Mailbox:
    """Token events from the engine thread to the event loop, one wake-up per batch of them.

    ``loop.call_soon_threadsafe`` writes to the loop's self-pipe to wake it; called per event,
    a step of 16 sequences costs 16 wake-ups and 16 loop iterations. Here the first event of a
    batch schedules one delivery and the events that follow it before the loop runs ride along,
    in order (measured need: on the H200 a 16-sequence step of the small model took 18 ms behind
    HTTP against 9-11 ms in-process).
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
    """

    engine: ServingEngine
    model_name: str
    metrics: ServerMetrics
    created: int
    live: set[Generation] = field(default_factory=set)
    closing: bool = False
    _mailbox: _Mailbox | None = None

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


def _state(request: Request) -> ServerState:
    return request.app.state.strata


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r} "
            "(GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def _max_tokens(
    state: ServerState,
    n_prompt: int,
    asked: int | None,
    default: int | None,
    prompt_param: str,
    asked_param: str = "max_tokens",
) -> int:
    """The request's token budget, checked against the plan's context (``asked_param``: the
    field that gave ``asked``, named in the error).

    Raises:
        APIError: 400 when the prompt, or the prompt plus ``asked``, does not fit the context.
    """
    context = state.engine.context
    if n_prompt >= context:
        room = (
            "leaving no room for a generated token"
            if n_prompt == context
            else "which is longer than that context"
        )
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens and this model's context is {context} tokens "
            f"(the plan's), {room}; shorten the prompt, or re-plan with a larger --context",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if asked is not None and n_prompt + asked > context:
        raise APIError(
            400,
            f"the prompt ({n_prompt} token{'s' if n_prompt != 1 else ''}) plus {asked_param} "
            f"({asked}) exceed this model's "
            f"context of {context} tokens; ask for at most {context - n_prompt} tokens",
            param=asked_param,
            code="context_length_exceeded",
        )
    if asked is not None:
        return asked
    return min(default or context, context - n_prompt)


async def _start(
    state: ServerState,
    body: _Sampling,
    prompt_ids: list[int],
    asked: int | None,
    default: int | None,
    prompt_param: str,
) -> Generation:
    completion = getattr(body, "max_completion_tokens", None) is not None
    asked_param = "max_completion_tokens" if completion else "max_tokens"
    max_tokens = _max_tokens(state, len(prompt_ids), asked, default, prompt_param, asked_param)
    prefix = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
    gen = Generation(
        state,
        f"{prefix}-{uuid.uuid4().hex}",
        prompt_ids,
        max_tokens,
        body.params(state.engine.tokenizer.vocab_size),
        body.stop_strings(),
        body.ignore_eos,
        body.logprobs_count(),
    )
    gen.submit()
    return gen


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    state = _state(request)
    body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
    body.check_unsupported()
    _check_model(state, body.model)
    tok = state.engine.tokenizer
    if tok.chat_template is None:
        raise APIError(
            400,
            "this model's GGUF has no chat template (tokenizer.chat_template); "
            "use /v1/completions with a prompt instead",
            param="messages",
        )
    messages = [m.for_template() for m in body.messages]
    # the template's text per message counts too: many tiny messages are a long render
    chars = sum(len(str(m.get("content") or "")) + 64 for m in messages)
    try:
        ids = await _tokenize(chars, messages_to_ids, tok, messages)
    except StrataError as e:  # ChatError, or a TokenizerError
        raise APIError(400, str(e), param="messages") from None
    gen = await _start(state, body, ids, body.max_new_tokens(), None, "messages")
    created = int(time.time())
    head = {
        "id": gen.request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.model_name,
        "system_fingerprint": None,
    }
    if body.stream:
        chunks = _chat_chunks(gen, head, body.include_usage(), tok, body.return_tokens_as_token_ids)
        return EventStream(gen, chunks)
    text, finish, lps = await _collect(gen, request)
    return JSONResponse(
        {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs(tok, lps, body.return_tokens_as_token_ids),
                    "finish_reason": finish,
                }
            ],
            "usage": gen.usage(),
        }
    )


async def _chat_chunks(
    gen: Generation, head: dict, include_usage: bool, tok, as_ids: bool
) -> AsyncIterator[dict]:
    usage = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice], **usage}

    yield chunk({"role": "assistant", "content": ""})
    async for piece in gen.pieces():
        if piece.text or piece.logprobs:
            yield chunk(
                {"content": piece.text}, logprobs=chat_logprobs(tok, piece.logprobs, as_ids)
            )
        if piece.finish_reason:
            yield chunk({}, piece.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}


INLINE_TOKENIZE_CHARS = 16_384
"""Prompts (or chats' message contents) of at most this many characters are tokenized on the
event loop; longer ones in a worker thread, so that the loop keeps serving the other streams.
A worker-thread round trip cost 0.33 ms of a prefix-cache hit's TTFT, and encoding a
1,000-token prompt 0.65 ms (dev CPU, 2026-12-02, server instrumented stage by stage); 16 K
characters, about 4,000 tokens, keep the loop's pause to a few ms."""


async def _tokenize(chars: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
    """``fn(*args)`` on the event loop for ``chars`` up to ``INLINE_TOKENIZE_CHARS``, else in a
    worker thread."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    state = _state(request)
    body: CompletionRequest = await _parse(request, CompletionRequest)
    body.check_unsupported()
    _check_model(state, body.model)
    prompt = body.single_prompt()
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        try:
            # Control tokens written in the text (a hand-rendered chat prompt's <|im_start|>)
            # are those tokens, as llama.cpp's server and vLLM read a completion prompt.
            encode = functools.partial(tok.encode, parse_special=True)
            ids = await _tokenize(len(prompt), encode, prompt)
        except StrataError as e:
            raise APIError(400, str(e), param="prompt") from None
    else:
        bad = [i for i in prompt if not 0 <= i < tok.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary (0..{tok.vocab_size - 1})",
                param="prompt",
            )
        ids = list(prompt)
    gen = await _start(state, body, ids, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
    head = {
        "id": gen.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": None,
    }
    if body.stream:
        chunks = _completion_chunks(
            gen, head, body.include_usage(), tok, body.return_tokens_as_token_ids
        )
        return EventStream(gen, chunks)
    text, finish, lps = await _collect(gen, request)
    logprobs = completion_logprobs(tok, lps, TextOffsets(tok), body.return_tokens_as_token_ids)
    return JSONResponse(
        {
            **head,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": gen.usage(),
        }
    )


async def _completion_chunks(
    gen: Generation, head: dict, include_usage: bool, tok, as_ids: bool
) -> AsyncIterator[dict]:
    usage = {"usage": None} if include_usage else {}
    offsets = TextOffsets(tok)
    async for piece in gen.pieces():
        logprobs = completion_logprobs(tok, piece.logprobs, offsets, as_ids)
        choice = {
            "index": 0,
            "text": piece.text,
            "logprobs": logprobs,
            "finish_reason": piece.finish_reason,
        }
        yield {**head, "choices": [choice], **usage}
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "strata",
        "max_model_len": state.engine.context,
    }


async def list_models(request: Request) -> Response:
    """``GET /v1/models``."""
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``."""
    state = _state(request)
    _check_model(state, request.path_params["model"])
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    """``GET /health``: 200 while the server takes requests, 503 once it shuts down (open
    without the API key)."""
    if _state(request).closing:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text format."""
    state = _state(request)
    text = state.metrics.render(state.engine.metrics())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def reset_prefix_cache(request: Request) -> Response:
    """``POST /reset_prefix_cache`` (vLLM's route): forget every cached prefix, so that later
    prompts are prefilled in full. 200 ``{"reset": true}``; 409 while requests are running or
    waiting (nothing changes, as in vLLM)."""
    try:
        reset = await run_in_threadpool(_state(request).engine.reset_prefix_cache)
    except StrataError as e:
        raise _engine_error(f"cannot reset the prefix cache: {e}") from e
    if not reset:
        raise APIError(
            409,
            "requests are running or waiting; reset the prefix cache once they have finished",
            code="requests_running",
        )
    return JSONResponse({"reset": True})


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
        assert self.api_key is not None
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), self.api_key.encode()
                )
        return False


def create_app(engine: ServingEngine, model_name: str, api_key: str | None = None) -> Starlette:
    """The ASGI application over a started ``ServingEngine``.

    Args:
        engine: the serving engine (started by the caller, closed by the caller).
        model_name: the model's name in requests and ``/v1/models``.
        api_key: when given, every ``/v1/*`` and ``/reset_prefix_cache`` request needs
            ``Authorization: Bearer api_key``.
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
        middleware=[Middleware(_Gate, api_key=api_key, metrics=server_metrics)],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.strata = ServerState(engine, model_name, server_metrics, int(time.time()))
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


def _uvicorn_server(app: Starlette, ready: Callable[[], None]):
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

    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return Server(config)


def default_model_name(loaded) -> str:
    """The plan's catalog model name, else the GGUF file's stem."""
    src = loaded.plan.fingerprints.model
    return src.name or Path(src.path or loaded.gguf.path).stem


def serve(
    plan_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    batch_invariant: bool = False,
) -> None:
    """Load a plan and serve it until Ctrl-C or SIGTERM (``execute.py serve``).

    Prints ``serving MODEL on http://HOST:PORT`` to stderr once requests are accepted.
    ``batch_invariant``: ``ServingEngine``'s mode of that name (``--batch-invariant``).

    Raises:
        StrataError: the address cannot be used, or the plan cannot be loaded.
    """
    from strata.executor.engine import Engine
    from strata.executor.plan_loader import load_plan
    from strata.executor.serving import WARM_UP_ROW_BUCKETS, ServingEngine

    sock = bind_socket(host, port)  # before loading: a busy port fails in a second, not after
    try:
        loaded = load_plan(plan_path)
        engine = Engine(loaded)
        try:
            serving = ServingEngine(engine, batch_invariant=batch_invariant)
            try:
                if WARM_UP_ROW_BUCKETS:
                    print("building kernels for every batch size ...", file=sys.stderr, flush=True)
                warm = serving.start()
                if warm:
                    print(f"kernels built in {warm:.1f} s", file=sys.stderr, flush=True)
                name = model_name or default_model_name(loaded)
                bound = sock.getsockname()[1]
                shown = f"[{host}]" if ":" in host else host
                app = create_app(serving, name, api_key)

                def ready() -> None:
                    print(f"serving {name} on http://{shown}:{bound}", file=sys.stderr, flush=True)

                _uvicorn_server(app, ready).run(sockets=[sock])
            finally:
                serving.close()
                print("stopped", file=sys.stderr, flush=True)
        finally:
            engine.close()
    finally:
        sock.close()
