"""``strata chat PLAN|MODEL``: an interactive, multi-turn chat in the terminal.

Each turn renders the whole conversation with the chat template (the GGUF's, ``--chat-template``,
or the built-in one for its architecture), and streams the reply as it is generated. The engine is
the one ``run`` and ``serve`` use, so a turn's prompt shares the previous turns' KV blocks through
the prefix cache: only the new message is prefilled. ``/exit`` (or Ctrl-D) ends the chat,
``/reset`` forgets the conversation; Ctrl-C stops a reply (what was said stays in the
conversation), and at the prompt ends the chat with status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import TYPE_CHECKING

from strata.common.errors import StrataError
from strata.executor.inputs import add_chat_template_argument, add_sampling_arguments

if TYPE_CHECKING:
    from strata.executor.generate import Started

PROMPT = ">>> "
HELP = "/exit or Ctrl-D ends the chat, /reset starts over, Ctrl-C stops a reply"


def cmd_chat(args: argparse.Namespace) -> None:
    from strata.executor.generate import started_engine
    from strata.executor.inputs import chat_template, check_plan, read_chat_template
    from strata.executor.plan_loader import peek_plan
    from strata.executor.sampling import SamplingParams
    from strata.executor.tokenizer import GGUFTokenizer

    if args.max_tokens < 1:
        raise StrataError(f"--max-tokens {args.max_tokens}: give 1 or more")
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    given = read_chat_template(args.chat_template) if args.chat_template else None
    check_plan(args)
    t0 = time.perf_counter()
    peeked = peek_plan(args.plan, args.model)
    tokenizer = GGUFTokenizer.from_gguf(peeked.gguf)
    template = chat_template(tokenizer, peeked.plan.costs.architecture.name, given)
    _try_template(tokenizer, template, args.system)
    with started_engine(args.plan, peeked, tokenizer, t0) as started:
        print(f"chat ready in {time.perf_counter() - t0:.1f} s; {HELP}", file=sys.stderr)
        _converse(started, template.text, template.name, params, args)


def _try_template(tokenizer, template, system: str | None) -> None:
    """Render a first turn before the model loads, so that a template that cannot render a
    chat stops the command (status 2) instead of failing every turn.

    Raises:
        ChatError: the template fails on a system message (where given) and a user message.
    """
    from strata.executor.chat import ChatError, messages_to_ids

    first = [{"role": "system", "content": system}] if system else []
    try:
        messages_to_ids(tokenizer, [*first, {"role": "user", "content": "Hello"}], template.text)
    except ChatError as e:
        raise ChatError(f"{template.name}: {' '.join(str(e).split())}") from None


def _read_line() -> str | None:
    """The user's next line (None at end of input); the prompt goes to stdout, where replies
    are, so that a terminal shows the conversation in order."""
    try:
        return input(PROMPT)
    except EOFError:
        print(flush=True)
        return None


def _converse(started: Started, template: str, template_name: str, params, args) -> None:
    """The chat loop (see the module docstring)."""
    from strata.executor.chat import ChatError, messages_to_ids
    from strata.executor.generate import GenerationInterrupted, generate, request_for
    from strata.executor.serving import check_request

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()
    serving, plan = started.serving, started.loaded.plan
    context = plan.request.context
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict] = list(system)

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    while True:
        try:
            line = _read_line()
        except KeyboardInterrupt:  # at the prompt: the chat ends (run_command: status 130)
            print(flush=True)
            raise
        if line is None or line.strip() in ("/exit", "/quit", "/bye"):
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if text.startswith("/") and text.split()[0] in ("/help", "/?"):
            print(HELP, file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text}; {HELP}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = messages_to_ids(serving.tokenizer, messages, template)
            room = context - len(ids)
            if room < 1:
                raise StrataError(
                    f"the conversation is {len(ids)} tokens, the plan's context {context}; "
                    "/reset to start over, or plan a longer --context"
                )
            max_tokens = min(args.max_tokens, room)
            check_request(request_for(ids, params, max_tokens), plan, serving.tokenizer.vocab_size)
        except ChatError as e:
            messages.pop()
            print(f"error: {template_name}: {' '.join(str(e).split())}", file=sys.stderr)
            continue
        except StrataError as e:
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        try:
            gen = generate(serving, ids, params, max_tokens, write)
        except GenerationInterrupted as e:  # Ctrl-C in a reply: it stops, the chat goes on
            gen = e.generation
            if not gen.output_ids:  # stopped before it answered: the message is taken back
                messages.pop()
                print("\n(stopped; the message is not kept)", file=sys.stderr, flush=True)
                continue
            print("\n(stopped)", file=sys.stderr, flush=True)
        else:
            print(flush=True)
            if gen.stats["finish_reason"] == "length" and max_tokens < args.max_tokens:
                print(
                    f"(the context of {context} tokens is full: /reset to start over, or plan "
                    "a longer --context)",
                    file=sys.stderr,
                )
        messages.append({"role": "assistant", "content": gen.text})


def add_chat_command(sub) -> argparse.ArgumentParser:
    """Add ``chat`` to ``sub``; the plan's positional and options are the caller's."""
    c = sub.add_parser(
        "chat",
        help="chat with a model in the terminal (multi-turn, streamed)",
        description="An interactive, multi-turn chat in the terminal, each reply streamed. "
        + HELP
        + " (and, at the prompt, the chat).",
    )
    c.add_argument("--system", metavar="TEXT", help="a system message that opens the chat")
    add_chat_template_argument(c, "for the conversation")
    add_sampling_arguments(c, 512, "per reply")
    return c
