"""Tool calls (``executor.server.tool_calls``): format detection from chat templates, parsing of
every format whole and streamed (the streamed deltas join to the unstreamed reply), the grammars
that force a call (compiled by llguidance and run against SmolLM2's real vocabulary), and the
rendering of tools, tool calls and list-of-parts content through chat templates."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import llguidance
import pytest
from pydantic import ValidationError
from strata.executor.chat import builtin_template, render_chat
from strata.executor.server import tool_calls
from strata.executor.server.protocol import APIError, ChatCompletionRequest
from strata.executor.server.tool_calls import (
    FORMATS,
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    ToolCallParser,
    call_grammar,
    detect_format,
    tool_setup,
)

HERMES_TEMPLATE = Path(__file__).parents[1] / "fixtures" / "data" / "hermes_tools.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
NAMES = ("get_weather", "get_time")
PARIS = {"city": "Paris", "unit": "c"}
PARIS_TEXT = json.dumps(PARIS)

# ----------------------------------------------------------------------------- format detection


def test_formats_are_detected_from_the_templates_markers():
    assert detect_format(HERMES_TEMPLATE.read_text()) == HERMES
    llama31 = (
        "<|start_header_id|>assistant<|end_header_id|>\n\n{%- if builtin_tools %}<|python_tag|>"
        '{%- endif %}{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
    )
    assert detect_format(llama31) == LLAMA3_JSON
    assert detect_format("{{- '[TOOL_CALLS][' + calls | tojson + ']' }}") == MISTRAL
    assert detect_format("{{- '[TOOL_CALLS]' + name + '[ARGS]' + args }}") == MISTRAL_ARGS
    harmony = "{{- '<|start|>assistant to=functions.' + name + '<|channel|>commentary' }}<|call|>"
    assert detect_format(harmony) == HARMONY
    # ChatML without tools (SmolLM2's GGUF template) and Gemma 3's: no format.
    assert detect_format(builtin_template("chatml")) is None
    assert detect_format(builtin_template("gemma3")) is None


# ------------------------------------------------------------------------------------- parsing

CASES = [
    # (format, text, content, [(name, arguments object)])
    (
        HERMES,
        f'I will look.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS_TEXT}}}\n'
        "</tool_call>",
        "I will look.",
        [("get_weather", PARIS)],
    ),
    (
        HERMES,  # two calls, the second unclosed at the end of the reply; arguments as a text
        f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS_TEXT}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": "{}"}',
        None,
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (HERMES, "Paris is sunny today. <tool_cal is not a call", None, []),
    (
        HERMES,  # broken JSON: the block stays text, the good call is kept
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> then '
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> then',
        [("get_time", {})],
    ),
    (
        HERMES,  # a function that is not among the tools: text
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        LLAMA3_JSON,
        f'{{"name": "get_weather", "parameters": {PARIS_TEXT}}}',
        None,
        [("get_weather", PARIS)],
    ),
    (
        LLAMA3_JSON,
        f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS_TEXT}}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (LLAMA3_JSON, "  It is 18 degrees in Paris.\n", "It is 18 degrees in Paris.", []),
    (LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
    (
        MISTRAL,
        f'Checking. [TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS_TEXT}, '
        '"id": "a1b2c3d4e"}, {"name": "get_time", "arguments": {}}]',
        "Checking.",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {',
        [],
    ),
    (
        MISTRAL_ARGS,
        f"[TOOL_CALLS]get_weather[ARGS]{PARIS_TEXT}[TOOL_CALLS]get_time[CALL_ID]x9[ARGS]{{}}",
        None,
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (MISTRAL_ARGS, "No call [TOOL_CALL] here", "No call [TOOL_CALL] here", []),
    (
        HARMONY,
        "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        f"{PARIS_TEXT}",
        None,
        [("get_weather", PARIS)],
    ),
    (
        HARMONY,  # the recipient before the channel, as gpt-oss also writes it
        f" to=functions.get_weather<|channel|>commentary json<|message|>{PARIS_TEXT}",
        None,
        [("get_weather", PARIS)],
    ),
    (
        HARMONY,
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is sunny in Paris.",
        "It is sunny in Paris.",
        [],
    ),
]


def _calls(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def _id_of(fmt: str, call_id: str) -> bool:
    """Whether ``call_id`` is an id of the format's kind: 9 letters and digits for Mistral's
    (its templates take back no other), ``call_`` and 24 hex digits otherwise."""
    if fmt in (MISTRAL, MISTRAL_ARGS):
        return len(call_id) == 9 and call_id.isalnum() and call_id.isascii()
    return re.fullmatch(r"call_[0-9a-f]{24}", call_id) is not None


def _streamed(fmt: str, pieces: list[str], parallel: bool = True) -> tuple[str, list[dict]]:
    """The content and the calls that a stream of ``pieces`` sends, put back together as a
    client does (checking the chunks' shape on the way)."""
    parser = ToolCallParser(fmt, NAMES, parallel)
    deltas = [d for p in pieces for d in parser.push(p)] + parser.finish()
    content = ""
    calls: list[dict] = []
    for d in deltas:
        assert len(d) == 1, d
        if "content" in d:
            assert d["content"], "no empty content delta"
            content += d["content"]
            continue
        (part,) = d["tool_calls"]
        if "id" in part:  # a call's first chunk: its id, type and name; arguments follow
            assert part["index"] == len(calls) and _id_of(fmt, part["id"])
            assert part["type"] == "function" and part["function"]["arguments"] == ""
            calls.append({"id": part["id"], "type": "function", "function": dict(part["function"])})
        else:
            assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    assert parser.calls == len(calls)
    return content, calls


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_replies_parse_into_text_and_calls_streamed_or_not(fmt, text, content, calls):
    got_content, got_calls = ToolCallParser(fmt, NAMES).parse(text)
    expected = content if calls or content is not None else text.strip()
    assert got_content == expected
    assert _calls(got_calls) == calls
    assert all(_id_of(fmt, c["id"]) and c["type"] == "function" for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    rng = random.Random(len(text))
    splits = [[text], list(text)]  # whole, and one character at a time
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        streamed_content, streamed_calls = _streamed(fmt, pieces)
        assert streamed_content == (got_content or "")
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in got_calls]


def test_a_stream_holds_back_only_what_may_start_a_call():
    parser = ToolCallParser(HERMES, NAMES)
    assert parser.push("Let me check <tool") == [{"content": "Let me check"}]
    assert parser.push("box> and more ") == [{"content": " <toolbox> and more"}]
    assert parser.push("<tool_call>\n") == []  # an open call: nothing until it closes
    assert parser.push('{"name": "get_time", "arguments": {}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "id": parser._ids[0], "type": "function",
                         "function": {"name": "get_time", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
    ]  # fmt: skip
    assert parser.finish() == []
    assert parser.calls == 1
    # Llama 3: a reply that starts like JSON is held whole; other text flows at once.
    llama = ToolCallParser(LLAMA3_JSON, NAMES)
    assert llama.push('{"name": "get_time", ') == []
    assert llama.finish() == [{"content": '{"name": "get_time",'}]  # never closed: text
    llama = ToolCallParser(LLAMA3_JSON, NAMES)
    assert llama.push("<|py") == [] and llama.push("Sunny.") == [{"content": "<|pySunny."}]
    # Harmony: the final channel streams, the analysis channel never shows.
    h = ToolCallParser(HARMONY, NAMES)
    assert h.push("<|channel|>analysis<|message|>hmm") == []
    assert h.push("<|end|><|start|>assistant<|channel|>final<|message|>Sun<|") == [
        {"content": "Sun"}
    ]
    assert h.push("ny") == [{"content": "<|ny"}]


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = (
        f'<tool_call>{{"name": "get_weather", "arguments": {PARIS_TEXT}}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = ToolCallParser(HERMES, NAMES, parallel=False).parse(text)
    assert content is None and _calls(calls) == [("get_weather", PARIS)]
    _, streamed = _streamed(HERMES, list(text), parallel=False)
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]


def test_a_forced_reply_is_only_calls_and_drops_a_call_cut_short():
    """Under a forced call's grammar (``tool_choice`` required or named) the reply is only calls:
    a second call cut by ``max_tokens`` is neither returned nor streamed as markup (a new user saw
    ``<tool_call>...</tool_call`` in ``content``); unforced, the same text stays text."""
    first = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS_TEXT}}}\n</tool_call>'
    text = first + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = ToolCallParser(HERMES, NAMES, forced=True).parse(text)
    assert content is None and _calls(calls) == [("get_weather", PARIS)]
    parser = ToolCallParser(HERMES, NAMES, forced=True)
    deltas = [d for ch in text for d in parser.push(ch)] + parser.finish()
    assert not [d for d in deltas if "content" in d] and parser.calls == 1
    loose, _ = ToolCallParser(HERMES, NAMES).parse(text)
    assert loose is not None and loose.startswith("<tool_call>")


# ------------------------------------------------------------------------------------ grammars

CALL_TEXTS = {
    # (format) -> a reply of calls in it, from (name, arguments JSON text) pairs
    HERMES: lambda calls: "\n".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls
    ),
    LLAMA3_JSON: lambda calls: "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls),
    MISTRAL: lambda calls: (
        "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"
    ),
    MISTRAL_ARGS: lambda calls: "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls),
    HARMONY: lambda calls: "".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{a}" for n, a in calls
    ),
}


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    from strata.executor.grammar import Vocabulary
    from strata.executor.tokenizer import GGUFTokenizer

    return Vocabulary(GGUFTokenizer.from_gguf(smollm2_gguf))


def _accepts(vocab, lark: str, text: str, prefix: tuple[int, ...] = ()) -> bool:
    """Whether the grammar ``lark`` takes ``text`` (SmolLM2's tokens of it) whole."""
    matcher = llguidance.LLMatcher(vocab.ll, llguidance.LLMatcher.grammar_from_lark(lark))
    assert not matcher.is_error(), matcher.get_error()
    ids = [*prefix, *vocab.tokenizer.encode(text, add_bos=False, add_eos=False)]
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", FORMATS)
def test_call_grammars_force_the_formats_calls_with_valid_arguments(fmt, vocab):
    write = CALL_TEXTS[fmt]
    weather, time = ("get_weather", PARIS_TEXT), ("get_time", "{}")
    for name in ("get_weather", None):
        for parallel in (True, False):
            lark = call_grammar(fmt, TOOLS, name, parallel)
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            assert llguidance.LLMatcher.validate_grammar(grammar, None) == "", lark
            assert _accepts(vocab, lark, write([weather]))
            # what the grammar forces, the parser reads back as the call
            content, calls = ToolCallParser(fmt, NAMES).parse(write([weather]))
            assert content is None and _calls(calls) == [("get_weather", PARIS)]
            assert _accepts(vocab, lark, write([time])) == (name is None)
            several = parallel and name is None and fmt != HARMONY
            assert _accepts(vocab, lark, write([weather, time])) == several
    lark = call_grammar(fmt, TOOLS, None, True)
    for bad in (
        '{"city": "Paris"}',  # a required property missing
        '{"city": "Paris", "unit": "kelvin"}',  # not in the enum
        '{"city": "Paris", "unit": "c", "wind": 3}',  # additionalProperties: false
        '{"city": "Paris", "unit": "c", "days": ["mon"]}',  # not integers
        '{"city": "Paris",  "unit": "c"}',  # free whitespace
    ):
        assert not _accepts(vocab, lark, write([("get_weather", bad)])), bad
    assert not _accepts(vocab, lark, "The weather is fine.")  # text is not a call
    assert not _accepts(vocab, lark, write([("get_wether", PARIS_TEXT)]))


def test_call_grammars_name_control_token_markers_by_id(vocab):
    # A control token of SmolLM2's vocabulary stands in for [TOOL_CALLS]: the grammar asks for
    # that token itself, which no text can produce.
    tok = vocab.tokenizer
    (marker,) = tok.encode("<|im_start|>", add_bos=False, add_eos=False, parse_special=True)
    assert tok.is_control(marker)
    lark = call_grammar(MISTRAL, TOOLS, "get_weather", False, {"[TOOL_CALLS]": marker})
    assert f"<[{marker}]>" in lark
    body = f'[{{"name": "get_weather", "arguments": {PARIS_TEXT}}}]'
    assert _accepts(vocab, lark, body, prefix=(marker,))
    assert not _accepts(vocab, lark, "[TOOL_CALLS]" + body)


def test_call_grammar_refuses_a_function_not_among_the_tools():
    with pytest.raises(ValueError, match="get_wether"):
        call_grammar(HERMES, TOOLS, "get_wether", True)


def test_a_parameters_schema_llguidance_cannot_enforce_is_a_400_naming_it(smollm2_gguf):
    from strata.executor.tokenizer import GGUFTokenizer

    bad = {"type": "object", "properties": {"when": {"type": "string", "format": "lunar-date"}}}
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
            "tool_choice": "required",
        }
    )
    tok = GGUFTokenizer.from_gguf(smollm2_gguf)
    with pytest.raises(APIError, match="lunar-date") as e:
        tool_setup(body, HERMES_TEMPLATE.read_text(), "the template", tok)
    assert e.value.status == 400 and e.value.param == "tools"
    setup = tool_setup(
        body.model_copy(update={"tool_choice": "auto"}), HERMES_TEMPLATE.read_text(), "t", tok
    )
    assert setup is not None and setup.grammar is None  # auto: no grammar, nothing to refuse
    with pytest.raises(APIError, match="renders no tool calls") as e:
        tool_setup(body, builtin_template("chatml"), "the built-in chatml template", tok)
    assert "chatml" in e.value.message


@pytest.mark.parametrize("extension", ["a", [1], {"whitespace_flexible": True}])
def test_x_guidance_in_parameters_is_a_400(extension):
    """Review: a non-object ``x-guidance`` was a 500 (TypeError) for the formats whose call
    grammar puts the parameters at a ``%json`` root (mistral_args, harmony), and an object one
    applied there but was ignored nested (hermes): the server's options hold for every format,
    a client's is refused."""
    params = {"type": "object", "x-guidance": extension}
    with pytest.raises(ValidationError, match="x-guidance"):
        ChatCompletionRequest.model_validate(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
            }
        )


# ----------------------------------------------------------------------------------- rendering


def _render(template: str, body: dict) -> str:
    request = ChatCompletionRequest.model_validate(body)
    request.check_unsupported()
    messages = [m.for_template() for m in request.messages]
    return render_chat(template, messages, "", "<|im_end|>", True, tools=request.tool_definitions())


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": PARIS_TEXT},
}


def test_tools_calls_and_tool_results_reach_the_template():
    text = _render(
        HERMES_TEMPLATE.read_text(),
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            ],
            "tools": TOOLS,
        },
    )
    assert json.dumps(WEATHER) in text and json.dumps(TIME) in text
    # the arguments reach the template as the object (``| tojson`` writes it once, not a
    # quoted JSON text), and null content renders as nothing, never "None"
    call = (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        f"{PARIS_TEXT}}}\n</tool_call><|im_end|>"
    )
    assert call in text
    assert "None" not in text and "null" not in text
    assert "<tool_response>\n18 C\n</tool_response>" in text


@pytest.mark.parametrize("template", ["hermes", "chatml", "gemma3"])
def test_null_content_beside_tool_calls_renders_as_empty_content(template):
    text = HERMES_TEMPLATE.read_text() if template == "hermes" else builtin_template(template)
    user = {"role": "user", "content": "Weather?"}
    null = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    empty = {**null, "content": ""}
    tail = {"role": "user", "content": "Thanks"}
    assert _render(text, {"messages": [user, null, tail]}) == _render(
        text, {"messages": [user, empty, tail]}
    )
    assert "None" not in _render(text, {"messages": [user, null, tail]})


@pytest.mark.parametrize("template", ["hermes", "chatml", "gemma3"])
def test_list_of_text_parts_renders_byte_identical_to_the_string(template):
    text = HERMES_TEMPLATE.read_text() if template == "hermes" else builtin_template(template)
    strings = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "user", "content": "And tomorrow? é 🌧"},
    ]
    if template == "gemma3":  # Gemma 3's template has no tool role
        strings = [m for m in strings if m["role"] != "tool"]

    def parts(content: str) -> list[dict]:
        cut = len(content) // 2
        return [{"type": "text", "text": content[:cut]}, {"type": "text", "text": content[cut:]}]

    listed = [{**m, "content": parts(m["content"])} for m in strings]
    assert _render(text, {"messages": listed}) == _render(text, {"messages": strings})


def test_a_tools_request_keeps_its_formats_control_tokens_in_the_text(smollm2_gguf):
    # SmolLM2's <|im_start|> (a control token) stands in for a marker such as [TOOL_CALLS]:
    # dropped from the text by default, written as its text when kept.
    from types import SimpleNamespace

    from strata.executor.sampling import SamplingParams
    from strata.executor.server.generation import Generation
    from strata.executor.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(smollm2_gguf)
    (marker,) = tok.encode("<|im_start|>", add_bos=False, add_eos=False, parse_special=True)
    ids = [*tok.encode("Hé"), marker, *tok.encode("x")]
    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok))

    def text(keep: frozenset[int]) -> str:
        gen = Generation(state, "r", [1], 8, SamplingParams(), [], False, keep=keep)
        return "".join(gen._text_of(t) for t in ids)

    assert text(frozenset()) == "Héx"
    assert text(frozenset({marker})) == "Hé<|im_start|>x"
    assert tool_calls.control_markers(HERMES, tok) == {}  # SmolLM2 writes <tool_call> as text


@pytest.mark.parametrize("fmt", FORMATS)
def test_call_grammars_keep_the_parameters_own_references(fmt, vocab):
    # pydantic writes nested models as "$ref": "#/$defs/..." from the parameters' root; nested
    # in a call object, those references still resolve to the parameters' definitions.
    place = {
        "type": "object",
        "properties": {"lat": {"type": "integer"}},
        "required": ["lat"],
        "additionalProperties": False,
    }
    params = {
        "$defs": {"Place": place},
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Place"}},
        "required": ["at"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "go", "parameters": params}}, TIME]
    lark = call_grammar(fmt, tools, None, False)
    assert _accepts(vocab, lark, CALL_TEXTS[fmt]([("go", '{"at": {"lat": 3}}')]))
    assert not _accepts(vocab, lark, CALL_TEXTS[fmt]([("go", '{"at": {"lat": "x"}}')]))
    assert not _accepts(vocab, lark, CALL_TEXTS[fmt]([("go", '{"at": {"lon": 3}}')]))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS])
def test_auto_grammars_of_strict_tools_let_text_through_and_hold_calls_to_the_schema(fmt, vocab):
    write = CALL_TEXTS[fmt]
    lark = call_grammar(fmt, TOOLS, None, True, auto=True)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark)) == ""
    assert _accepts(vocab, lark, "It is sunny in Paris today.")
    assert _accepts(vocab, lark, "")
    assert _accepts(vocab, lark, write([("get_weather", PARIS_TEXT)]))
    assert _accepts(vocab, lark, write([("get_weather", PARIS_TEXT), ("get_time", "{}")]))
    assert not _accepts(vocab, lark, write([("get_weather", '{"city": "Paris"}')]))
    assert not _accepts(vocab, lark, write([("get_wether", PARIS_TEXT)]))
    if fmt != LLAMA3_JSON:  # text before the calls (Llama 3's calls are the whole reply)
        assert _accepts(vocab, lark, "Let me look. " + write([("get_weather", PARIS_TEXT)]))
        bad = "Let me look. " + write([("get_weather", '{"city": 3, "unit": "c"}')])
        assert not _accepts(vocab, lark, bad)
    with pytest.raises(ValueError, match="harmony"):
        call_grammar(HARMONY, TOOLS, None, True, auto=True)


def test_strict_tools_in_auto_mode_get_a_grammar_unless_harmony(smollm2_gguf):
    from strata.executor.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(smollm2_gguf)
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [strict, TIME]}
    )
    setup = tool_setup(body, HERMES_TEMPLATE.read_text(), "t", tok)
    assert setup is not None and setup.grammar is not None
    # the non-strict get_time takes any JSON object; get_weather its schema
    assert '"const": "get_time"' in setup.grammar and '"unit"' in setup.grammar
    loose = body.model_copy(update={"tools": body.tools[1:]})
    assert tool_setup(loose, HERMES_TEMPLATE.read_text(), "t", tok).grammar is None
    harmony = "<|start|>assistant<|channel|>commentary to=functions.x<|call|>"
    with pytest.raises(APIError, match="strict") as e:
        tool_setup(body, harmony, "t", tok)
    assert e.value.param == "tools"
    with_format = body.model_copy(update={"response_format": {"type": "json_object"}})
    with pytest.raises(APIError, match="response_format") as e:
        tool_setup(with_format, HERMES_TEMPLATE.read_text(), "t", tok)


def test_gpt_oss_template_renders_tools_and_calls_in_harmony():
    # gpt-oss's own template (helper fixture of the gpt-oss tests): TypeScript-like tool
    # signatures in the developer message, the earlier call with its arguments object as JSON.
    template = Path(__file__).parents[1] / "fixtures" / "data" / "gpt_oss_chat_template.jinja"
    text = template.read_text()
    assert detect_format(text) == HARMONY
    rendered = _render(
        text,
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            ],
            # its template writes every tool's description (a tool without one fails to render)
            "tools": [
                WEATHER,
                {"type": "function", "function": {**TIME["function"], "description": "Now"}},
            ],
        },
    )
    assert "type get_weather = (_: {" in rendered and "type get_time = () => any;" in rendered
    call = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    assert call + PARIS_TEXT + "<|call|>" in rendered
    assert rendered.endswith("<|start|>assistant")


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_replies_stream_to_their_parse(fmt):
    """Replies assembled at random from text (with pieces of markers in it), good and broken
    calls, cut at random places: the streamed deltas always join to the unstreamed parse."""
    rng = random.Random(fmt)
    words = ["Sure.", " ", "\n", "<tool", "<tool_call", "[TOOL", "<|", "<|end", "{", "é🌧", "ok"]
    good = [("get_weather", PARIS_TEXT), ("get_time", "{}")]
    broken = [("get_weather", '{"city": '), ("rm", "{}")]

    def piece() -> str:
        kind = rng.random()
        if kind < 0.5:
            return "".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
        calls = rng.choice([good, broken, good[:1], broken[:1]])
        if fmt == HARMONY:
            channel = rng.choice(["final", "analysis", "commentary"])
            if kind < 0.75:
                return (
                    f"<|start|>assistant<|channel|>{channel}<|message|>{rng.choice(words)}<|end|>"
                )
            n, a = calls[0]
            head = f"<|start|>assistant<|channel|>commentary to=functions.{n} json<|message|>"
            return f"{head}{a}<|end|>"
        return CALL_TEXTS[fmt](calls)

    for _ in range(40):
        text = "".join(piece() for _ in range(rng.randint(1, 6)))
        content, calls = ToolCallParser(fmt, NAMES).parse(text)
        cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(1, 12), len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        for split in (pieces, list(text)):
            streamed_content, streamed_calls = _streamed(fmt, split)
            assert streamed_content == (content or ""), text
            assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls], text
