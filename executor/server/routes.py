"""The route handlers: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (a prompt
checked against the plan's context, tokenized, submitted, answered streamed or whole),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` and ``POST /reset_prefix_cache``."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from strata.common.errors import StrataError
from strata.executor.chat import (
    BUILTIN_TEMPLATES,
    RENDER_RETRY_AFTER_S,
    RenderBusy,
    messages_to_ids,
)
from strata.executor.server.generation import Generation, ServerState
from strata.executor.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from strata.executor.server.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    engine_error,
    parse_body,
)
from strata.executor.server.streaming import EventStream, collect
from strata.executor.server.tool_calls import ToolCallParser, tool_setup


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
            "so no room is left for a generated token"
            if n_prompt == context
            else f"{n_prompt - context} more than it holds"
        )
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens and this model's context (the plan's) is "
            f"{context} tokens, {room}; shorten the prompt, or re-plan with a larger --context",
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
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    default: int | None,
    prompt_param: str,
    grammar: str | None = None,
    keep: frozenset[int] = frozenset(),
) -> Generation:
    """Submit a request's generation: its token limit, sampling parameters, stop strings,
    logprobs and ``grammar`` (``executor.grammar``; None: free text); ``keep``: control tokens
    kept in its text (a tool-call format's markers)."""
    asked, asked_param = body.max_new_tokens()
    max_tokens = _max_tokens(state, len(prompt_ids), asked, default, prompt_param, asked_param)
    prefix = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
    if grammar is not None:
        # Compiling a schema (the first time, the model's vocabulary too) takes milliseconds to
        # seconds: in a worker thread, while the loop serves the other streams; the engine keeps
        # it compiled, so the submit below only copies it.
        try:
            await run_in_threadpool(state.engine.compile_grammar, grammar)
        except StrataError as e:
            raise APIError(400, str(e)) from None
    gen = Generation(
        state,
        f"{prefix}-{uuid.uuid4().hex}",
        prompt_ids,
        max_tokens,
        body.params(state.engine.tokenizer.vocab_size),
        body.stop_strings(),
        body.ignore_eos,
        body.logprobs_count(),
        grammar,
        keep,
    )
    gen.submit()
    return gen


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    state = _state(request)
    body: ChatCompletionRequest = await parse_body(
        request, ChatCompletionRequest, state.limits.read_timeout_s
    )
    body.check_unsupported()
    _check_model(state, body.model)
    grammar = body.response_grammar()  # before the render: a schema refused costs nothing
    tok = state.engine.tokenizer
    if state.chat_template is None and tok.chat_template is None:
        raise APIError(
            400,
            "this model's GGUF has no chat template (tokenizer.chat_template); start the server "
            f"with --chat-template FILE or a built-in name ({', '.join(BUILTIN_TEMPLATES)}), or "
            "use /v1/completions with a prompt instead",
            param="messages",
        )
    given = state.chat_template
    template = None if given is None else given.text
    name = "the GGUF's chat template" if given is None else given.name
    messages = [m.for_template() for m in body.messages]
    template_text = template if template is not None else tok.chat_template
    tools = tool_setup(body, template_text or "", name, tok)  # None: no calls parsed
    if tools is not None and tools.grammar is not None:
        grammar = tools.grammar  # a forced call or strict tools (no response_format beside)
    state.check_queue()  # before the render: a refused request costs nothing
    try:
        # A render worker is waited for on the loop (at most renders.wait_s, holding no
        # thread); the render itself always runs in a worker thread: it waits on the worker
        # process (up to chat.RENDER_TIMEOUT_S for a template that loops, and a kill and
        # restart past it), which the loop must not.
        lease = await state.renders.lease_async()
        try:
            render = functools.partial(messages_to_ids, lease=lease, tools=body.tool_definitions())
            ids = await run_in_threadpool(render, tok, messages, template, True, name)
        finally:
            lease.release()  # at once if the render never began (e.g. malformed messages)
    except RenderBusy as e:  # no worker came free in time, or the server is stopping
        raise APIError(
            503,
            str(e),
            "server_error",
            code="render_busy",
            headers={"Retry-After": str(RENDER_RETRY_AFTER_S)},
        ) from None
    except StrataError as e:  # ChatError, or a TokenizerError
        raise APIError(400, str(e), param="messages") from None
    keep = frozenset() if tools is None else tools.keep
    gen = await _start(state, body, ids, None, "messages", grammar, keep)
    created = int(time.time())
    head = {
        "id": gen.request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.model_name,
        "system_fingerprint": None,
    }
    if body.stream:
        parser = None if tools is None else tools.parser()
        chunks = _chat_chunks(
            gen, head, body.include_usage(), tok, body.return_tokens_as_token_ids, parser
        )
        return EventStream(gen, chunks)
    text, finish, lps = await collect(gen, request)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools is not None:
        message["content"], calls = tools.parser().parse(text)
        if calls:
            message["tool_calls"] = calls
            if finish == "stop":  # a reply cut by max_tokens stays "length", calls or not
                finish = "tool_calls"
    return JSONResponse(
        {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": chat_logprobs(tok, lps, body.return_tokens_as_token_ids),
                    "finish_reason": finish,
                }
            ],
            "usage": gen.usage(),
        }
    )


async def _chat_chunks(
    gen: Generation,
    head: dict,
    include_usage: bool,
    tok,
    as_ids: bool,
    parser: ToolCallParser | None = None,
) -> AsyncIterator[dict]:
    """The chunks of a streamed chat; with ``parser`` (a tools request), the text goes through
    it: ``delta.content`` and ``delta.tool_calls`` as OpenAI streams them, and ``finish_reason``
    ``"tool_calls"`` when calls were made and the reply ended by itself (not cut by
    ``max_tokens``: ``"length"``)."""
    usage = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice], **usage}

    yield chunk({"role": "assistant", "content": ""})
    async for piece in gen.pieces():
        if parser is not None:  # no logprobs beside tools (tool_setup refuses them)
            for delta in parser.push(piece.text):
                yield chunk(delta)
            if piece.finish_reason:
                for delta in parser.finish():
                    yield chunk(delta)
                done = parser.calls and piece.finish_reason == "stop"  # "length" stays
                yield chunk({}, "tool_calls" if done else piece.finish_reason)
            continue
        if piece.text or piece.logprobs:
            yield chunk(
                {"content": piece.text}, logprobs=chat_logprobs(tok, piece.logprobs, as_ids)
            )
        if piece.finish_reason:
            yield chunk({}, piece.finish_reason)
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}


INLINE_TOKENIZE_CHARS = 16_384
"""Completion prompts of at most this many characters are tokenized on the event loop (chats
always go to a worker thread: their render waits on the render worker); longer ones in a worker
thread, so that the loop keeps serving the other streams. A worker-thread round trip costs a
prefix-cache hit's TTFT about what encoding 500 tokens does; 16 K characters, about 4,000 tokens,
keep the loop's pause to a few ms (measured: docs/kernels.md, "Host costs around the pass")."""


async def _tokenize(chars: int, fn: Callable[..., list[int]], *args: Any) -> list[int]:
    """``fn(*args)`` on the event loop for ``chars`` up to ``INLINE_TOKENIZE_CHARS``, else in a
    worker thread."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    state = _state(request)
    body: CompletionRequest = await parse_body(
        request, CompletionRequest, state.limits.read_timeout_s
    )
    body.check_unsupported()
    _check_model(state, body.model)
    grammar = body.response_grammar()  # vLLM takes response_format on completions too
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
    gen = await _start(state, body, ids, COMPLETION_DEFAULT_MAX_TOKENS, "prompt", grammar)
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
    text, finish, lps = await collect(gen, request)
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
    """``GET /health``: 200 while the server takes requests, 503 once it shuts down or once a
    cluster plan's rank stopped (``error``: which, and why), open without the API key."""
    if _state(request).closing:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    failure = _state(request).engine.failure
    if failure is not None:
        return JSONResponse({"status": "error", "error": failure}, status_code=503)
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
        raise engine_error(f"cannot reset the prefix cache: {e}") from e
    if not reset:
        raise APIError(
            409,
            "requests are running or waiting; reset the prefix cache once they have finished",
            code="requests_running",
        )
    return JSONResponse({"reset": True})
