"""Chat messages -> prompt text -> token ids, through the model's own Jinja chat template.

Templates are rendered the way HuggingFace renders ``tokenizer_config.json`` templates (the dialect
they are written for, and the one llama.cpp emulates): a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block,
a ``tojson`` filter that keeps non-ASCII text, and the ``raise_exception`` and ``strftime_now``
globals.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from strata.common.errors import StrataError

if TYPE_CHECKING:
    from strata.executor.tokenizer import GGUFTokenizer


class ChatError(StrataError, ValueError):
    """The messages are malformed, or the chat template is missing or fails on them."""


BUILTIN_TEMPLATES = {"chatml": "chatml.jinja", "gemma3": "gemma3.jinja"}
"""Chat templates shipped with Strata (``executor/templates/``), by the name ``--chat-template``
takes in place of a file."""

ARCHITECTURE_TEMPLATES = {"gemma3": "gemma3"}
"""The built-in template used for a GGUF of this ``general.architecture`` that carries none
(llama.cpp's converter writes no template for Gemma-3 base models, as the catalog's
Gemma-3-270M shows; llama.cpp itself falls back to a template picked by model too)."""

NO_TEMPLATE = (
    "this model's GGUF has no chat template (tokenizer.chat_template) and no built-in one fits "
    f"its architecture; pass --chat-template FILE (a Jinja template) or a built-in name "
    f"({', '.join(BUILTIN_TEMPLATES)}), or use --prompt"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and how messages and errors name it.

    Attributes:
        text: the Jinja source.
        name: e.g. "the GGUF's chat template", "--chat-template my.jinja", "the built-in gemma3
            template".
        fallback: True when it is a built-in used because the GGUF has none (worth one line to
            the user: the model was not shipped with it).
    """

    text: str
    name: str
    fallback: bool = False


def builtin_template(name: str) -> str:
    """The text of a built-in template (``BUILTIN_TEMPLATES``).

    Raises:
        ChatError: no built-in of that name.
    """
    file = BUILTIN_TEMPLATES.get(name)
    if file is None:
        raise ChatError(
            f"no built-in chat template {name!r}; built-in: {', '.join(BUILTIN_TEMPLATES)}"
        )
    return (resources.files("strata.executor") / "templates" / file).read_text(encoding="utf-8")


def chat_template_for(
    tokenizer: GGUFTokenizer, architecture: str, given: ChatTemplate | None = None
) -> ChatTemplate | None:
    """The template chats are rendered with: ``given`` (``--chat-template``), else the GGUF's,
    else the built-in one for the architecture (``ARCHITECTURE_TEMPLATES``), else None (a chat
    is then refused with ``NO_TEMPLATE``)."""
    if given is not None:
        return given
    if tokenizer.chat_template is not None:
        return ChatTemplate(tokenizer.chat_template, "the GGUF's chat template")
    name = ARCHITECTURE_TEMPLATES.get(architecture)
    if name is None:
        return None
    return ChatTemplate(builtin_template(name), f"the built-in {name} template", fallback=True)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: HF marks assistant text with it; we render it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)  # the "generation" name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise ChatError(f"the chat template rejected the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """The compiled chat template (the last 8 kept), so that a syntax error shows before any
    model is opened: ``strata run --chat-template`` compiles its file first.

    Raises:
        ChatError: the template is not valid Jinja (names the line and the problem).
    """
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(
            f"the chat template is not valid Jinja (line {e.lineno}): {e.message}"
        ) from e


def check_messages(messages: object) -> None:
    """Refuse anything but a non-empty list of ``{"role": str, "content": str, ...}`` objects.

    Raises:
        ChatError: what is wrong, naming the first bad message by its index.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"messages[{i}] must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ChatError(f"messages[{i}].{key} must be a string")


def render_chat(
    template: str,
    messages: list[dict],
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
) -> str:
    """Render ``messages`` with a chat template into the prompt text.

    Args:
        template: the Jinja chat template (e.g. the GGUF's ``tokenizer.chat_template``).
        messages: ``[{"role": str, "content": str, ...}, ...]``; extra keys are passed through.
        bos_token, eos_token: the texts of the model's BOS/EOS tokens, for templates using them.
        add_generation_prompt: end with the header that opens the assistant's reply.

    Returns:
        The rendered text (special tokens appear as text, e.g. ``<|im_start|>``).

    Raises:
        ChatError: malformed messages, a template that is not valid Jinja, fails while rendering
            (a Jinja or a Python error), or calls ``raise_exception``.
    """
    check_messages(messages)
    compiled = compile_template(template)
    try:
        return compiled.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except ChatError:  # raise_exception: the template's own verdict on the messages
        raise
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template failed: {e}") from e
    except Exception as e:  # e.g. {{ 1 / 0 }} or {{ 'a' + 1 }}: Python errors of the template's
        raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from e


def messages_to_ids(
    tokenizer: GGUFTokenizer,
    messages: list[dict],
    template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt token ids for a chat, as llama.cpp builds them.

    Renders ``messages`` with ``template`` (default: the GGUF's), tokenizes the text with special
    tokens recognised, and prepends BOS only when the GGUF asks for it and the rendered text does
    not already start with it (templates that write ``{{ bos_token }}`` must not get two). No EOS
    is appended, whatever ``add_eos_token`` says: the prompt ends with the reply's header.

    Raises:
        ChatError: no template (neither given nor in the GGUF), malformed messages, or a template
            failure (see ``render_chat``).
    """
    template = tokenizer.chat_template if template is None else template
    if template is None:
        raise ChatError(NO_TEMPLATE)
    bos = _token_text(tokenizer, tokenizer.bos_id)
    text = render_chat(
        template, messages, bos, _token_text(tokenizer, tokenizer.eos_id), add_generation_prompt
    )
    ids = tokenizer.encode(text, add_bos=False, parse_special=True, add_eos=False)
    if tokenizer.add_bos and not (bos and text.startswith(bos)):
        ids.insert(0, tokenizer.bos_id)
    return ids


def _token_text(tokenizer: GGUFTokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.token_text(token_id)
