"""The executor's commands (``strata run|serve|profile``, also ``execute.py`` and
``strata profile``; ``bench`` is ``strata.benchmarks.cli``'s): their arguments and what each does.

Text streams to stdout as it is generated and stats go to stderr; ``--json`` prints one object
(``prompt_ids``, ``output_ids``, ``text``, ``stats``) instead. User errors are one line on stderr
with exit status 2. ``serve`` prints one line to stderr once it accepts requests and runs until
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from strata.common.cli_io import check_output, emit
from strata.common.errors import StrataError
from strata.common.sizes import format_size

if TYPE_CHECKING:
    from strata.executor.tokenizer import GGUFTokenizer


@dataclass
class PromptInput:
    """What the command line gives as the prompt, read and parsed (no tokenizer needed yet).

    Exactly one of ``ids``, ``text`` and ``messages`` is set.

    Attributes:
        ids: ``--prompt-ids``, as they are.
        text: ``--prompt``.
        messages: ``--messages``' chat, a checked list of ``{role, content}`` objects.
        template: ``--chat-template``'s text; None: the GGUF's own.
        template_name: the template as an error names it.
    """

    ids: list[int] | None = None
    text: str | None = None
    messages: list[dict] | None = None
    template: str | None = None
    template_name: str = "the GGUF's chat template (tokenizer.chat_template)"


def _read_text(option: str, path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise StrataError(f"{option} {path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
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


def read_chat_template(path: str) -> str:
    """The ``--chat-template`` file's text, compiled once so that a syntax error shows before
    any model is opened.

    Raises:
        StrataError: a missing or unreadable file, text that is not UTF-8, or not valid Jinja.
    """
    from strata.executor.chat import ChatError, compile_template

    template = _read_text("--chat-template", path)
    try:
        compile_template(template)
    except ChatError as e:
        raise ChatError(f"--chat-template {path}: {_one_line(e)}") from None
    return template


def read_prompt(args: argparse.Namespace) -> PromptInput:
    """Read and parse the prompt's options (--prompt, --messages, --prompt-ids, --chat-template):
    the files read, the JSON parsed and its shape checked, the template compiled, before a model
    is touched.

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
        return PromptInput(
            messages=messages,
            template=read_chat_template(args.chat_template),
            template_name=f"--chat-template {args.chat_template}",
        )
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise StrataError("--prompt is not valid UTF-8 text; re-encode it as UTF-8") from None
    return PromptInput(text=args.prompt)


def prompt_ids(tokenizer: GGUFTokenizer, prompt: PromptInput) -> list[int]:
    """The prompt's token ids: ``--prompt-ids`` as they are, ``--prompt`` tokenized with the
    GGUF's BOS rule, or ``--messages`` rendered once with the chat template and tokenized.

    Raises:
        ChatError: no chat template (neither given nor in the GGUF), or the template fails on the
            messages (one line naming the template and the problem).
    """
    from strata.executor.chat import NO_TEMPLATE, ChatError, messages_to_ids

    if prompt.ids is not None:
        return prompt.ids
    if prompt.messages is None:
        return tokenizer.encode(prompt.text)
    if prompt.template is None and tokenizer.chat_template is None:
        raise ChatError(NO_TEMPLATE)
    try:
        return messages_to_ids(tokenizer, prompt.messages, prompt.template)
    except ChatError as e:
        raise ChatError(f"{prompt.template_name}: {_one_line(e)}") from None


def prompt_ids_for(tokenizer: GGUFTokenizer, args: argparse.Namespace) -> list[int]:
    """The prompt's token ids from --prompt, --messages or --prompt-ids (:func:`read_prompt`,
    then :func:`prompt_ids`)."""
    return prompt_ids(tokenizer, read_prompt(args))


def check_plan(args: argparse.Namespace) -> None:
    """Whether ``args.plan`` holds on this machine (``strata.check.require``, which the
    ``strata`` command hands down as ``args.check_plan``): asked after a command's own options
    are checked, before anything is loaded.

    Raises:
        PlanError: the plan does not hold here.
    """
    hook = getattr(args, "check_plan", None)
    if hook is not None:
        hook(args.plan)


def cmd_run(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from strata.executor.engine import Engine
    from strata.executor.generate import generate, request_for
    from strata.executor.plan_loader import load_plan, peek_plan
    from strata.executor.sampling import SamplingParams
    from strata.executor.serving import ServingEngine, check_request
    from strata.executor.tokenizer import GGUFTokenizer

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    t0 = time.perf_counter()
    # Every input is checked before the weights load (seconds to minutes), not after: the
    # prompt's files first (no model needed), then the prompt itself against the plan.
    prompt = read_prompt(args)
    check_plan(args)
    peeked = peek_plan(args.plan, args.model)  # the header: no hashing, no weights
    plan = peeked.plan
    if args.save_routing_profile:
        if not plan.costs.architecture.expert_count:
            raise StrataError("--save-routing-profile needs a mixture-of-experts model")
        writable_parent(Path(args.save_routing_profile))
    tokenizer = GGUFTokenizer.from_gguf(peeked.gguf)  # the vocabulary
    ids = prompt_ids(tokenizer, prompt)
    check_request(
        request_for(ids, params, args.max_tokens), plan, plan.costs.architecture.vocab_size
    )
    loaded = load_plan(args.plan, peeked=peeked)  # the bytes checked (hashed once per file)
    # The engine `serve` runs (warm-up, kernels, paged KV cache, the plan's speculative
    # decoding), with one request.
    engine = Engine(loaded, expert_cache_mode=args.expert_cache, tokenizer=tokenizer)
    try:
        serving = ServingEngine(engine)
    except BaseException:
        engine.close()
        raise

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        load_s = time.perf_counter() - t0
        load_peak_mlx = int(mx.get_peak_memory())  # generate() resets MLX's peak: loading's own
        if engine.config.warm_up_row_buckets:  # as serve says it (the GPU: up to a minute)
            print("building kernels for every batch size ...", file=sys.stderr, flush=True)
        warm_up_s = serving.start()
        gen = generate(serving, ids, params, args.max_tokens, None if args.json else write)
    finally:
        serving.close()  # the engine thread and the I/O threads stop on success, errors, Ctrl-C
    if args.save_routing_profile:
        _save_routing(engine, loaded, Path(args.save_routing_profile))
    gen.stats["load_s"] = round(load_s, 3)
    gen.stats["warm_up_s"] = round(warm_up_s, 3)
    gen.stats["load_peak_mlx_bytes"] = load_peak_mlx
    if args.json:
        out = {
            "prompt_ids": gen.prompt_ids,
            "output_ids": gen.output_ids,
            "text": gen.text,
            "stats": gen.stats,
        }
        print(json.dumps(out, ensure_ascii=False))
        return
    s = gen.stats
    print(file=sys.stderr)  # stdout carries exactly the generated text
    print(
        f"[{s['prompt_tokens']} prompt tokens, {s['output_tokens']} generated, "
        f"{s['finish_reason']}] prefill {s['prefill_tok_s']:.1f} tok/s, decode "
        f"{s['decode_tok_s']:.1f} tok/s, peak RSS {format_size(s['peak_rss_bytes'])}, peak MLX "
        f"{format_size(s['peak_mlx_bytes'])}, read "
        + ", ".join(f"{t} {format_size(b)}" for t, b in s["bytes_read"].items())
        + f", load {load_s:.1f} s"
        + (f" (warm-up {warm_up_s:.1f} s)" if warm_up_s else ""),
        file=sys.stderr,
    )
    ex = s.get("experts")
    if ex and ex.get("hits", 0) + ex.get("misses", 0):
        print(
            f"[experts] hit rate {ex['hit_rate']:.1%} ({ex['hits']} hits, {ex['misses']} "
            f"misses), prefetch {ex['prefetch_used']} used / {ex['prefetch_wasted']} wasted / "
            f"{ex['prefetch_issued']} issued, {ex['uses_gpu']} pinned uses",
            file=sys.stderr,
        )
    sp = s.get("speculative")
    if sp and sp["spec_proposed_tokens"]:
        print(
            f"[speculative] {sp['spec_accepted_tokens']} of {sp['spec_proposed_tokens']} draft "
            f"tokens accepted in {sp['spec_verification_steps']} verifications",
            file=sys.stderr,
        )


def _save_routing(engine, loaded, path: Path) -> None:
    """Write the run's routing counts as a routing profile (JSON)."""
    src = loaded.desc.model
    doc = engine.store.routing.profile(src.sha256, src.header_sha256)
    path.write_text(doc.model_dump_json() + "\n")
    print(f"wrote routing profile {path} ({min(doc.tokens)} tokens)", file=sys.stderr)


def writable_parent(path: Path) -> None:
    """Create ``path``'s folder if needed (as plan.py -o does).

    Raises:
        StrataError: the folder cannot be created.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(f"cannot write {path}: {e.strerror}; pick another folder") from None


def cmd_serve(args: argparse.Namespace) -> None:
    from strata.executor.server import serve

    if not 0 <= args.port <= 65535:
        raise StrataError(f"--port {args.port}: give a port in 0..65535 (0 = any free port)")
    if args.api_key is not None and not args.api_key.strip():
        raise StrataError("--api-key is empty; give a key, or leave the option out")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    serve(
        args.plan,
        args.host,
        args.port,
        args.api_key,
        args.model_name,
        args.batch_invariant,
        model=args.model,
        check=lambda: check_plan(args),
        chat_template=template,
    )


def cmd_profile(args: argparse.Namespace) -> None:
    from strata.common.catalog import cache_dir
    from strata.executor.profile import measure_profile

    check_output(args.output)  # before a measurement of ~10 s, not after
    # Default name: the output file's stem (profiles/mybox.yaml -> mybox), else the host name.
    name = args.name or (Path(args.output).stem if args.output else None)
    name = name or socket.gethostname().split(".")[0].lower() or "this-machine"
    disk = Path(args.disk_dir) if args.disk_dir else cache_dir()
    profile = measure_profile(disk, name, quick=args.quick)
    emit(profile, args.output)
    if not args.quick and not args.no_keep:  # --quick figures are rough: not this host's
        from strata.executor.machine import keep_profile

        keep_profile(profile)  # what strata check and run compare plans' figures with


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """``PLAN`` and ``--model PATH``: what every command that runs or checks a plan takes."""
    p.add_argument("plan", help="plan file written by strata plan (or by hand)")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="the GGUF file, where it is not where the plan says (its sha256 must be the planned "
        "one)",
    )


def add_commands(sub) -> None:
    """Add the executor's subcommands (run, serve, profile) to ``sub``."""
    r = sub.add_parser("run", help="generate text from a prompt with a plan")
    add_plan_arguments(r)
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text, tokenized with the GGUF's own BOS rule")
    src.add_argument("--messages", help='JSON file: [{"role": ..., "content": ...}, ...]')
    src.add_argument("--prompt-ids", help="token ids as they are, e.g. 1,2,3")
    r.add_argument("--chat-template", help="Jinja chat template file (default: the GGUF's)")
    r.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (256)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    r.add_argument(
        "--expert-cache",
        choices=("none", "cache", "prefetch"),
        help="MoE expert cache mode for streamed experts: none (every use reads), cache (the cache "
        "alone), prefetch (cache + co-activation prefetch); default: the plan's",
    )
    r.add_argument(
        "--save-routing-profile",
        metavar="FILE",
        help="MoE: write the measured routing (JSON) for strata plan --routing-profile",
    )

    s = sub.add_parser("serve", help="serve a plan over an OpenAI-compatible HTTP API")
    add_plan_arguments(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (8000; 0 = any free port)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* and /reset_prefix_cache (default: no "
        "key; /health and /metrics are open)",
    )
    s.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model's name in requests and /v1/models (default: the catalog name, else the "
        "GGUF file's stem)",
    )
    s.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for /v1/chat/completions (default: the GGUF's; e.g. "
        "templates/gemma3.jinja for a GGUF without one)",
    )
    s.add_argument(
        "--batch-invariant",
        action="store_true",
        help="greedy outputs identical alone and in any batch, with or without a prefix-cache "
        "hit, on every backend (prefill and decodes in 16-row tiles, attention per KV block)",
    )

    pr = sub.add_parser("profile", help="measure this machine's hardware profile")
    pr.add_argument("-o", "--output", help="write here instead of stdout")
    pr.add_argument(
        "--name",
        default=None,
        help="profile name (default: the output file's stem, else the host name)",
    )
    pr.add_argument("--disk-dir", default=None, help="folder on the disk to test (default: cache)")
    pr.add_argument("--quick", action="store_true", help="short tests (less accurate)")
    pr.add_argument(
        "--no-keep",
        action="store_true",
        help="do not keep this measurement in the cache as this host's profile (the one strata "
        "check and run compare plans' figures with; --quick profiles are never kept)",
    )


COMMANDS = {"run": cmd_run, "serve": cmd_serve, "profile": cmd_profile}
