"""The executor's commands (``strata run|serve|profile``, also ``execute.py`` and
``strata profile``; ``bench`` is ``strata.benchmarks.cli``'s): their arguments and what each does.

Text streams to stdout as it is generated and stats go to stderr; ``--json`` prints one object
(``prompt_ids``, ``output_ids``, ``text``, ``stats``) instead. User errors are one line on stderr
with exit status 2. ``serve`` prints one line to stderr once it accepts requests, then one line
per request (``--quiet``: none), and runs until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from strata.common.cli_io import check_output, emit
from strata.common.errors import StrataError
from strata.common.sizes import format_size
from strata.executor.inputs import (
    add_chat_template_argument,
    add_sampling_arguments,
    check_plan,
    prompt_ids,
    read_chat_template,
    read_prompt,
)


def cmd_run(args: argparse.Namespace) -> None:
    from strata.executor.generate import (
        GenerationInterrupted,
        generate,
        request_for,
        started_engine,
    )
    from strata.executor.plan_loader import peek_plan
    from strata.executor.sampling import SamplingParams
    from strata.executor.serving import check_request
    from strata.executor.tokenizer import GGUFTokenizer

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_tokens < 0:  # as check_request says it, before any planning
        raise StrataError(f"--max-tokens {args.max_tokens} is negative")
    # Every input is checked before the weights load (seconds to minutes), not after: the
    # prompt's files first (no model needed), then the prompt itself against the plan (a model
    # given in place of a plan is planned first: not part of load_s).
    prompt = read_prompt(args)
    check_plan(args)
    t0 = time.perf_counter()
    peeked = peek_plan(args.plan, args.model)  # the header: no hashing, no weights
    plan = peeked.plan
    if args.save_routing_profile:
        if not plan.costs.architecture.expert_count:
            raise StrataError("--save-routing-profile needs a mixture-of-experts model")
        writable_parent(Path(args.save_routing_profile))
    tokenizer = GGUFTokenizer.from_gguf(peeked.gguf)  # the vocabulary
    ids = prompt_ids(tokenizer, prompt, plan.costs.architecture.name)
    check_request(
        request_for(ids, params, args.max_tokens), plan, plan.costs.architecture.vocab_size
    )

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    # The engine `serve` runs, with one request; stopped on success, errors and Ctrl-C.
    with started_engine(args.plan, peeked, tokenizer, t0, args.expert_cache) as started:
        interrupted: GenerationInterrupted | None = None
        try:
            gen = generate(
                started.serving, ids, params, args.max_tokens, None if args.json else write
            )
        except GenerationInterrupted as e:  # Ctrl-C: what was generated is printed, status 130
            gen, interrupted = e.generation, e
    load_s, warm_up_s = started.load_s, started.warm_up_s
    if args.save_routing_profile and interrupted is None:
        _save_routing(started.serving.engine, started.loaded, Path(args.save_routing_profile))
    gen.stats["load_s"] = round(load_s, 3)
    gen.stats["warm_up_s"] = round(warm_up_s, 3)
    gen.stats["load_peak_mlx_bytes"] = started.load_peak_mlx_bytes
    gen.stats["prefill_chunk"] = started.serving.prefill_chunk  # in force (64 at most on a CPU)
    if args.json:
        out = {
            "prompt_ids": gen.prompt_ids,
            "output_ids": gen.output_ids,
            "text": gen.text,
            "stats": gen.stats,
        }
        if interrupted is not None:
            out["interrupted"] = True
        print(json.dumps(out, ensure_ascii=False), flush=True)
    if interrupted is not None:  # strata.common.errors.run_command: one line, exit status 130
        if gen.output_ids and not args.json:
            print(file=sys.stderr)  # the streamed text stays on its own line
        raise interrupted
    if args.json:
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
    print(f"wrote routing profile {path} ({max(doc.tokens)} tokens)", file=sys.stderr)


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
    from strata.executor.server.app import DEFAULT_MAX_CONNECTIONS
    from strata.executor.server.protocol import (
        BODY_READ_TIMEOUT_S,
        DEFAULT_MAX_WAITING,
        ServerLimits,
    )

    key = api_key(args)
    template = read_chat_template(args.chat_template) if args.chat_template else None
    # None: the server's default (named in --help; server.protocol and server.app hold them)
    args.max_waiting = DEFAULT_MAX_WAITING if args.max_waiting is None else args.max_waiting
    if args.max_connections is None:
        args.max_connections = DEFAULT_MAX_CONNECTIONS
    args.read_timeout = BODY_READ_TIMEOUT_S if args.read_timeout is None else args.read_timeout
    if args.max_waiting < 0:
        raise StrataError(f"--max-waiting {args.max_waiting}: give 0 or more requests")
    if args.max_connections < 1:
        raise StrataError(f"--max-connections {args.max_connections}: give 1 or more")
    if not 0 < args.read_timeout <= 3600:
        raise StrataError(f"--read-timeout {args.read_timeout}: give seconds in (0, 3600]")
    from strata.executor.chat import DEFAULT_RENDER_WORKERS, MAX_RENDER_WORKERS

    if args.render_workers is None:
        args.render_workers = DEFAULT_RENDER_WORKERS
    if not 1 <= args.render_workers <= MAX_RENDER_WORKERS:
        raise StrataError(
            f"--render-workers {args.render_workers}: give 1..{MAX_RENDER_WORKERS} workers"
        )
    serve(
        args.plan,
        args.host,
        args.port,
        key,
        args.model_name,
        args.batch_invariant,
        model=args.model,
        check=lambda: check_plan(args),
        chat_template=template,
        access_log=not args.quiet,
        limits=ServerLimits(args.max_waiting, args.read_timeout),
        max_connections=args.max_connections,
        render_workers=args.render_workers,
    )


def api_key(args: argparse.Namespace) -> str | None:
    """The key ``serve`` requires, from the first of ``--api-key KEY``, ``--api-key-file FILE``
    (its first line, without surrounding white space) and ``$STRATA_API_KEY``; None: no key.
    The file and the variable keep the key off the command line, which ``ps`` shows.

    Raises:
        StrataError: both options given, an empty ``--api-key``, or a key file that is missing,
            unreadable, not UTF-8 or whose first line is empty.
    """
    from strata.common import envs

    if args.api_key is not None and args.api_key_file is not None:
        raise StrataError("--api-key and --api-key-file both give the key; keep one of them")
    if args.api_key is not None:
        if not args.api_key.strip():
            raise StrataError("--api-key is empty; give a key, or leave the option out")
        return args.api_key
    if args.api_key_file is not None:
        where = f"--api-key-file {args.api_key_file}"
        try:  # opened as given: a pipe such as <(pass show key) works too
            raw = Path(args.api_key_file).read_bytes()
        except FileNotFoundError:
            raise StrataError(f"{where}: no such file") from None
        except OSError as e:
            raise StrataError(f"{where}: cannot read it ({e.strerror or e})") from None
        try:
            lines = raw.decode("utf-8-sig").splitlines()  # a BOM is not part of the key
        except UnicodeDecodeError:
            raise StrataError(f"{where}: not UTF-8 text") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise StrataError(f"{where}: the first line is empty; put the key on it")
        return key
    return envs.get("STRATA_API_KEY")


def cmd_profile(args: argparse.Namespace) -> None:
    if args.link:
        return _profile_link(args)
    from strata.common.catalog import cache_dir
    from strata.executor.machine import host_profile_name
    from strata.executor.profile import measure_profile

    check_output(args.output)  # before a measurement of ~10 s, not after
    # Default name: the output file's stem (profiles/mybox.yaml -> mybox), else the host name.
    name = args.name or (Path(args.output).stem if args.output else None)
    name = name or host_profile_name()
    disk = Path(args.disk_dir) if args.disk_dir else cache_dir()
    profile = measure_profile(disk, name, quick=args.quick)
    emit(profile, args.output)
    if not args.quick and not args.no_keep:  # --quick figures are rough: not this host's
        from strata.executor.machine import keep_profile

        keep_profile(profile)  # what strata check and run compare plans' figures with


def cmd_rank(args: argparse.Namespace) -> None:
    """A rank past 0 of a cluster plan (started by rank 0, or by hand on another host: the
    command rank 0 prints): load this rank's stage, join the ring, run its blocks of every pass
    until rank 0 says stop (``executor.pipeline``)."""
    from strata.executor.engine import Engine
    from strata.executor.pipeline import ClusterError
    from strata.executor.plan_loader import load_plan
    from strata.executor.ranks import (
        NEIGHBOUR_STOPPED,
        announce,
        join_ring,
        plan_identity,
        wait_bell,
        watch_parent,
    )

    if args.child and not args.link:
        watch_parent()
    try:
        hosts = json.loads(args.ring)
        ok = isinstance(hosts, list) and all(
            isinstance(h, list) and h and all(isinstance(a, str) for a in h) for h in hosts
        )
    except ValueError:
        ok = False
    if not ok:
        raise StrataError('--ring: give the ring\'s hostfile as JSON, [["ip:port"], ...]')
    if not 0 < args.rank < len(hosts):
        raise StrataError(f"--rank {args.rank}: give 1..{len(hosts) - 1} (rank 0 is strata run)")
    if args.link:
        from strata.executor.link_profile import answer_link

        answer_link(hosts, args.ready, args.child)
        return
    if args.plan is None:
        raise StrataError("give the cluster plan (the one rank 0 runs)")
    loaded = load_plan(args.plan, args.model)
    if loaded.plan.cluster is None:
        raise StrataError(
            f"{args.plan} is a one-host plan; strata rank runs a rank of a cluster plan "
            "(strata plan --cluster FILE)"
        )
    engine = Engine(loaded, rank=args.rank)
    try:
        # then rank 0 joins the ring too, once it checked this rank loaded its plan
        bell = announce(args.ready, args.rank, identity=plan_identity(loaded.plan))
        group = join_ring(hosts, args.rank)
        engine.serve_stage(group, lambda: wait_bell(bell))
    except ClusterError as e:  # another rank stopped first: rank 0 names that one
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(NEIGHBOUR_STOPPED) from None
    finally:
        engine.close()


def _profile_link(args: argparse.Namespace) -> None:
    """``strata profile --link HOST``: the link as a cluster file's ``links:`` entry."""
    from strata.common.yamlio import to_yaml
    from strata.executor.link_profile import measure_link
    from strata.executor.machine import host_profile_name

    check_output(args.output)
    names = (args.link_names or f"{host_profile_name()},{args.link}").split(",")
    if len(names) != 2 or not all(names) or names[0] == names[1]:
        raise StrataError(f"--link-names {args.link_names}: give two different names, A,B")
    link = measure_link(args.link, (names[0], names[1]))
    body = to_yaml(link).rstrip("\n").replace("\n", "\n    ")
    text = f"links:\n  - {body}\n"
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    bw, lat = link.bandwidth_bytes_s.value, link.latency_s.value
    print(f"link {names[0]}-{names[1]}: {bw / 1e9:.2f} GB/s, {lat * 1e6:.1f} us", file=sys.stderr)


def add_plan_arguments(p: argparse.ArgumentParser, *, model: bool = False) -> None:
    """``PLAN`` and ``--model PATH``: what every command that runs or checks a plan takes.

    ``model``: the positional may also be a model (catalog name or GGUF path), which the
    ``strata`` command plans first (``strata.autoplan``: ``run``, ``serve``, ``chat``); it
    stays ``args.plan``.
    """
    if model:
        p.add_argument(
            "plan",
            metavar="PLAN|MODEL",
            help="PLAN file (written by strata plan, or by hand) or MODEL (catalog name or GGUF "
            "path: planned for this machine with the planning options below, cached)",
        )
    else:
        p.add_argument("plan", help="plan file written by strata plan (or by hand)")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="with a PLAN file: the GGUF file, where it is not where the plan says (its sha256 "
        "must be the planned one)",
    )


def add_commands(sub) -> None:
    """Add the executor's subcommands (run, chat, serve, profile) to ``sub``."""
    from strata.executor.chat_cli import add_chat_command

    r = sub.add_parser("run", help="generate text from a prompt with a plan or a model")
    add_plan_arguments(r, model=True)
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt",
        help="raw text, tokenized with the GGUF's own BOS rule; '-': read it from standard input",
    )
    src.add_argument("--prompt-file", metavar="FILE", help="raw text from a UTF-8 file")
    src.add_argument("--messages", help='JSON file: [{"role": ..., "content": ...}, ...]')
    src.add_argument("--prompt-ids", help="token ids as they are, e.g. 1,2,3")
    add_chat_template_argument(r, "for --messages")
    add_sampling_arguments(r, 256, "to generate")
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

    add_plan_arguments(add_chat_command(sub), model=True)

    s = sub.add_parser("serve", help="serve a plan or a model over an OpenAI-compatible HTTP API")
    add_plan_arguments(s, model=True)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (8000; 0 = any free port)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* and /reset_prefix_cache (default: "
        "--api-key-file, else $STRATA_API_KEY, else no key; /health and /metrics are open)",
    )
    s.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="read the key from FILE's first line (kept off the command line, which ps shows)",
    )
    s.add_argument(
        "--quiet",
        action="store_true",
        help="no access log (by default one line per request on stderr: method, route, status, "
        "prompt and completion tokens, time to first token, total time)",
    )
    s.add_argument(
        "--model-name",
        metavar="NAME",
        help="the model's name in requests and /v1/models (default: the catalog name, else the "
        "GGUF file's stem)",
    )
    add_chat_template_argument(s, "for /v1/chat/completions")
    s.add_argument(
        "--max-waiting",
        type=int,
        metavar="N",
        help="requests that may wait for a place in the batch (256); more get 429 with Retry-After",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="open connections past which requests get 503 (512)",
    )
    s.add_argument(
        "--read-timeout",
        type=float,
        metavar="S",
        help="seconds a client may take to send a request's head, and between pieces of its "
        "body (30); past it: 408 and the connection closed",
    )
    s.add_argument(
        "--render-workers",
        type=int,
        metavar="N",
        help="processes chat templates render in, one chat each at a time, 1..16 (2); a chat "
        "that gets none within 5 s gets 503 with Retry-After",
    )
    s.add_argument(
        "--batch-invariant",
        action="store_true",
        help="greedy outputs identical alone and in any batch, with or without a prefix-cache "
        "hit, on every backend (prefill and decodes in 16-row tiles, attention per KV block)",
    )

    rk = sub.add_parser("rank", help=argparse.SUPPRESS)  # started by rank 0 (executor.ranks)
    rk.add_argument("plan", nargs="?", help="the cluster plan")
    rk.add_argument("--model", metavar="PATH", help="the GGUF file, as for run")
    rk.add_argument("--link", action="store_true", help="answer strata profile --link")
    rk.add_argument("--rank", type=int, required=True, help="this process's rank (1..)")
    rk.add_argument("--ring", required=True, help='the ring\'s hostfile: [["ip:port"], ...]')
    rk.add_argument("--ready", required=True, help="rank 0's rendezvous, IP:PORT")
    rk.add_argument("--child", action="store_true", help="exit with the parent (rank 0)")

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
        "--link",
        metavar="HOST",
        help="measure the link to HOST over MLX's ring backend instead (bandwidth, one-way "
        "latency; 127.0.0.1: both ranks here) and print it as a cluster file's links: entry",
    )
    pr.add_argument(
        "--link-names",
        metavar="A,B",
        help="with --link: the two hosts' names in the cluster file (default: this host's "
        "profile name and HOST)",
    )
    pr.add_argument(
        "--no-keep",
        action="store_true",
        help="do not keep this measurement in the cache as this host's profile (the one strata "
        "check and run compare plans' figures with; --quick profiles are never kept)",
    )


def cmd_chat(args: argparse.Namespace) -> None:
    from strata.executor.chat_cli import cmd_chat as chat

    chat(args)


COMMANDS = {
    "run": cmd_run,
    "chat": cmd_chat,
    "serve": cmd_serve,
    "profile": cmd_profile,
    "rank": cmd_rank,
}
