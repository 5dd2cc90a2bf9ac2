"""The OpenAI API's request bodies and its error object: the pydantic models of
``/v1/chat/completions`` and ``/v1/completions``, reading and validating a request body, and
``APIError``, answered as OpenAI's ``{"error": {...}}`` naming the field at fault and the fix.

The shapes are OpenAI's, so the official clients work unchanged; ``top_k``, ``ignore_eos`` and
``return_tokens_as_token_ids`` are extensions, as in vLLM.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from strata.executor.sampling import SamplingParams
from strata.executor.serving import MAX_LOGPROBS

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` of ``/v1/completions`` when the request gives none (OpenAI's default)."""

MAX_BODY_BYTES = 16 * 2**20
"""Largest request body read (a prompt the size of any plan's context is far smaller)."""

BODY_READ_TIMEOUT_S = 30.0
"""Default seconds a client may take to send its request head, and between two pieces of its
body (``serve --read-timeout``): past it the request gets 408 and the connection is closed. Any
client on a working network sends a piece far sooner; a client that announces a body and
trickles it, or stops, would otherwise hold its connection (and its memory) for ever."""

DEFAULT_MAX_WAITING = 256
"""Default of ``serve --max-waiting``: requests that may wait for a place in the batch (beyond
the plan's ``max_num_seqs`` running ones) before new ones get 429. vLLM and llama.cpp's server
queue without a limit; TGI refuses past 128 concurrent requests. 256 keeps a burst of a few
hundred clients served (each waiting request holds only a connection and its prompt's ids)
while a flood cannot grow the queue, and the time to a first token, without bound."""

MAX_STOP_STRINGS = 4
"""Most stop strings a request may give (OpenAI's API reference: "Up to 4 sequences")."""


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
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers

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
        """The error as a JSON response (with the error's own headers, e.g. ``Retry-After``,
        and ``headers``)."""
        merged = {**(self.headers or {}), **(headers or {})}
        return JSONResponse(self.body(), status_code=self.status, headers=merged or None)


@dataclass(frozen=True)
class ServerLimits:
    """What one client may take of the server (``serve``'s options; docs/serving.md, "Limits").

    Attributes:
        max_waiting: requests that may wait for a place in the batch beyond the plan's
            ``max_num_seqs`` running ones; more get 429 with ``Retry-After``.
        read_timeout_s: seconds a client may take to send its request head, and between two
            pieces of its body (408, connection closed).
    """

    max_waiting: int = DEFAULT_MAX_WAITING
    read_timeout_s: float = BODY_READ_TIMEOUT_S


def engine_error(message: str) -> APIError:
    """A 500 ``server_error`` for a failure of the engine, not of the request."""
    return APIError(500, message, type="server_error", code="engine_error")


UNSUPPORTED_EXTENSIONS: dict[str, tuple] = {
    "repetition_penalty": (None, 1.0, 1),
    "min_tokens": (None, 0),
    "min_p": (None, 0.0, 0),
    "typical_p": (None, 1.0, 1),
    "length_penalty": (None, 1.0, 1),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "structured_outputs": (None,),
}
"""vLLM's sampling extensions this server does not implement, each with the values that change
nothing (accepted: a client may send its defaults); any other value is a 400 naming the field."""


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

    model: str | None = Field(default=None, description="left out: the served model (as vLLM)")
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="OpenAI's newer name of max_tokens; wins when both given"
    )
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, description="extension; 0 or -1 = all tokens")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="int64, as vLLM")
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

    @field_validator("model")
    @classmethod
    def _model_named(cls, model: str | None) -> str | None:
        # Only a model left out means the served one: an explicit null is more likely a
        # client's unset variable than a choice, so it is refused rather than guessed.
        if model is None:
            raise ValueError(
                "null is not a model name; give the served model's name (GET /v1/models) "
                "or leave the field out"
            )
        return model

    @field_validator("stop")
    @classmethod
    def _stops_usable(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(
                f"{len(stops)} stop strings given; give at most {MAX_STOP_STRINGS} (as OpenAI)"
            )
        if "" in stops:
            raise ValueError("an empty stop string would end every reply at once; leave it out")
        return stop

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
        """The stop strings as a list (none empty: the validator refuses those)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_new_tokens(self) -> tuple[int | None, str]:
        """The token limit asked for and the field that gave it: ``max_completion_tokens``
        when given (OpenAI's newer name; it wins over ``max_tokens``, as in OpenAI's API and
        vLLM), else ``max_tokens``; None: the endpoint's default."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprobs_count(self) -> int | None:
        """Alternatives per token whose log-probabilities the response carries (None: no
        logprobs)."""
        return None

    @model_validator(mode="before")
    @classmethod
    def _no_unimplemented_extensions(cls, body: Any) -> Any:
        # Unknown fields are ignored, but not vLLM's sampling extensions: a vLLM client sends them
        # expecting an effect, so each is refused unless it holds its no-op value.
        if isinstance(body, dict):
            for name, noop in UNSUPPORTED_EXTENSIONS.items():
                if name in body and not any(
                    body[name] == v and type(body[name]) is type(v) for v in noop
                ):
                    raise APIError(
                        400,
                        f"{name} (a vLLM sampling extension) is not supported by this server; "
                        "leave it out",
                        param=name,
                    )
        return body

    def check_unsupported(self) -> None:
        """Raises APIError for options this server does not implement (the ones that would change
        the output if they were silently dropped)."""
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n} is not supported; only n=1 (one choice)", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400,
                "stream_options is only allowed with stream: true (as OpenAI); leave it out",
                param="stream_options",
            )


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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true; set both", param="top_logprobs")
        # Any tools list, an empty one too, is refused: accepted, it would read as honoured.
        if self.tools is not None or self.tool_choice not in (None, "none", "auto"):
            param = "tools" if self.tools is not None else "tool_choice"
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


def _too_large() -> APIError:
    return APIError(
        413,
        f"the request body is over {MAX_BODY_BYTES // 2**20} MiB; send a shorter one",
        headers={"Connection": "close"},  # the rest of the body is not read
    )


async def parse_body(request: Request, schema: type[_Body], timeout: float) -> Any:
    """The request's body read (at most ``MAX_BODY_BYTES``, each piece within ``timeout``
    seconds of the last) and validated as ``schema``.

    Raises:
        APIError: 400 naming the field at fault (or the JSON error), 413 for a body over the
            limit (at once when ``Content-Length`` announces it), 408 when the client stops
            sending its body for ``timeout`` seconds, 499 when the client left before its body
            was read. 413 and 408 close the connection.
    """
    announced = request.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout) as deadline:
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise _too_large()
                deadline.reschedule(loop.time() + timeout)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body stopped arriving for {timeout:g} s "
            f"({len(body)} bytes read); send it whole",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        # Gone before its body was read (uvicorn also reports this once a client hangs up
        # before the handler reads a body it had received): 499, as in streaming.collect, not a 500
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
