"""What a command line gives a command before any model loads, read and checked: the prompt
(``--prompt``, ``--prompt-file``, ``--prompt -``, ``--messages``, ``--prompt-ids``), the chat
template (``--chat-template`` FILE or built-in name, else the GGUF's, else the built-in one for the
architecture) and the plan's check against this machine. Shared by ``run`` and ``chat``
(``executor.cli``, ``executor.chat_cli``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from strata.common.errors import StrataError

if TYPE_CHECKING:
    from strata.executor.chat import ChatTemplate
    from strata.executor.tokenizer import GGUFTokenizer


@dataclass
class PromptInput:
    """What the command line gives as the prompt, read and parsed (no tokenizer needed yet).

    Exactly one of ``ids``, ``text`` and ``messages`` is set.

    Attributes:
        ids: ``--prompt-ids``, as they are.
        text: ``--prompt`` (``-``: standard input's text) or ``--prompt-file``'s.
        messages: ``--messages``' chat, a checked list of ``{role, content}`` objects.
        template: ``--chat-template``'s (a file or a built-in); None: the GGUF's own, else the
            built-in one for its architecture (``chat.chat_template_for``).
    """

    ids: list[int] | None = None
    text: str | None = None  # --prompt TEXT, --prompt - (standard input) or --prompt-file
    messages: list[dict] | None = None
    template: ChatTemplate | None = None


def _read_text(option: str, path: str) -> str:
    """A file's text (a pipe such as ``<(cmd)`` too), read as UTF-8.

    Raises:
        StrataError: no such file, a folder, unreadable, or not UTF-8 (one line naming it).
    """
    p = Path(path)
    if p.is_dir():
        raise StrataError(f"{option} {path}: a folder, not a file")
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StrataError(f"{option} {path}: no such file") from None
    except UnicodeDecodeError:
        raise StrataError(f"{option} {path}: not UTF-8 text") from None
    except OSError as e:
        raise StrataError(f"{option} {path}: cannot read it ({e.strerror})") from None


def _read_messages(path: str) -> list[dict]:
    from strata.executor.chat import ChatError, check_messages

    try:
        messages = json.loads(_read_text("--messages", path))
    except ValueError as e:
        raise StrataError(f"--messages {path}: not valid JSON ({e})") from None
    try:
        check_messages(messages)
    except ChatError as e:
        raise ChatError(
            f'--messages {path}: {e} (give [{{"role": "user", "content": "..."}}, ...])'
        ) from None
    return messages


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise StrataError(
            f"--prompt-ids {text!r}: give comma-separated integers, e.g. 1,2,3"
        ) from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def read_chat_template(value: str) -> ChatTemplate:
    """``--chat-template``'s template: a built-in's name (``chat.BUILTIN_TEMPLATES``, where no
    file of that name exists) or a file's text, compiled once so that a syntax error shows
    before any model is opened.

    Raises:
        StrataError: a missing or unreadable file, text that is not UTF-8, or not valid Jinja.
    """
    from strata.executor.chat import (
        BUILTIN_TEMPLATES,
        ChatError,
        ChatTemplate,
        builtin_template,
        compile_template,
    )

    if value in BUILTIN_TEMPLATES and not Path(value).exists():
        return ChatTemplate(builtin_template(value), f"the built-in {value} template")
    if not Path(value).exists() and not Path(value).suffix and "/" not in value:
        raise ChatError(
            f"--chat-template {value}: no such file or built-in template; built-in: "
            f"{', '.join(BUILTIN_TEMPLATES)}"
        )
    template = _read_text("--chat-template", value)
    try:
        compile_template(template)
    except ChatError as e:
        raise ChatError(f"--chat-template {value}: {_one_line(e)}") from None
    return ChatTemplate(template, f"--chat-template {value}")


def _read_stdin() -> str:
    """``--prompt -``: standard input read to its end, as UTF-8 text (a terminal is told how to
    end it)."""
    if sys.stdin is None:
        raise StrataError("--prompt -: there is no standard input; give --prompt TEXT instead")
    if sys.stdin.isatty():
        print("reading the prompt from standard input (end it with Ctrl-D)", file=sys.stderr)
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        raise StrataError("--prompt -: standard input is not UTF-8 text; re-encode it") from None
    except OSError as e:
        raise StrataError(f"--prompt -: cannot read standard input ({e.strerror})") from None


def read_prompt(args: argparse.Namespace) -> PromptInput:
    """Read and parse the prompt's options (--prompt, --prompt-file, --messages, --prompt-ids,
    --chat-template): the files (or standard input, ``--prompt -``) read, the JSON parsed and its
    shape checked, the template compiled, before a model is touched. A prompt file's or standard
    input's text is the prompt as it is (a final newline included), as ``--prompt``'s is; an
    empty one is refused where ``--prompt ''`` is, once tokenized (no tokens).

    Raises:
        StrataError: a missing or unreadable file, JSON that is not a list of ``{role,
            content}`` objects, a template that is not valid Jinja, ids that are not integers,
            text that is not UTF-8, or --chat-template without --messages.
    """
    if args.chat_template and args.messages is None:
        raise StrataError("--chat-template applies to --messages only; drop it or pass --messages")
    if args.prompt_ids is not None:
        return PromptInput(ids=_parse_ids(args.prompt_ids))
    if args.messages is not None:
        messages = _read_messages(args.messages)
        if not args.chat_template:
            return PromptInput(messages=messages)
        return PromptInput(messages=messages, template=read_chat_template(args.chat_template))
    prompt_file = getattr(args, "prompt_file", None)
    if prompt_file is not None:
        return PromptInput(text=_read_text("--prompt-file", prompt_file))
    if args.prompt == "-":
        return PromptInput(text=_read_stdin())
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise StrataError("--prompt is not valid UTF-8 text; re-encode it as UTF-8") from None
    return PromptInput(text=args.prompt)


def chat_template(
    tokenizer: GGUFTokenizer, architecture: str | None, given: ChatTemplate | None
) -> ChatTemplate:
    """The template chats are rendered with (``chat.chat_template_for``); a built-in used
    because the GGUF has none is said on stderr, once.

    Raises:
        ChatError: none given, none in the GGUF and no built-in for the architecture.
    """
    from strata.executor.chat import NO_TEMPLATE, ChatError, chat_template_for

    template = chat_template_for(tokenizer, architecture or "", given)
    if template is None:
        raise ChatError(NO_TEMPLATE)
    if template.fallback:
        print(
            f"chat: {template.name} (the GGUF has none; --chat-template FILE to choose another)",
            file=sys.stderr,
        )
    return template


def prompt_ids(
    tokenizer: GGUFTokenizer, prompt: PromptInput, architecture: str | None = None
) -> list[int]:
    """The prompt's token ids: ``--prompt-ids`` as they are, ``--prompt`` tokenized with the
    GGUF's BOS rule, or ``--messages`` rendered once with the chat template (:func:`chat_template`
    for a model of ``architecture``) and tokenized.

    Raises:
        ChatError: no chat template (given, in the GGUF or built in for the architecture), or
            the template fails on the messages (one line naming the template and the problem).
    """
    from strata.executor.chat import ChatError, messages_to_ids

    if prompt.ids is not None:
        return prompt.ids
    if prompt.messages is None:
        return tokenizer.encode(prompt.text)
    template = chat_template(tokenizer, architecture, prompt.template)
    try:
        return messages_to_ids(tokenizer, prompt.messages, template.text)
    except ChatError as e:
        raise ChatError(f"{template.name}: {_one_line(e)}") from None


def prompt_ids_for(
    tokenizer: GGUFTokenizer, args: argparse.Namespace, architecture: str | None = None
) -> list[int]:
    """The prompt's token ids from --prompt, --messages or --prompt-ids (:func:`read_prompt`,
    then :func:`prompt_ids`)."""
    return prompt_ids(tokenizer, read_prompt(args), architecture)


def check_plan(args: argparse.Namespace) -> str:
    """The plan file to run, and whether it holds on this machine: the ``strata`` command hands
    down ``args.check_plan`` (``strata.cli``), which plans a model given in place of a plan
    (``strata.autoplan``, setting ``args.plan``) and asks ``strata.check.require``. Asked after
    a command's own options are checked, before anything is loaded; returns ``args.plan``.

    Raises:
        StrataError: the model cannot be planned, or the plan does not hold here.
    """
    hook = getattr(args, "check_plan", None)
    if hook is not None:
        hook(args)
    return args.plan


BUILTIN_NAMES = "chatml, gemma3"
"""``chat.BUILTIN_TEMPLATES``' names as the options' help says them (the help is built without
importing Jinja; ``tests/executor/test_chat_template.py`` checks the two agree)."""


def add_chat_template_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--chat-template FILE|NAME`` (read by :func:`read_chat_template`); ``what``: what the
    template renders, as the help says it."""
    p.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        help=f"Jinja chat template {what}: a file, or a built-in ({BUILTIN_NAMES}); default: the "
        "GGUF's, else the built-in one for its architecture",
    )


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int, per: str) -> None:
    """``--max-tokens`` (default ``max_tokens``, tokens per ``per``) and the sampling options
    ``executor.sampling.SamplingParams`` takes, as ``run`` and ``chat`` declare them."""
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"most tokens {per} ({max_tokens})"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
