"""The OpenAI API's request bodies and its error object: the pydantic models of
``/v1/chat/completions`` and ``/v1/completions``, reading and validating a request body, and
``APIError``, answered as OpenAI's ``{"error": {...}}`` naming the field at fault and the fix.

The shapes are OpenAI's, so the official clients work unchanged; ``top_k``, ``ignore_eos`` and
``return_tokens_as_token_ids`` are extensions, as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from strata.executor.grammar import GrammarError, json_schema_grammar
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
    response_format: Any = Field(
        default=None,
        description='{"type": "text" | "json_object" | "json_schema"}: structured outputs, '
        "enforced by constrained decoding (executor.grammar)",
    )
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

    def response_grammar(self) -> str | None:
        """The grammar of ``response_format`` (``executor.grammar``), or None for free text.

        Shapes taken: ``{"type": "text"}``; ``{"type": "json_object"}`` (any JSON object: OpenAI's
        JSON mode; with a ``schema`` beside it, as llama-server takes it, that schema);
        ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
        (OpenAI's structured outputs) and ``{"type": "json_schema", "schema": ...}`` (the
        top-level shape some clients send).

        Raises:
            APIError: 400 naming the field for any other shape or key, or a schema that cannot
                be enforced (``GrammarError``: the feature is named).
        """
        rf = self.response_format
        if rf is None:
            return None
        if not isinstance(rf, dict):
            raise _format_error('response_format must be an object such as {"type": "json_object"}')
        kind = rf.get("type")
        allowed = {"text": {"type"}, "json_object": {"type", "schema"}}
        allowed["json_schema"] = {"type", "json_schema", "schema"}
        if kind is None:
            raise _format_error(
                "response_format.type is missing; give text, json_object or json_schema"
            )
        if kind not in allowed:
            raise _format_error(
                f"response_format.type {kind!r} is not one of text, json_object, json_schema"
            )
        extra = sorted(set(rf) - allowed[kind])
        if extra:
            raise _format_error(f"response_format.{extra[0]} is not a field of a {kind} format")
        if kind == "text":
            return None
        schema: Any = rf.get("schema", {"type": "object"})
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if spec is None and "schema" not in rf:
                raise _format_error("response_format.json_schema is missing; give its schema")
            if spec is not None:
                if "schema" in rf:
                    raise _format_error("give the schema once: in json_schema.schema")
                if not isinstance(spec, dict):
                    raise _format_error("response_format.json_schema must be an object")
                unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
                if unknown:
                    raise _format_error(f"response_format.json_schema.{unknown[0]} is not known")
                if "schema" not in spec:
                    raise _format_error("response_format.json_schema.schema is missing")
                for key, types, what in (
                    ("name", str, "a string"),
                    ("description", str, "a string"),
                    ("strict", bool, "true or false"),
                ):
                    if spec.get(key) is not None and not isinstance(spec[key], types):
                        raise _format_error(f"response_format.json_schema.{key} must be {what}")
                schema = spec["schema"]
        try:
            return json_schema_grammar(schema)
        except GrammarError as e:
            raise _format_error(str(e)) from None

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


def _format_error(message: str) -> APIError:
    return APIError(400, message, param="response_format")


class TextPart(_Body):
    """One part of a message's content given as a list (text only)."""

    type: Literal["text"]
    text: str


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function's name, as OpenAI's API takes it: letters, digits, ``_`` and ``-``, 1-64 of them
(the tool-call formats write it bare: ``to=functions.NAME``, ``NAME[ARGS]``)."""


class FunctionDefinition(_Body):
    """``tools[i].function``: a function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON schema of the arguments object; left out: no arguments"
    )
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name_usable(cls, name: str) -> str:
        if not TOOL_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a function name: use 1-64 letters, digits, '_' or '-' (as OpenAI)"
            )
        return name

    @field_validator("parameters")
    @classmethod
    def _parameters_an_object(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        # The arguments are a JSON object (OpenAI's rule): a schema typed otherwise could never
        # be met by a call.
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(
                f'the parameters schema has "type": {json.dumps(parameters["type"])}; a '
                'function\'s arguments are a JSON object: give {"type": "object", ...}'
            )
        # llguidance's own options: the server sets them for every call grammar (the
        # separators, no free whitespace); a client's would apply in some formats only.
        if parameters is not None and "x-guidance" in parameters:
            raise ValueError(
                "x-guidance (llguidance's options) is set by the server; leave it out of "
                "the parameters schema"
            )
        return parameters


class Tool(_Body):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Body):
    """A called function: its name and its arguments as a JSON text (OpenAI's shape)."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _arguments_json(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError as e:
            raise ValueError(
                f"arguments is not JSON ({e}); give the arguments object's JSON text"
            ) from None
        if not isinstance(value, dict):
            raise ValueError("arguments must be the JSON text of an object, e.g. '{\"x\": 1}'")
        return arguments


class ToolCall(_Body):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Body):
    """One chat message; extra keys (name, ...) reach the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Named here, before the union's errors: an image or audio part is a capability this
        # model lacks, not a malformed part.
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"part {j} is of type {kind!r}; this model takes text only: send "
                        'text parts ({"type": "text", "text": ...}) or a string'
                    )
        return content

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        # OpenAI's API lets only an assistant message (one that carries tool calls) go without
        # content; any other message without text has nothing for the template to render.
        if self.content == [] and self.role != "assistant":
            raise ValueError(
                f"a {self.role!r} message's content is an empty list; give at least one text part"
            )
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"a {self.role!r} message needs its content (a string or a list of text parts); "
                "only an assistant message may give null"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message cannot carry tool_calls; only an assistant")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError(
                "a 'tool' message needs tool_call_id: the id of the assistant's call it answers"
            )
        return self

    def for_template(self) -> dict:
        """The message as chat templates expect it: ``content`` as one string (text parts
        joined with nothing between them, so the render is byte-identical to the string form;
        null is ``""``, never the text "None"), and each tool call's ``arguments`` as the
        object its JSON text holds (HF templates write ``arguments | tojson``; vLLM and
        llama.cpp's server hand them the object too)."""
        d = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        d["content"] = content or ""
        if self.tool_calls is not None:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {
                        "name": c.function.name,
                        "arguments": json.loads(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        return d


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one tool call (left out: any number)"
    )
    best_of: int | None = None
    functions: Any = Field(default=None, description="OpenAI's legacy form of tools: refused")
    function_call: Any = Field(default=None, description="legacy form of tool_choice: refused")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true; set both", param="top_logprobs")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported; only 1", param="best_of")
        for legacy, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, legacy) is not None:
                raise APIError(
                    400,
                    f"{legacy} (OpenAI's deprecated form) is not supported; send {new}",
                    param=legacy,
                )
        self._check_tools()

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_known(cls, choice: Any) -> Any:
        if (isinstance(choice, str) and choice not in ("none", "auto", "required")) or not (
            choice is None or isinstance(choice, str | dict)
        ):
            raise ValueError(
                f'{json.dumps(choice)} is not a tool_choice: give "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}'
            )
        return choice

    def _check_tools(self) -> None:
        """Raises APIError (400) for an empty or ambiguous ``tools`` list, or a ``tool_choice``
        that names no given function."""
        names = [t.function.name for t in self.tools or []]
        if self.tools is not None and not names:
            raise APIError(
                400, "tools is empty; give at least one function or leave tools out", param="tools"
            )
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise APIError(
                400,
                f"tools: the function {twice[0]!r} is given twice; name each once",
                param="tools",
            )
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                given = ", ".join(map(repr, names)) or "none"
                raise APIError(
                    400,
                    f"tool_choice names the function {choice.function.name!r}, which is not "
                    f"among tools (given: {given})",
                    param="tool_choice",
                )
        elif choice == "required" and not names:
            raise APIError(
                400,
                'tool_choice "required" needs tools; give them or leave tool_choice out',
                param="tool_choice",
            )
        rf = self.response_format
        if self.tool_mode() in ("required", "named") and isinstance(rf, dict):
            if rf.get("type") != "text":
                raise APIError(
                    400,
                    "response_format cannot go with a forced tool call (tool_choice "
                    '"required" or a named function): the call\'s arguments follow its schema; '
                    "leave one out",
                    param="response_format",
                )

    def tool_mode(self) -> str:
        """``"none"`` (no tools, or ``tool_choice: "none"``: free text, no calls parsed),
        ``"auto"`` (the default with tools), ``"required"`` or ``"named"`` (a call forced by
        the grammar of ``server.tool_calls.call_grammar``)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_definitions(self) -> list[dict] | None:
        """``tools`` as chat templates take them (HF's ``tools`` argument:
        ``[{"type": "function", "function": {"name", "description", "parameters"}}]``), or
        None."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    tools: Any = None
    tool_choice: Any = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name in ("tools", "tool_choice"):  # declared so that they are refused, not dropped
            if getattr(self, name) is not None:
                raise APIError(
                    400,
                    f"{name} is a chat feature: send the request to /v1/chat/completions",
                    param=name,
                )
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
