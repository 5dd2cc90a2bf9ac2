"""The executor's commands, behind ``execute.py``'s argument parsing.

Text streams to stdout as it is generated and stats go to stderr; ``--json`` prints one object
(``prompt_ids``, ``output_ids``, ``text``, ``stats``) instead. User errors are one line on stderr
with exit status 2. ``serve`` prints one line to stderr once it accepts requests and runs until
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from planner.errors import StrataError, run_command
from planner.sizes import format_size


def _read_messages(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise StrataError(f"--messages {path}: no such file")
    try:
        return json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise StrataError(f"--messages {path}: not valid JSON ({e})") from None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise StrataError(
            f"--prompt-ids {text!r}: give comma-separated integers, e.g. 1,2,3"
        ) from None


def prompt_ids_for(engine, args: argparse.Namespace) -> list[int]:
    """The prompt's token ids from --prompt, --messages or --prompt-ids."""
    from executor.chat import messages_to_ids

    if args.chat_template and args.messages is None:
        raise StrataError("--chat-template applies to --messages only; drop it or pass --messages")
    if args.prompt_ids is not None:
        return _parse_ids(args.prompt_ids)
    if args.messages is not None:
        template = None
        if args.chat_template:
            tp = Path(args.chat_template)
            if not tp.is_file():
                raise StrataError(f"--chat-template {tp}: no such file")
            try:
                template = tp.read_text()
            except UnicodeDecodeError:
                raise StrataError(f"--chat-template {tp}: not UTF-8 text") from None
        return messages_to_ids(engine.tokenizer, _read_messages(args.messages), template)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise StrataError("--prompt is not valid UTF-8 text; re-encode it as UTF-8") from None
    return engine.tokenizer.encode(args.prompt)


def cmd_run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from executor.chat import NO_TEMPLATE, ChatError
    from executor.engine import Engine
    from executor.plan_loader import load_plan
    from executor.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    t0 = time.perf_counter()
    loaded = load_plan(args.plan)
    if args.messages is not None and not args.chat_template:
        if not loaded.gguf.field("tokenizer.chat_template"):
            raise ChatError(NO_TEMPLATE)  # before loading the weights, not after
    if args.save_routing_profile:
        if not loaded.desc.architecture.expert_count:
            raise StrataError("--save-routing-profile needs a mixture-of-experts model")
        _writable_parent(Path(args.save_routing_profile))
    engine = Engine(loaded, expert_cache_mode=args.expert_cache)
    load_s = time.perf_counter() - t0
    load_peak_mlx = int(mx.get_peak_memory())  # generate() resets MLX's peak: loading's own

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        ids = prompt_ids_for(engine, args)
        gen = engine.generate(ids, params, args.max_tokens, None if args.json else write)
    finally:
        engine.close()  # I/O threads stop on success, errors and Ctrl-C alike
    if args.save_routing_profile:
        _save_routing(engine, loaded, Path(args.save_routing_profile))
    gen.stats["load_s"] = round(load_s, 3)
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
        + f", load {load_s:.1f} s",
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


def _save_routing(engine, loaded, path: Path) -> None:
    """Write the run's routing counts as a routing profile (JSON)."""
    src = loaded.desc.model
    doc = engine.store.routing.profile(src.sha256, src.header_sha256)
    path.write_text(doc.model_dump_json() + "\n")
    print(f"wrote routing profile {path} ({min(doc.tokens)} tokens)", file=sys.stderr)


def _writable_parent(path: Path) -> None:
    """Create ``path``'s folder if needed (as plan.py -o does).

    Raises:
        StrataError: the folder cannot be created.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(f"cannot write {path}: {e.strerror}; pick another folder") from None


def cmd_bench(args: argparse.Namespace) -> None:
    from executor.bench import bench, plot, write_result
    from executor.experts import CACHE_MODES

    if args.max_tokens < 2:
        raise StrataError("--max-tokens must be at least 2 for a decode measurement")
    # Check where the results go before the bench runs, not after.
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise StrataError(f"--plot {args.plot}: name a .png, .svg or .pdf file")
    for out in (args.output, args.plot):
        if out:
            _writable_parent(Path(out))
    from executor.http_bench import cmd_http_bench, refuse_serving_options

    if args.concurrency is not None:  # the serving bench, over HTTP (executor/http_bench.py)
        cmd_http_bench(args)
        return
    refuse_serving_options(args)
    modes = [m for m in (args.expert_cache_modes or "").split(",") if m]
    bad = [m for m in modes if m not in CACHE_MODES]
    if bad:
        raise StrataError(
            f"--expert-cache-modes {bad[0]!r}: use some of {', '.join(CACHE_MODES)}, e.g. "
            "none,cache,prefetch"
        )
    result = bench(args.plan, args.prompt, args.max_tokens, args.check, modes)
    write_result(result, args.output, args.plot, plot)


def cmd_serve(args: argparse.Namespace) -> None:
    from executor.server import serve

    if not 0 <= args.port <= 65535:
        raise StrataError(f"--port {args.port}: give a port in 0..65535 (0 = any free port)")
    if args.api_key is not None and not args.api_key.strip():
        raise StrataError("--api-key is empty; give a key, or leave the option out")
    serve(args.plan, args.host, args.port, args.api_key, args.model_name, args.batch_invariant)


COMMANDS = {"run": cmd_run, "bench": cmd_bench, "serve": cmd_serve}


def run(args: argparse.Namespace) -> int:
    """Run one command; user errors become one line on stderr and exit status 2."""
    return run_command(lambda: COMMANDS[args.command](args))
