"""The planner's commands, behind ``plan.py``'s argument parsing.

Every user-facing failure is a ``StrataError`` printed as one line (``error: ...``, exit status 2);
solve time and progress go to stderr, documents to stdout or ``-o FILE``.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from planner.costmodel import rate_label
from planner.errors import StrataError, run_command
from planner.explain import format_rate
from planner.schemas import ModelDescription, Plan, Request
from planner.sizes import format_size, parse_size
from planner.yamlio import parse_doc, read_yaml, to_yaml, write_yaml


def _emit(doc, output: str | None) -> None:
    if output:
        write_yaml(doc, output)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(to_yaml(doc))


def _arch_description(args: argparse.Namespace, model_flag: str) -> ModelDescription | None:
    """The ``--arch FILE --ftype NAME`` description, or None when a model was given instead.

    Raises:
        StrataError: both or neither of the model and ``--arch``; ``--arch`` without ``--ftype``
            or ``--ftype`` without ``--arch``; a bad architecture file or file type.
    """
    from planner.archdesc import FTYPES, describe_arch

    if bool(args.arch) == bool(args.model):
        raise StrataError(f"give exactly one of {model_flag} and --arch FILE.yaml --ftype NAME")
    if not args.arch:
        if args.ftype:
            raise StrataError("--ftype goes with --arch (a GGUF file has its own file type)")
        return None
    if not args.ftype:
        raise StrataError(f"--arch needs --ftype NAME (one of {', '.join(FTYPES)})")
    return describe_arch(args.arch, args.ftype)


def _check_output(output: str | None, *inputs: str | None) -> None:
    """Refuse an ``-o`` path that is an input of the command (it would be overwritten)."""
    if not output:
        return
    out = Path(output)
    if out.is_dir():
        raise StrataError(f"-o {output} is a folder; give a file path")
    for src in inputs:
        if src and Path(src).exists() and out.exists() and out.samefile(src):
            raise StrataError(f"-o {output} is also an input; write to another file")


def cmd_describe(args: argparse.Namespace) -> None:
    from planner.describe import describe

    _check_output(args.output, args.model, getattr(args, "arch", None))
    desc = _arch_description(args, "MODEL")
    if desc is None:
        desc, _ = describe(args.model)
    _emit(desc, args.output)


def cmd_profile(args: argparse.Namespace) -> None:
    from planner.catalog import cache_dir
    from planner.profile import measure_profile

    _check_output(args.output)  # before a measurement of ~10 s, not after
    # Default name: the output file's stem (profiles/mybox.yaml -> mybox), else the host name.
    name = args.name or (Path(args.output).stem if args.output else None)
    name = name or socket.gethostname().split(".")[0].lower() or "this-machine"
    disk = Path(args.disk_dir) if args.disk_dir else cache_dir()
    _emit(measure_profile(disk, name, quick=args.quick), args.output)


def request_from_args(args: argparse.Namespace) -> Request:
    """The planning request from ``plan.py plan``'s options (sizes parsed, bounds checked)."""
    return parse_doc(
        {
            "context": args.context,
            "concurrency": args.concurrency,
            "objective": args.objective,
            "gpu_budget_bytes": parse_size(args.gpu_budget) if args.gpu_budget else None,
            "ram_budget_bytes": parse_size(args.ram_budget) if args.ram_budget else None,
            "tiers": [t.strip() for t in args.tiers.split(",") if t.strip()],
        },
        Request,
        "request",
    )


def speculative_from_args(args: argparse.Namespace):
    """The ``--speculative`` options as a ``planner.speculative.SpeculativeRequest``.

    Raises:
        StrataError: options that do not go together or are out of range.
    """
    from planner.speculative import SpeculativeRequest

    return SpeculativeRequest(
        method=getattr(args, "speculative", None) or "none",
        draft_model=getattr(args, "draft_model", None),
        num_draft_tokens=getattr(args, "num_draft_tokens", None),
        acceptance_rate=getattr(args, "acceptance_rate", None),
    )


def cmd_plan(args: argparse.Namespace) -> None:
    from planner.planning import build_plan

    draft = getattr(args, "draft_model", None)
    _check_output(args.output, args.model, args.profile, getattr(args, "arch", None), draft)
    speculative = speculative_from_args(args)  # before describing: option errors come first
    desc = _arch_description(args, "--model")
    request = request_from_args(args)
    routing = Path(args.routing_profile) if args.routing_profile else None
    plan = build_plan(
        args.model,
        Path(args.profile),
        request,
        Path(args.output),
        desc=desc,
        routing_profile=routing,
        speculative=speculative,
    )
    write_yaml(plan, args.output)
    tiers: dict[str, int] = {}
    for p in plan.placement:
        tiers[p.tier] = tiers.get(p.tier, 0) + p.bytes
    where = ", ".join(f"{t} {format_size(b)}" for t, b in sorted(tiers.items()))
    tok_s = plan.prediction.decode_tok_s if plan.prediction else 0
    sp = plan.speculative
    if sp.method != "none":
        where += (
            f"; speculative {sp.method}, K = {sp.num_draft_tokens}"
            + (f", {sp.draft_layers} draft layers" if sp.draft_layers else "")
            + f", {format_rate(sp.predicted_decode_tok_s or 0)} tok/s with it"
        )
    rate = f"{format_rate(tok_s)} tok/s" + rate_label(plan.request, plan.batch)
    print(f"wrote {args.output}: {where}; predicted {rate}", file=sys.stderr)


def cmd_diff(args: argparse.Namespace) -> None:
    from planner.diff import diff

    print(diff(read_yaml(args.a, Plan), read_yaml(args.b, Plan)))


def cmd_explain(args: argparse.Namespace) -> None:
    from planner.explain import explain

    print(explain(read_yaml(args.plan, Plan)))


COMMANDS = {
    "describe": cmd_describe,
    "profile": cmd_profile,
    "plan": cmd_plan,
    "diff": cmd_diff,
    "explain": cmd_explain,
}


def run(args: argparse.Namespace) -> int:
    """Run one command; user errors become one line on stderr and exit status 2."""
    return run_command(lambda: COMMANDS[args.command](args))
