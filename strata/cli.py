"""The ``strata`` command, and the ``plan.py`` / ``execute.py`` / ``synth.py`` entry points.

``strata describe|profile|plan|check|explain|diff|run|serve|bench|synth|cache ...``: each
subcommand's options and work live with its layer (``strata.planner.cli``, ``strata.executor.cli``,
``strata.benchmarks.cli``; ``check`` in ``strata.check``, which ``run``, ``serve`` and ``bench``
ask first; ``cache`` in ``strata.caches``); this module only builds the parsers and runs the
chosen command, turning a ``StrataError`` into one line on stderr and exit status 2
(``strata.common.errors.run_command``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from strata import __version__, autoplan, caches, check
from strata.benchmarks import cli as benchmarks_cli
from strata.common.errors import run_command
from strata.executor import cli as executor_cli
from strata.planner import cli as planner_cli

DESCRIPTION = "Plan LLM inference across a memory hierarchy (GPU, RAM, NVMe) and run it on MLX."
#: The subcommands that plan.py and execute.py offer (strata offers them all, and synth).
PLAN_COMMANDS = ("describe", "profile", "plan", "check", "diff", "explain")
EXECUTE_COMMANDS = ("run", "chat", "bench", "serve")


def _commands() -> dict[str, Callable[[argparse.Namespace], None]]:
    return {
        **planner_cli.COMMANDS,
        "check": check.cmd_check,
        **executor_cli.COMMANDS,
        **benchmarks_cli.COMMANDS,
        **caches.COMMANDS,
    }


class _Only:
    """A subparsers action that adds only the named subcommands (``plan.py`` and ``execute.py``
    offer a part of ``strata``'s); the others get a parser that is thrown away."""

    def __init__(self, sub, keep: tuple[str, ...] | None):
        self.sub, self.keep = sub, keep

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if self.keep is None or name in self.keep:
            return self.sub.add_parser(name, **kwargs)
        return argparse.ArgumentParser(prog=name)


def _parser(prog: str, description: str, keep: tuple[str, ...] | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = _Only(p.add_subparsers(dest="command", required=True), keep)
    planner_cli.add_commands(sub)
    check.add_command(sub)
    executor_cli.add_commands(sub)
    benchmarks_cli.add_commands(sub)
    autoplan.add_options(sub.sub.choices)  # run|serve|chat MODEL: plan's options
    syn = sub.add_parser(
        "synth",
        help="write a synthetic GGUF of a real model's shape",
        description=planner_cli.SYNTH_DOC,
        epilog=planner_cli.presets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    planner_cli.add_synth_arguments(syn)
    caches.add_command(sub)
    return p


def _plan_and_check(args: argparse.Namespace) -> None:
    """``args.check_plan`` (``executor.inputs.check_plan``): a model given in place of a plan is
    planned first (``autoplan.prepare``: ``args.plan`` becomes the cached plan), then the plan
    is checked against this machine (``check.require``)."""
    if args.command in autoplan.COMMANDS:
        autoplan.prepare(args)
    check.require(args.plan)


def _run(p: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = p.parse_args(argv)

    def command() -> None:
        if args.command in EXECUTE_COMMANDS:
            # Asked by the command after its own options are checked, before it loads anything
            # (the executor and the benchmarks cannot import the layer above them).
            args.check_plan = _plan_and_check
        _commands()[args.command](args)

    return run_command(command)


def main(argv: list[str] | None = None) -> int:
    """``strata SUBCOMMAND ...``: every command of the planner and the executor."""
    return _run(_parser("strata", DESCRIPTION, None), argv)


def plan_main(argv: list[str] | None = None) -> int:
    """``plan.py``: describe, profile, plan, diff, explain."""
    return _run(
        _parser(
            "plan.py", "Strata's planner: describe, profile, plan, diff, explain.", PLAN_COMMANDS
        ),
        argv,
    )


def execute_main(argv: list[str] | None = None) -> int:
    """``execute.py``: run, chat, bench, serve."""
    return _run(
        _parser("execute.py", "Strata's executor: run, chat, bench, serve.", EXECUTE_COMMANDS), argv
    )


def synth_main(argv: list[str] | None = None) -> int:
    """``synth.py``: write a synthetic GGUF (the options of ``strata synth``)."""
    p = argparse.ArgumentParser(
        prog="synth.py",
        description=planner_cli.SYNTH_DOC,
        epilog=planner_cli.presets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    planner_cli.add_synth_arguments(p)
    args = p.parse_args(argv)
    return run_command(lambda: planner_cli.cmd_synth(args))
