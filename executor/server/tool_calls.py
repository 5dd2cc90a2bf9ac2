"""Tool calls in a chat model's output: which format a chat template's model writes them in,
parsing a finished reply into its text and its calls, the same parse incrementally for a
stream (OpenAI's ``delta.tool_calls`` chunks), and the grammar that forces a call when the
request's ``tool_choice`` asks for one.

Formats (the name ``detect_format`` gives; the texts are what the model writes):

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3, SmolLM3): text, then one or more
  ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``;
- ``llama3_json`` (Llama 3.1-3.3 with custom tools): the whole reply is
  ``{"name": N, "parameters": {...}}`` (several: separated by ``;``), possibly after
  ``<|python_tag|>``;
- ``mistral`` (Mistral v3 templates): text, then ``[TOOL_CALLS][{"name": N, "arguments":
  {...}}, ...]``; ``mistral_args`` (the newer templates, Mistral Small 3.2, Devstral, Magistral):
  text, then ``[TOOL_CALLS]N[ARGS]{...}`` per call (an optional ``[CALL_ID]id`` after the name);
  both are parsed either way, the grammar writes the template's own;
- ``harmony`` (gpt-oss): messages ``<|channel|>C[ to=functions.N][ <|constrain|>json]<|message|>
  BODY<|end|>``, each after ``<|start|>assistant`` but the first; a message with a recipient
  ``functions.N`` is a call whose arguments are its body; the ``final`` (and a recipient-less
  ``commentary``) channels are the reply's text, ``analysis`` (the reasoning) is left out.

Markers that are control tokens of the vocabulary (``[TOOL_CALLS]``, ``<|python_tag|>``, the
harmony ones) are dropped when text is decoded; the server keeps them in a tools request's text
(``FORMAT_MARKERS``), as llama.cpp's server keeps a format's "preserved tokens".

Parsing rules (one rule, streamed or not: the streamed deltas join to the unstreamed reply):

- The reply's text is what lies outside the calls, stripped of surrounding whitespace; ``None``
  beside calls when empty.
- A call whose JSON does not parse, whose name is not among the request's tools, or whose
  arguments are not a JSON object is not a call: its raw text stays in the reply's text (a model
  that half-writes a call gets its words back, never a 500 and never a call the client cannot
  dispatch).
- ``parallel_tool_calls: false`` keeps the first call; later ones are dropped.
- ``arguments`` is the JSON text of the arguments object as ``json.dumps`` writes it
  (``", "``, ``": "``, non-ASCII kept); ids are ``call_`` and 24 hex digits (9 letters and
  digits for the Mistral formats, whose templates refuse other ids in later requests).
- Streamed, text is sent as it comes except a tail that may begin a call marker (``<tool_c``), and
  whitespace that may turn out to end the reply; a call is sent once it is complete (its closing
  marker seen, or the reply ended): a first chunk with ``index``, ``id``, ``type`` and
  ``function.name`` (``arguments: ""``), then one with ``function.arguments``. A call is never
  half sent, so a malformed one can still fall back to text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from strata.executor.grammar import JSON_OPTIONS, GrammarError, lark_grammar
from strata.executor.server.protocol import APIError, NamedToolChoice

if TYPE_CHECKING:
    from strata.executor.server.protocol import ChatCompletionRequest
    from strata.executor.tokenizer import GGUFTokenizer

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
MISTRAL_ARGS = "mistral_args"
HARMONY = "harmony"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, HARMONY)

FORMAT_MARKERS: dict[str, tuple[str, ...]] = {
    HERMES: ("<tool_call>", "</tool_call>"),
    LLAMA3_JSON: ("<|python_tag|>",),
    MISTRAL: ("[TOOL_CALLS]",),
    MISTRAL_ARGS: ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    HARMONY: ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>"),
}
"""The marker texts of each format: those that are single control tokens of a vocabulary are
decoded into a tools request's text (and named by id in its grammar)."""

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_TOOL_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_H_START, _H_CHANNEL, _H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_H_CONSTRAIN = "<|constrain|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>")


def detect_format(template: str) -> str | None:
    """The tool-call format a chat template's model writes (see the module's list), from the
    markers the template renders its assistant tool calls with; None when it renders none this
    server parses (e.g. ChatML without tools: SmolLM2's, Gemma 3's)."""
    if _H_CHANNEL in template and ("<|call|>" in template or "to=functions" in template):
        return HARMONY
    if _TOOL_CALLS in template:
        return MISTRAL_ARGS if _ARGS in template else MISTRAL
    if _HERMES_OPEN in template:
        return HERMES
    if _PYTHON_TAG in template or (
        "<|start_header_id|>" in template and '"parameters"' in template
    ):
        return LLAMA3_JSON
    return None


@dataclass(frozen=True)
class Call:
    """One parsed call: the function's name and its arguments' JSON text."""

    name: str
    arguments: str


@dataclass
class Scan:
    """What a reply's text holds so far: its text outside the calls (raw, unstripped) and the
    complete calls, in order. Scanning a longer text never changes what a shorter one gave:
    each scan's ``content`` is a prefix of a later one's and its ``calls`` a prefix of a later
    one's (``final``: the text is whole).

    A partial scan may also say where a later one can start: ``content[:settled]`` and
    ``calls[:settled_calls]`` are all of ``text[:resume]``, whatever follows, and scanning
    ``text[resume:]`` gives the rest (0: scan from the start each time), so a stream scans each
    character a bounded number of times rather than the whole reply at every chunk."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)
    resume: int = 0
    settled: int = 0
    settled_calls: int = 0


def _call_from(obj: Any, args_keys: tuple[str, ...], names: Collection[str] | None) -> Call | None:
    """A ``Call`` from a parsed ``{"name": N, <args key>: {...}}`` object, or None when it is
    not one (no name, a name not in ``names``, arguments that are not an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    return _call(obj["name"], args, names)


def _call(name: str, args: Any, names: Collection[str] | None) -> Call | None:
    if isinstance(args, str):  # some models write the arguments as a JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or (names is not None and name not in names):
        return None
    return Call(name, json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def _held(tail: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``tail`` may be the start of one of ``markers``
    (held back from a stream until the next text shows whether they are)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(tail)), best, -1):
            if tail.endswith(marker[:k]):
                best = k
                break
    return best


def _scan_hermes(text: str, final: bool, names: Collection[str] | None) -> Scan:
    scan = Scan()
    parts: list[str] = []
    pos = 0
    while True:
        start = text.find(_HERMES_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            kept = len(tail) if final else len(tail) - _held(tail, [_HERMES_OPEN])
            parts.append(tail[:kept])
            scan.resume = pos + kept
            break
        parts.append(text[pos:start])
        close = text.find(_HERMES_CLOSE, start)
        if close < 0 and not final:
            scan.resume = start
            break  # an open call: wait for its end
        end = len(text) if close < 0 else close + len(_HERMES_CLOSE)
        body = text[start + len(_HERMES_OPEN) : close if close >= 0 else len(text)]
        ok, obj = _loads(body)
        call = _call_from(obj, ("arguments", "parameters"), names) if ok else None
        if call is None:
            parts.append(text[start:end])
        else:
            scan.calls.append(call)
        pos = end
    scan.content = "".join(parts)
    scan.settled, scan.settled_calls = len(scan.content), len(scan.calls)
    return scan


def _json_objects(text: str) -> list[Any] | None:
    """The JSON values of ``text``, one after another, separated by whitespace or ``;``
    (Llama 3's parallel calls); None when any part is not JSON."""
    decoder = json.JSONDecoder()
    values = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values or None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def _scan_llama3(text: str, final: bool, names: Collection[str] | None) -> Scan:
    s = text.lstrip()
    maybe_call = s.startswith(("{", _PYTHON_TAG))
    if not final:
        if maybe_call or _PYTHON_TAG.startswith(s):  # "" too: nothing shown yet
            return Scan()
        return Scan(text)
    if maybe_call:
        values = _json_objects(s.removeprefix(_PYTHON_TAG))
        calls = [_call_from(v, ("parameters", "arguments"), names) for v in values or []]
        if calls and all(c is not None for c in calls):
            return Scan("", [c for c in calls if c is not None])
    return Scan(text)


def _mistral_calls(rest: str, names: Collection[str] | None) -> list[Call] | None:
    """The calls after the first ``[TOOL_CALLS]`` (``rest`` starts after it): a JSON array (or
    object) of ``{"name", "arguments"}``, or ``N[ARGS]{...}`` parts each after a
    ``[TOOL_CALLS]``; None when any part is not a call."""
    calls: list[Call | None] = []
    for part in rest.split(_TOOL_CALLS):
        part = part.strip()
        if part.startswith(("[", "{")):
            ok, value = _loads(part)
            if not ok:
                return None
            items = value if isinstance(value, list) else [value]
            calls += [_call_from(v, ("arguments", "parameters"), names) for v in items]
            continue
        head, sep, args_text = part.partition(_ARGS)
        if not sep:
            return None
        name = head.partition(_CALL_ID)[0].strip()
        ok, args = _loads(args_text)
        calls.append(_call(name, args, names) if ok else None)
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _scan_mistral(text: str, final: bool, names: Collection[str] | None) -> Scan:
    start = text.find(_TOOL_CALLS)
    if start < 0:
        kept = len(text) if final else len(text) - _held(text, [_TOOL_CALLS])
        return Scan(text[:kept], resume=kept, settled=kept)
    if not final:  # the calls run to the end of the reply
        return Scan(text[:start], resume=start, settled=start)
    calls = _mistral_calls(text[start + len(_TOOL_CALLS) :], names)
    return Scan(text) if calls is None else Scan(text[:start], calls)


_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(_H_CHANNEL) + r"\s*([A-Za-z_]+)")


def _scan_harmony(text: str, final: bool, names: Collection[str] | None) -> Scan:
    scan = Scan()
    parts: list[str] = []
    messages = text.split(_H_START)
    for k, message in enumerate(messages):
        if k == len(messages) - 1:  # the last message may still grow: later scans start here
            scan.resume = len(text) - len(message)
            scan.settled, scan.settled_calls = sum(map(len, parts)), len(scan.calls)
        complete = final or k < len(messages) - 1
        header, sep, body = message.partition(_H_MESSAGE)
        if not sep:  # no body (yet): text that is not a harmony message is the reply's text
            if not complete:
                break
            parts.append(message)
            continue
        ends = [i for i in (body.find(e) for e in _H_ENDS) if i >= 0]
        if ends:
            body, complete = body[: min(ends)], True
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None:
            if not complete:
                break  # a call: wait for its end
            name = recipient.group(1)
            ok, args = _loads(body)
            call = None
            if ok and name.startswith("functions."):
                call = _call(name.removeprefix("functions."), args, names)
            if call is None:
                parts.append(body)
            else:
                scan.calls.append(call)
        elif channel is None or channel.group(1) != "analysis":
            if complete:
                parts.append(body)
            else:
                markers = (_H_START, *_H_ENDS)
                parts.append(body[: len(body) - _held(body, markers)])
        if not complete:
            break
    scan.content = "".join(parts)
    return scan


_SCANNERS = {
    HERMES: _scan_hermes,
    LLAMA3_JSON: _scan_llama3,
    MISTRAL: _scan_mistral,
    MISTRAL_ARGS: _scan_mistral,
    HARMONY: _scan_harmony,
}


def scan(fmt: str, text: str, final: bool, names: Collection[str] | None = None) -> Scan:
    """The text and the complete calls of a reply (``final``: whole; else so far) in format
    ``fmt``; ``names``: the functions that may be called (None: any).

    Raises:
        ValueError: ``fmt`` is not one of ``FORMATS``.
    """
    scanner = _SCANNERS.get(fmt)
    if scanner is None:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
    return scanner(text, final, names)


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def new_call_id(fmt: str | None = None) -> str:
    """An id for a call: ``call_`` and 24 random hex digits (OpenAI's ids start ``call_``); for
    the Mistral formats 9 random letters and digits, the only ids Mistral's templates take back
    in the next request's history (they ``raise_exception`` on others; vLLM makes the same)."""
    if fmt in (MISTRAL, MISTRAL_ARGS):
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """The calls of one reply, parsed whole (``parse``) or as it streams (``push``, then
    ``finish``), by the module's rules.

    Args:
        fmt: one of ``FORMATS``.
        names: the functions of the request's ``tools`` (a call to another is text).
        parallel: False keeps only the first call (``parallel_tool_calls: false``).
        forced: a reply under a forced call's grammar (``tool_choice`` ``"required"`` or a named
            function), which is only calls: no text is sent or returned, so a call cut short by
            ``max_tokens`` is dropped rather than shown as markup.
    """

    def __init__(
        self,
        fmt: str,
        names: Collection[str] | None = None,
        parallel: bool = True,
        forced: bool = False,
    ):
        if fmt not in _SCANNERS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt = fmt
        self.names = None if names is None else frozenset(names)
        self.parallel, self.forced = parallel, forced
        self._text = ""
        self._sent = ""  # the content sent so far
        self._ids: list[str] = []  # the ids of the calls sent so far
        self._offset = 0  # where the next scan starts (Scan.resume)
        self._base = Scan()  # the content and calls of self._text[: self._offset]

    @property
    def calls(self) -> int:
        """Calls sent so far (after ``finish``: all of the reply's)."""
        return len(self._ids)

    def _scan(self, final: bool) -> tuple[str, list[Call]]:
        found = scan(self.fmt, self._text[self._offset :], final, self.names)
        raw = self._base.content + found.content
        calls = self._base.calls + found.calls
        if not final and found.resume:
            self._base = Scan(
                self._base.content + found.content[: found.settled],
                self._base.calls + found.calls[: found.settled_calls],
            )
            self._offset += found.resume
        content = "" if self.forced else raw.strip()
        return content, calls if self.parallel else calls[:1]

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply: its text (None when empty beside calls) and its calls as OpenAI's
        ``message.tool_calls``."""
        self._text, self._offset, self._base = text, 0, Scan()
        content, calls = self._scan(final=True)
        tool_calls = [
            {
                "id": new_call_id(self.fmt),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
        self._ids = [c["id"] for c in tool_calls]
        return (content or None) if tool_calls else content, tool_calls

    def push(self, text: str) -> list[dict]:
        """The deltas that ``text``, appended to the reply, makes safe to send: ``{"content":
        str}`` and ``{"tool_calls": [...]}`` objects (each a chunk's ``delta``)."""
        self._text += text
        return self._deltas(final=False)

    def finish(self) -> list[dict]:
        """The deltas left once the reply is whole."""
        return self._deltas(final=True)

    def _deltas(self, final: bool) -> list[dict]:
        content, calls = self._scan(final)
        deltas: list[dict] = []
        if len(content) > len(self._sent):
            # Every scan's text extends the last one's (Scan's rule): send the new part.
            assert content.startswith(self._sent), (content, self._sent)
            deltas.append({"content": content[len(self._sent) :]})
            self._sent = content
        for index in range(len(self._ids), len(calls)):
            call = calls[index]
            call_id = new_call_id(self.fmt)
            self._ids.append(call_id)
            head = {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            deltas.append({"tool_calls": [head]})
            args = {"index": index, "function": {"arguments": call.arguments}}
            deltas.append({"tool_calls": [args]})
        return deltas


# ------------------------------------------------------------------------------------ grammars


def _parameters(function: Mapping[str, Any]) -> dict:
    """A function's arguments schema (none given: the empty object)."""
    schema = function.get("parameters")
    if schema is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return dict(schema)


def _json_rule(schema: Mapping[str, Any]) -> str:
    """``%json {...}`` with ``executor.grammar.JSON_OPTIONS`` (the separators ``json.dumps``
    writes, no free whitespace, unknown schema keywords an error; a request's parameters carry
    no ``x-guidance`` of their own: ``protocol.FunctionDefinition`` refuses it)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#...``: ``#/$defs/X``, ``#/definitions/X``, ``#``)
    made relative to ``base``, the pointer where the schema now sits inside a larger one."""
    if isinstance(schema, dict):
        return {
            k: base + v[1:]
            if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else _rebased(v, base)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def _call_object(name: str, args_key: str, params: dict, defs: dict) -> dict:
    """The schema of ``{"name": name, args_key: <params>}``. A parameters schema whose
    ``$ref``s point into itself (pydantic's ``#/$defs/...``) would point into the call object
    once nested in it, so it goes into ``defs`` (to be the root's ``$defs``) as
    ``arguments_<name>``, its references rebased there, and the property refers to it."""
    if '"$ref": "#' in json.dumps(params):
        slot = f"arguments_{name}"
        defs[slot] = _rebased(params, f"#/$defs/{slot}")
        params = {"$ref": f"#/$defs/{slot}"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _with_defs(schema: dict, defs: dict) -> dict:
    return {**schema, "$defs": defs} if defs else schema


def call_grammar(
    fmt: str,
    tools: Sequence[Mapping[str, Any]],
    name: str | None,
    parallel: bool,
    special: Mapping[str, int] | None = None,
    auto: bool = False,
) -> str:
    """A grammar in llguidance's Lark dialect that forces a reply made only of calls in format
    ``fmt``: exactly one call to ``name``, or (``name`` None: ``tool_choice: "required"``) one
    or more calls (one when not ``parallel``) to any of ``tools``; each call's arguments follow
    its function's ``parameters`` schema (as ``%json``). The reply ends after the last call (the
    grammar then allows only end-of-generation tokens).

    With ``auto`` (``tool_choice: "auto"`` beside ``strict`` tools), the reply may be free
    text instead; once it writes the format's call marker, what follows is a call of the same
    rules (llguidance's lazy lexemes: free text up to the first marker, as llama.cpp's lazy
    grammars trigger on it).

    Args:
        fmt: one of ``FORMATS``.
        tools: the request's tools, ``[{"type": "function", "function": {"name", "parameters"
            ...}}]``.
        name: the function ``tool_choice`` names, or None.
        parallel: whether several calls may be made (harmony makes one per reply: its
            ``<|call|>`` ends the turn).
        special: marker text -> token id, for the format's markers that are control tokens of
            the vocabulary (written as ``<[id]>``: text could never produce them); markers not
            in it are written as text.

    Raises:
        ValueError: an unknown format, ``name`` not among ``tools``, or ``auto`` for harmony.
    """
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if name is not None and name not in functions:
        raise ValueError(f"{name!r} is not among the tools ({', '.join(functions)})")
    chosen = [name] if name is not None else list(functions)
    special = special or {}

    def marker(text: str) -> str:
        token = special.get(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    rules: list[str] = []
    alternatives = " | ".join(f"call_{i}" for i in range(len(chosen)))
    many = parallel and name is None
    if fmt == HERMES:
        for i, fn in enumerate(chosen):
            defs: dict = {}
            obj = _call_object(fn, "arguments", _parameters(functions[fn]), defs)
            rules.append(f"call_{i}: {_json_rule(_with_defs(obj, defs))}")
        rules.append(f'tail: "\\n" ({alternatives}) "\\n" {marker(_HERMES_CLOSE)}')
        rules.append(f"call: {marker(_HERMES_OPEN)} tail")
        start = 'call ("\\n" call)*' if many else "call"
        if auto and _HERMES_OPEN in special:  # text can never write the marker
            start = f"TEXT (call TEXT){'*' if parallel else '?'}"
        elif auto:  # free text up to the first "<tool_call>", then a call
            rules.append(f"head[lazy]: TEXT {marker(_HERMES_OPEN)}")
            start = f"(head tail){'*' if parallel else '?'} TEXT"
    elif fmt == LLAMA3_JSON:
        for i, fn in enumerate(chosen):
            defs = {}
            obj = _call_object(fn, "parameters", _parameters(functions[fn]), defs)
            rules.append(f"call_{i}: {_json_rule(_with_defs(obj, defs))}")
        rules.append(f"call: {alternatives}")
        start = 'call ("; " call)*' if many else "call"
        if auto:  # a reply that starts with "{" is a call; any other is text
            rules.append("PLAIN: /[^{](.|\\n)*/")
            start = f"({start} | PLAIN)?"
    elif fmt == MISTRAL:
        defs = {}
        items = [_call_object(fn, "arguments", _parameters(functions[fn]), defs) for fn in chosen]
        array: dict[str, Any] = {
            "type": "array",
            "items": items[0] if len(items) == 1 else {"anyOf": items},
            "minItems": 1,
        }
        if not many:
            array["maxItems"] = 1
        rules.append(f"calls: {_json_rule(_with_defs(array, defs))}")
        start = f"{marker(_TOOL_CALLS)} calls"
        if auto and _TOOL_CALLS in special:  # the calls run to the end of the reply
            start = f"TEXT ({start})?"
        elif auto:
            rules.append(f"head[lazy]: TEXT {marker(_TOOL_CALLS)}")
            start = "TEXT | head calls"
    elif fmt == MISTRAL_ARGS:
        for i, fn in enumerate(chosen):
            args = _json_rule(_parameters(functions[fn]))
            rules.append(f"call_{i}: {json.dumps(fn)} {marker(_ARGS)} {args}")
        rules.append(f"call: {marker(_TOOL_CALLS)} ({alternatives})")
        start = "call+" if many else "call"
        if auto and _TOOL_CALLS in special:
            start = f"TEXT call{'*' if parallel else '?'}"
        elif auto:
            rules.append(f"head[lazy]: TEXT {marker(_TOOL_CALLS)}")
            more = "call*" if parallel else ""
            start = f"TEXT | head ({alternatives}) {more}"
    elif fmt == HARMONY:
        for i, fn in enumerate(chosen):
            head = json.dumps(f"commentary to=functions.{fn} ")
            args = _json_rule(_parameters(functions[fn]))
            rules.append(
                f"call_{i}: {marker(_H_CHANNEL)} {head} {marker(_H_CONSTRAIN)} "
                f'"json" {marker(_H_MESSAGE)} {args}'
            )
        start = alternatives
        if auto:
            raise ValueError(
                "harmony replies are not constrained in auto mode (their channels are the "
                "model's to choose)"
            )
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
    if auto:
        rules.append("TEXT: /(.|\\n)*/")
    return "\n".join([f"start: {start}", *rules]) + "\n"


def control_markers(fmt: str, tokenizer: GGUFTokenizer) -> dict[str, int]:
    """The markers of ``fmt`` that are single control tokens of ``tokenizer``'s vocabulary
    (marker text -> id): decoding drops them unless kept, and a grammar names them by id."""
    found = {}
    for text in FORMAT_MARKERS[fmt]:
        ids = tokenizer.encode(text, add_bos=False, add_eos=False, parse_special=True)
        if len(ids) == 1 and tokenizer.is_control(ids[0]):
            found[text] = ids[0]
    return found


# ------------------------------------------------------------------------------ a chat request


@dataclass(frozen=True)
class ToolSetup:
    """How a chat request with tools is served.

    Attributes:
        fmt: the template's tool-call format (``FORMATS``).
        names: the functions of the request's ``tools``.
        parallel: whether several calls are kept (``parallel_tool_calls``).
        keep: the format's markers that are control tokens (ids), kept in the decoded text.
        grammar: for ``tool_choice`` ``"required"`` or a named function, the llguidance grammar
            forcing the call (``call_grammar``); for ``"auto"`` with ``strict`` tools, the one
            that lets the reply be text but holds its calls to the schemas; else None.
        forced: the reply is only calls (``tool_choice`` ``"required"`` or a named function).
    """

    fmt: str
    names: frozenset[str]
    parallel: bool
    keep: frozenset[int]
    grammar: str | None
    forced: bool = False

    def parser(self) -> ToolCallParser:
        """A fresh parser of one reply."""
        return ToolCallParser(self.fmt, self.names, self.parallel, self.forced)


def tool_setup(
    body: ChatCompletionRequest, template: str, template_name: str, tokenizer: GGUFTokenizer
) -> ToolSetup | None:
    """The serving of ``body``'s tools with a chat template (its text ``template``, named
    ``template_name`` in errors); None when no calls are parsed (no tools, or ``tool_choice:
    "none"``: the template still renders the tools, the reply stays text).

    Raises:
        APIError: 400 when the template writes no tool-call format this server parses, when
            ``logprobs`` are asked beside tools (the reply's text is not the tokens' text), when
            a function's ``parameters`` schema cannot be enforced (the feature named), or for
            ``strict`` tools in auto mode with harmony.
    """
    mode = body.tool_mode()
    if mode == "none":
        return None
    fmt = detect_format(template)
    if fmt is None:
        raise APIError(
            400,
            f"{template_name} renders no tool calls in a format this server parses (Hermes "
            "<tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], gpt-oss harmony): serve with "
            "--chat-template FILE of one that does, or leave tools out",
            param="tools",
        )
    if body.logprobs:
        raise APIError(
            400,
            "logprobs cannot go with tools (the reply's text and calls are parsed out of the "
            "tokens); leave one out",
            param="logprobs",
        )
    names = frozenset(t.function.name for t in body.tools or [])
    parallel = body.parallel_tool_calls is not False
    markers = control_markers(fmt, tokenizer)
    grammar = None
    tools = body.tool_definitions() or []
    if mode in ("required", "named"):
        choice = body.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        grammar = _compiled(call_grammar(fmt, tools, name, parallel, markers))
    elif any(t.function.strict for t in body.tools or []):
        # strict (OpenAI: the arguments always match the schema) holds in auto mode too: text,
        # or calls under the grammar, the strict functions' arguments by their schemas and the
        # others' as any JSON object.
        rf = body.response_format
        if isinstance(rf, dict) and rf.get("type") != "text":
            raise APIError(
                400,
                "response_format cannot go with strict tools (their calls are held to their "
                "schemas by a grammar of their own); leave one out",
                param="response_format",
            )
        if fmt == HARMONY:
            raise APIError(
                400,
                'strict tools with tool_choice "auto" cannot be enforced for gpt-oss (harmony '
                'channels): use tool_choice "required" or a named function, or leave strict out',
                param="tools",
            )
        loose = {"type": "object"}
        tools = [
            t
            if t["function"].get("strict")
            else {**t, "function": {**t["function"], "parameters": loose}}
            for t in tools
        ]
        grammar = _compiled(call_grammar(fmt, tools, None, parallel, markers, auto=True))
    forced = mode in ("required", "named")
    return ToolSetup(fmt, names, parallel, frozenset(markers.values()), grammar, forced)


def _compiled(lark: str) -> str:
    """``lark`` as an llguidance grammar, checked (``executor.grammar.lark_grammar``; control
    tokens, named by id, are checked by the engine against its vocabulary).

    Raises:
        APIError: 400 naming what llguidance cannot enforce (a schema feature, ...).
    """
    try:
        return lark_grammar(lark, "tools: a function's parameters")
    except GrammarError as e:
        raise APIError(400, str(e), param="tools") from None
