"""``strata bench`` (also ``strata bench``): its arguments, and which bench runs.

Without ``--concurrency`` it measures one request through the engine (``bench.py``: tok/s, bytes
read, I/O wait, memory, the ids checked against an all-resident run); with it, it starts ``serve``
and measures concurrency levels over HTTP (``http_bench.py``). User errors are one line on stderr
with exit status 2, raised before the bench starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.common.cli_io import check_output
from strata.common.errors import StrataError
from strata.executor.cli import add_plan_arguments, writable_parent
from strata.executor.inputs import check_plan


def cmd_bench(args: argparse.Namespace) -> None:
    from strata.benchmarks.bench import NonFiniteBench, bench, plot, write_result
    from strata.executor.experts import CACHE_MODES

    if (
        not Path(args.plan).exists()
        and "/" not in args.plan
        and not args.plan.endswith((".yaml", ".yml", ".gz"))
    ):  # a catalog name, as run and serve take: bench measures a plan file
        raise StrataError(
            f"{args.plan}: no such plan file; strata bench measures a plan: make one with "
            f"strata plan --model {args.plan} --profile FILE -o plan.yaml (strata profile -o FILE "
            f"measures this machine), then strata bench plan.yaml"
        )
    if args.baseline_rounds < 1:
        raise StrataError(f"--baseline-rounds {args.baseline_rounds}: give 1 or more")
    if args.max_tokens < 2:
        raise StrataError("--max-tokens must be at least 2 for a decode measurement")
    # Check where the results go before the bench runs, not after.
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise StrataError(f"--plot {args.plot}: name a .png, .svg or .pdf file")
    for out in (args.output, args.plot):
        if out:
            writable_parent(Path(out))
            check_output(out, args.plan, args.model)  # never over the plan or the model
    from strata.benchmarks.http_bench import cmd_http_bench, refuse_serving_options

    if args.concurrency is not None:  # the serving bench, over HTTP (benchmarks/http_bench.py)
        if args.baseline or args.model:
            flag = "--baseline" if args.baseline else "--model"
            raise StrataError(
                f"{flag} applies to the in-process bench; drop it or drop --concurrency"
            )
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
    check_plan(args)  # the serving bench's server asks it itself
    try:
        result = bench(
            args.plan,
            args.prompt,
            args.max_tokens,
            args.check,
            modes,
            baseline=args.baseline_rounds if args.baseline else 0,
            model=args.model,
        )
    except NonFiniteBench as e:  # its JSON (where it went wrong), then its one error line
        write_result(e.result, args.output, None, plot)
        raise
    write_result(result, args.output, args.plot, plot)


def add_commands(sub) -> None:
    """Add the ``bench`` subcommand to ``sub``."""
    b = sub.add_parser("bench", help="measure a plan: tok/s, disk bytes/s, I/O wait, memory")
    add_plan_arguments(b)
    b.add_argument(
        "--baseline",
        action="store_true",
        help="also measure the baseline rule's plan (first blocks resident in order, llama.cpp's "
        "-ngl/--fit) for the same model, machine and budgets, alternated with this plan in one "
        "process, and report the ratio of the medians",
    )
    b.add_argument(
        "--baseline-rounds",
        type=int,
        default=3,
        metavar="N",
        help="with --baseline: how many times plan and rule alternate (default 3)",
    )
    b.add_argument("--prompt", default="The capital of France is", help="prompt text")
    b.add_argument("--max-tokens", type=int, default=64, help="decode steps measured (64)")
    b.add_argument(
        "--check",
        default="resident",
        help="resident (default: ids must equal the all-resident run), none, or a --json file",
    )
    b.add_argument("-o", "--output", help="write the JSON here (default: stdout)")
    b.add_argument("--plot", help="write a PNG plot here")
    b.add_argument(
        "--expert-cache-modes",
        help="MoE: also measure these expert-cache modes in this run, e.g. none,cache,prefetch",
    )
    b.add_argument(
        "--concurrency",
        help="serving bench: start `serve` and measure these concurrency levels over HTTP, e.g. "
        "1,2,4,8 (TTFT, TPOT, aggregate tok/s; --prompt and --check do not apply)",
    )
    b.add_argument(
        "--requests",
        type=int,
        help="serving bench: requests per level (default max(2c, 8) at level c; level 1, the "
        "text reference, runs as many as the largest level)",
    )
    b.add_argument(
        "--prefix-tokens",
        type=int,
        help="serving bench: shared-prefix tokens of the prefix-cache TTFT test (1000; 0 skips it)",
    )
    b.add_argument(
        "--prefix-trials",
        type=int,
        help="serving bench: cold/warm pairs of the prefix-cache test, medians reported "
        "(3 on a GPU, 1 on the CPU)",
    )
    b.add_argument(
        "--prompt-tokens",
        help="serving bench: prompt lengths in tokens, cycled over the requests "
        "(default 48,96,160,256,64,128,200,32)",
    )
    b.add_argument(
        "--batch-invariant",
        action="store_true",
        help="serving bench: start `serve --batch-invariant`",
    )
    b.add_argument(
        "--near-tie-gap",
        type=float,
        help="serving bench: a text that leaves its concurrency-1 text by taking the runner-up "
        "where the top-2 logit gap is below this passes as a near-tie flip (default 0.5, or 1.0 "
        "for a random-weight synthetic model; 0 makes every difference an error)",
    )


COMMANDS = {"bench": cmd_bench}
