"""Tool calling through the OpenAI-compatible server: a real ``execute.py serve`` of
SmolLM2-135M-Instruct with a Hermes-style chat template (``tests/fixtures/data/
hermes_tools.jinja``: the GGUF's own is ChatML without tools), driven by the official ``openai``
client and ``httpx``.

``tool_choice: "auto"`` answers with text or with a parsed call (both shown with greedy
decoding: a plain request, and one whose history holds an earlier call the model imitates);
``"required"`` and a named function are forced by the grammar of ``server.tool_calls``; streamed
calls join to the unstreamed ones; malformed tool requests are 400s naming the field.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field
from test_server import MODEL, Server, error_of, serve_process

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "data" / "hermes_tools.jinja"
CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
EARLIER_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": "Paris", "unit": "celsius"}),
            },
        }
    ],
}
# A history holding an earlier call: the 135M model, greedy, answers the next question with a
# call of its own (asked plainly, it answers in text).
IMITATE = [*ASK, EARLIER_CALL, {"role": "user", "content": "What is the weather in London?"}]


@pytest.fixture(scope="module")
def server(smollm2_plan, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("serve-tools")
    with serve_process(
        smollm2_plan, folder / "stderr.txt", "--chat-template", str(TEMPLATE)
    ) as srv:
        yield srv


def weather_arguments_valid(arguments: str) -> bool:
    """Whether a call's arguments text meets WEATHER's parameters schema."""
    args = json.loads(arguments)
    return (
        isinstance(args, dict)
        and set(args) == {"city", "unit"}
        and isinstance(args["city"], str)
        and len(args["city"]) <= 24
        and args["unit"] in ("celsius", "fahrenheit")
    )


def test_tool_requests_are_validated(server):
    ok = {"model": MODEL, "messages": ASK, "max_tokens": 1, "tools": [WEATHER]}

    def function(**fields) -> list[dict]:
        return [{"type": "function", "function": fields}]

    fn = "tools.0.function"
    for tools, param, what in (
        ([{"type": "function"}], fn, "Field required"),
        ([{**WEATHER, "type": "retrieval"}], "tools.0.type", "function"),
        (function(name="get weather"), f"{fn}.name", "not a function name"),
        (function(name="f", parameters={"type": "string"}), f"{fn}.parameters", "JSON object"),
        ([WEATHER, WEATHER], "tools", "given twice"),
        ([], "tools", "tools is empty"),
    ):  # fmt: skip
        err = error_of(server.post(CHAT, {**ok, "tools": tools}), 400, what)
        assert err["param"] == param, err
    named = {"type": "function", "function": {"name": "get_time"}}
    for body, param, what in (
        ({**ok, "tool_choice": named}, "tool_choice", "'get_time', which is not among tools"),
        ({**ok, "tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({**ok, "tool_choice": "sometimes"}, "tool_choice", "is not a tool_choice"),
        ({**ok, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
        ({**ok, "logprobs": True}, "logprobs", "logprobs cannot go with tools"),
        ({**ok, "best_of": 2}, "best_of", "best_of"),
        ({**ok, "functions": [WEATHER["function"]]}, "functions", "send tools"),
        (
            {**ok, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "forced tool call",
        ),
    ):
        err = error_of(server.post(CHAT, body), 400, what)
        assert err["param"] == param, err

    def called_with(arguments) -> list[dict]:
        call = {**EARLIER_CALL["tool_calls"][0], "function": {"name": "f", "arguments": arguments}}
        return [*ASK, {**EARLIER_CALL, "tool_calls": [call]}]

    arguments = "messages.1.tool_calls.0.function.arguments"
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    text = {"type": "text", "text": "What is this?"}
    for messages, param, what in (
        (called_with("{city: Paris}"), arguments, "not JSON"),
        (called_with("[1, 2]"), arguments, "JSON text of an object"),
        (called_with({"city": "Paris"}), arguments, "string"),
        ([*ASK, EARLIER_CALL, {"role": "tool", "content": "18 C"}], "messages.2", "tool_call_id"),
        ([*ASK, EARLIER_CALL, {"role": "tool", "tool_call_id": "c"}], "messages.2", "content"),
        ([{**ASK[0], **EARLIER_CALL, "role": "user"}], "messages.0", "only an assistant"),
        ([{"role": "user", "content": [text, image]}], "messages.0.content", "'image_url'"),
        ([{"role": "system", "content": [audio]}], "messages.0.content", "'input_audio'"),
    ):
        err = error_of(server.post(CHAT, {**ok, "messages": messages}), 400, what)
        assert err["param"] == param, err
    # accepted: best_of 1, tool_choice none (the tools are rendered, the reply stays text), a
    # whole conversation with a call and its result, content as text parts
    history = [*ASK, EARLIER_CALL, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    for body in (
        {**ok, "best_of": 1},
        {**ok, "tool_choice": "none"},
        {**ok, "messages": history, "parallel_tool_calls": False},
        {**ok, "messages": parts, "tools": None},
    ):
        r = server.post(CHAT, body, timeout=300)  # the first prefill on a busy machine
        assert r.status_code == 200, r.text


def streamed_message(server: Server, **kw) -> tuple[str, list[dict], str]:
    """A streamed chat's text, calls and finish reason, put together from its chunks as the
    ``openai`` client hands them over."""
    stream = server.client().chat.completions.create(stream=True, **{"model": MODEL, **kw})
    content, calls, finish = "", [], None
    for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            if part.id is not None:
                assert part.index == len(calls) and part.type == "function"
                calls.append({"id": part.id, "name": part.function.name, "arguments": ""})
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_auto_answers_with_text_or_a_parsed_call(server):
    client = server.client()
    common = {"tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 40}
    text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], **common
    )
    (choice,) = text.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert "<tool_call>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    called = client.chat.completions.create(model=MODEL, messages=IMITATE, **common)
    (choice,) = called.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert weather_arguments_valid(call.function.arguments)
    assert json.loads(call.function.arguments)["city"] == "London"
    # Streamed, the same greedy reply: its deltas join to the same call.
    content, calls, finish = streamed_message(server, messages=IMITATE, **common)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
    # strict tools: the same replies under the auto grammar (text is free, the call already fit)
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    common = {**common, "tools": [strict, TIME]}
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], **common
    )
    assert again.choices[0].message.content == text.choices[0].message.content
    again = client.chat.completions.create(model=MODEL, messages=IMITATE, **common)
    assert again.choices[0].message.tool_calls[0].function == call.function


def test_forced_calls_follow_the_tools_schema(server):
    named = {"type": "function", "function": {"name": "get_weather"}}

    def ask(seed: int, choice) -> dict:
        body = {
            "model": MODEL,
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 80,  # the call's longest form is about 55 tokens
        }
        r = server.post(CHAT, body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # one batch of 8 sequences
        replies = list(pool.map(lambda s: ask(s, named if s < 6 else "required"), range(8)))
    named_replies, required = replies[:6], replies[6:]
    for choice in named_replies + required:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]  # parallel_tool_calls false: one call
        if call["function"]["name"] == "get_weather":
            assert weather_arguments_valid(call["function"]["arguments"]), call
        else:
            assert call in [c for r in required for c in r["message"]["tool_calls"]]
            assert call["function"] == {"name": "get_time", "arguments": "{}"}
    assert all(
        c["message"]["tool_calls"][0]["function"]["name"] == "get_weather" for c in named_replies
    )
    # Streamed with the same seed: the same call, in OpenAI's chunks.
    content, calls, finish = streamed_message(
        server,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=named,
        parallel_tool_calls=False,
        temperature=1.0,
        seed=0,
        max_tokens=80,
    )
    expected = named_replies[0]["message"]["tool_calls"][0]["function"]
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (expected["name"], expected["arguments"])
    ]


# ---------------------------------------------------------- a random-weight model, forced calls


class Where(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lat: int = Field(ge=-90, le=90)
    lon: int = Field(ge=-180, le=180)


class Forecast(BaseModel):
    """The arguments of FORECAST: a nested object, an array, an enum, bounded integers, a
    boolean, every field required, no other keys."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=14)
    hours: list[Annotated[int, Field(ge=0, le=23)]] = Field(min_length=1, max_length=3)
    where: Where
    alerts: bool


FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The weather forecast for a place",
        "parameters": Forecast.model_json_schema(),
    },
}


@pytest.fixture(scope="module")
def random_server(smollm2_gguf, tmp_path_factory) -> Iterator[Server]:
    """``serve`` on a random-weight synthetic model (qwen3 shape, SmolLM2's tokenizer) with the
    Hermes template: its free text is gibberish, so a valid call can only come from the
    grammar."""
    from conftest import make_plan_file
    from gguf_factory import write_arch_model

    folder = tmp_path_factory.mktemp("tools-random")
    gguf = write_arch_model(folder / "qwen3.gguf", "qwen3", smollm2_gguf)
    plan = make_plan_file(str(gguf), folder / "plan.yaml", concurrency=8, context=1024)
    options = ("--chat-template", str(TEMPLATE))
    with serve_process(plan, folder / "stderr.txt", *options, model="qwen3") as srv:
        yield srv


def test_random_model_calls_a_named_tool_100_of_100(random_server):
    """Acceptance 2: a named ``tool_choice`` returns a call whose arguments validate against
    the tool's schema, 100 requests of 100 at concurrency 8; streamed, the deltas join to the
    same call as the unstreamed reply of the same seed."""
    client = random_server.client()
    named = {"type": "function", "function": {"name": "get_forecast"}}
    common = {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "Will it rain in Oslo this week?"}],
        "tools": [WEATHER, FORECAST],
        "tool_choice": named,
        "temperature": 1.0,
        "max_tokens": 200,
    }

    def called(seed: int) -> tuple[str, str]:
        r = client.chat.completions.create(seed=seed, **common)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_forecast"
        Forecast.model_validate_json(call.function.arguments)  # raises when it does not fit
        return call.function.name, call.function.arguments

    def streamed(seed: int) -> tuple[str, str]:
        content, calls, finish = streamed_message(random_server, seed=seed, **common)
        assert content == "" and finish == "tool_calls"
        (call,) = calls
        return call["name"], call["arguments"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        calls = list(pool.map(called, range(100)))
        streams = list(pool.map(streamed, range(8)))
    assert len(calls) == 100 and len({args for _, args in calls}) > 5  # sampled: not one call
    assert streams == calls[:8]
    # Unforced, the same model writes no call at all.
    free = client.chat.completions.create(
        **{**common, "tool_choice": "auto", "temperature": 0, "max_tokens": 30}
    )
    assert free.choices[0].finish_reason == "length"
    assert free.choices[0].message.tool_calls is None


def test_forced_calls_cut_by_max_tokens_finish_with_length(server):
    """A forced reply cut by ``max_tokens`` (greedy SmolLM2 repeats its call while parallel
    calls are allowed) says ``"length"``, streamed or not, even beside the calls it completed:
    ``"tool_calls"`` is for a reply that ended by itself."""
    kw = {
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 60,
    }
    r = server.post(CHAT, {"model": MODEL, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 60
    assert choice["finish_reason"] == "length", choice
    _, _, finish = streamed_message(server, **kw)
    assert finish == "length"
