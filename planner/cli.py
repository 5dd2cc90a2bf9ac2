"""The planner's commands (``strata describe|plan|diff|explain|synth``, also ``plan.py`` and
``synth.py``): their arguments and what each does.

Every user-facing failure is a ``StrataError`` printed as one line (``error: ...``, exit status 2);
solve time and progress go to stderr, documents to stdout or ``-o FILE``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata.common.cli_io import check_output, emit
from strata.common.errors import StrataError
from strata.common.schemas import ModelDescription, Plan, Request
from strata.common.sizes import format_size, parse_size
from strata.common.yamlio import parse_doc, read_yaml, write_yaml
from strata.planner.costmodel import rate_label
from strata.planner.explain import format_rate


def _arch_description(args: argparse.Namespace, model_flag: str) -> ModelDescription | None:
    """The ``--arch FILE --ftype NAME`` description, or None when a model was given instead.

    Raises:
        StrataError: both or neither of the model and ``--arch``; ``--arch`` without ``--ftype``
            or ``--ftype`` without ``--arch``; a bad architecture file or file type.
    """
    from strata.planner.archdesc import FTYPES, describe_arch

    if bool(args.arch) == bool(args.model):
        raise StrataError(f"give exactly one of {model_flag} and --arch FILE.yaml --ftype NAME")
    if not args.arch:
        if args.ftype:
            raise StrataError("--ftype goes with --arch (a GGUF file has its own file type)")
        return None
    if not args.ftype:
        raise StrataError(f"--arch needs --ftype NAME (one of {', '.join(FTYPES)})")
    return describe_arch(args.arch, args.ftype)


def cmd_describe(args: argparse.Namespace) -> None:
    from strata.common.describe import describe

    check_output(args.output, args.model, getattr(args, "arch", None))
    desc = _arch_description(args, "MODEL")
    if desc is None:
        desc, _ = describe(args.model)
    emit(desc, args.output)


def _prompt_range(text: str | None) -> list[int] | None:
    """``--prompt-tokens 128,1024`` (or one length) as [shortest, longest]; None: the default."""
    if text is None:
        return None
    try:
        lengths = [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        lengths = []
    if len(lengths) not in (1, 2):
        raise StrataError(
            f"--prompt-tokens {text!r}: give the shortest and longest prompt in tokens, e.g. "
            "128,1024 (or one length)"
        )
    return [lengths[0], lengths[-1]]


def request_from_args(args: argparse.Namespace) -> Request:
    """The planning request from ``strata plan``'s options (sizes parsed, bounds checked)."""
    return parse_doc(
        {
            "context": args.context,
            "concurrency": args.concurrency,
            "objective": args.objective,
            "gpu_budget_bytes": parse_size(args.gpu_budget) if args.gpu_budget else None,
            "ram_budget_bytes": parse_size(args.ram_budget) if args.ram_budget else None,
            "tiers": [t.strip() for t in args.tiers.split(",") if t.strip()],
            "prompt_tokens": _prompt_range(args.prompt_tokens),
            "output_tokens": args.output_tokens,
        },
        Request,
        "request",
    )


def speculative_from_args(args: argparse.Namespace):
    """The ``--speculative`` options as a ``planner.speculative.SpeculativeRequest``.

    Raises:
        StrataError: options that do not go together or are out of range.
    """
    from strata.planner.speculative import SpeculativeRequest

    return SpeculativeRequest(
        method=getattr(args, "speculative", None) or "none",
        draft_model=getattr(args, "draft_model", None),
        num_draft_tokens=getattr(args, "num_draft_tokens", None),
        acceptance_rate=getattr(args, "acceptance_rate", None),
    )


def plan_from_args(args: argparse.Namespace, desc: ModelDescription | None = None) -> Plan:
    """The plan ``strata plan``'s options ask for: ``args.model`` (or ``--arch``/``--ftype``, or
    the already-built description ``desc``), ``args.profile`` (a path) and every option of
    :func:`add_plan_options`. ``strata plan`` writes it; ``strata run|serve|chat MODEL``
    (``strata.autoplan``) caches it.

    Raises:
        StrataError: options that do not go together or are out of range (before the model is
            read), a bad model or profile, an infeasible request (``planning.build_plan``).
    """
    from strata.planner.planning import build_plan

    speculative = speculative_from_args(args)  # before describing: option errors come first
    cluster = getattr(args, "cluster", None)
    if bool(cluster) == bool(args.profile):
        raise StrataError("give exactly one of --profile FILE and --cluster FILE")
    if cluster and (speculative.method != "none" or args.baseline):
        raise StrataError(
            "--cluster plans take no --speculative and no --baseline yet; drop them, or plan "
            "one host with --profile"
        )
    if cluster and (
        getattr(args, "gpu_budget", None) is not None
        or getattr(args, "ram_budget", None) is not None
    ):
        raise StrataError(
            "--gpu-budget/--ram-budget are one host's; a cluster's budgets are per host: set "
            "gpu_budget_bytes / ram_budget_bytes of each host in the cluster file"
        )
    if desc is None:
        desc = _arch_description(args, "--model")
    request = request_from_args(args)
    routing = Path(args.routing_profile) if args.routing_profile else None
    if cluster:
        from strata.planner.cluster import build_cluster_plan

        return build_cluster_plan(
            args.model, Path(cluster), request, desc=desc, routing_profile=routing
        )
    return build_plan(
        args.model,
        Path(args.profile),
        request,
        desc=desc,
        routing_profile=routing,
        speculative=speculative,
        baseline=args.baseline,
    )


def plan_summary(plan: Plan, baseline: bool = False) -> str:
    """What a plan decided, in one line: the bytes on each tier, speculative decoding, and the
    predicted decode rate (e.g. ``gpu 112.35 MiB; predicted 25.3 tok/s``)."""
    tiers: dict[str, int] = {}
    for p in plan.placement:
        tiers[p.tier] = tiers.get(p.tier, 0) + p.bytes
    where = ", ".join(f"{t} {format_size(b)}" for t, b in sorted(tiers.items()))
    if plan.cluster is not None:
        c = plan.cluster
        stages = ", ".join(
            f"{s.host} blk {s.first_block}"
            + (f"–{s.end_block - 1}" if s.end_block - s.first_block > 1 else "")
            for s in c.stages
        )
        binding = c.prediction.binding if c.prediction else "none"
        n = len(c.stages)
        where = f"{n} host{'s' * (n != 1)} ({stages}); {where}; binding {binding}"
    tok_s = plan.prediction.decode_tok_s if plan.prediction else 0
    sp = plan.speculative
    if sp.method != "none":
        where += (
            f"; speculative {sp.method}, K = {sp.num_draft_tokens}"
            + (f", {sp.draft_layers} draft layers" if sp.draft_layers else "")
            + f", {format_rate(sp.predicted_decode_tok_s or 0)} tok/s with it"
        )
    rate = f"{format_rate(tok_s)} tok/s" + rate_label(plan.request, plan.batch)
    if baseline:
        rate += " (the baseline rule's plan, not the ILP's)"
    return f"{where}; predicted {rate}"


def cmd_plan(args: argparse.Namespace) -> None:
    draft = getattr(args, "draft_model", None)
    check_output(
        args.output,
        args.model,
        args.profile,
        getattr(args, "arch", None),
        draft,
        getattr(args, "cluster", None),
    )
    plan = plan_from_args(args)
    write_yaml(plan, args.output)
    print(f"wrote {args.output}: {plan_summary(plan, args.baseline)}", file=sys.stderr)


def cmd_diff(args: argparse.Namespace) -> None:
    from strata.planner.diff import diff

    print(diff(read_yaml(args.a, Plan), read_yaml(args.b, Plan)))


def cmd_explain(args: argparse.Namespace) -> None:
    from strata.planner.explain import explain

    print(explain(read_yaml(args.plan, Plan)))


def cmd_synth(args: argparse.Namespace) -> None:
    from strata.common.sizes import format_size
    from strata.planner.synthetic import shape_from_args, write_synthetic

    shape = shape_from_args(
        args.shape,
        layers=args.layers,
        width=args.width,
        ffn=args.ffn,
        heads=args.heads,
        kv_heads=args.kv_heads,
        experts=args.experts,
        experts_used=args.experts_used,
    )
    m = write_synthetic(
        args.output,
        shape,
        ftype=args.ftype,
        seed=args.seed,
        tokenizer=args.tokenizer,
        logit_std=args.logit_std,
        routing=args.routing,
        progress=True,
    )
    moe = f", {m.shape.experts_used} of {m.shape.experts} experts, {m.routing} routing"
    print(
        f"wrote {m.path}: {m.shape.name} {m.ftype}{moe if m.shape.experts else ''}, "
        f"{m.n_params / 1e6:,.1f} M weights, {format_size(m.size_bytes)}",
        file=sys.stderr,
    )


def presets() -> str:
    from strata.planner.synthetic import SHAPES

    def line(s) -> str:
        moe = f", {s.experts} experts ({s.experts_used} used)" if s.experts else ""
        return (
            f"  {s.name:<14} {s.arch}: {s.layers} layers, width {s.width}, ffn {s.ffn}{moe}, "
            f"{s.heads}/{s.kv_heads} heads of {s.head_dim}"
        )

    return "presets:\n" + "\n".join(line(s) for s in SHAPES.values())


PLAN_DEFAULTS: dict[str, object] = {
    "routing_profile": None,
    "profile": None,
    "context": 4096,
    "concurrency": 1,
    "objective": "latency",
    "prompt_tokens": None,
    "output_tokens": None,
    "gpu_budget": None,
    "ram_budget": None,
    "tiers": "gpu,ram,nvme",
    "speculative": "none",
    "draft_model": None,
    "num_draft_tokens": None,
    "acceptance_rate": None,
    "baseline": False,
}
"""Every option of :func:`add_plan_options` by its ``dest``, with ``strata plan``'s default."""


def _at_least_one(text: str) -> int:
    """An option's whole number of at least 1 (argparse turns the error into one line)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give 1 or more")
    return n


def add_plan_options(p, *, from_model: bool = False, concurrency: int = 1) -> None:
    """Declare the planning options (``--profile``, ``--context``, ``--concurrency``, budgets,
    tiers, speculative decoding, ``--baseline`` ...; one per key of :data:`PLAN_DEFAULTS`) on
    ``p``, a parser or an argument group. The model (``--model``/``--arch``) and ``-o`` are the
    caller's.

    Args:
        p: where to add them.
        from_model: for ``strata run|serve|chat MODEL`` (``strata.autoplan``): ``--profile`` is
            optional (default: this machine's kept profile) and no option has a default, so an
            option is in the parsed namespace only when given (``argparse.SUPPRESS``): the
            command refuses them with a plan file and fills in the defaults itself.
        concurrency: the default ``--concurrency`` the help states (``serve``'s differs).
    """

    def opt(*flags: str, **kw) -> None:
        dest = flags[0].lstrip("-").replace("-", "_")
        kw["default"] = argparse.SUPPRESS if from_model else PLAN_DEFAULTS[dest]
        p.add_argument(*flags, **kw)

    opt(
        "--routing-profile",
        metavar="FILE",
        help="MoE: measured routing (strata run --save-routing-profile) in place of uniform "
        "top-k/n expert access",
    )
    if from_model:
        opt(
            "--profile",
            metavar="FILE",
            help="hardware profile YAML to plan with (default: this machine's, measured once and "
            "kept in the cache; strata profile measures it again)",
        )
    else:
        opt("--profile", help="hardware profile YAML (or --cluster FILE)")
    shorter = ", or the model's training context where shorter" if from_model else ""
    opt(
        "--context",
        type=_at_least_one,
        help=f"tokens per sequence (default {PLAN_DEFAULTS['context']}{shorter})",
    )
    opt("--concurrency", type=_at_least_one, help=f"sequences at once (default {concurrency})")
    opt("--objective", choices=("latency", "throughput"), help="what to optimize (latency)")
    opt(
        "--prompt-tokens",
        metavar="MIN,MAX",
        help="the shortest and longest prompt to plan for, tokens: the cost model prices time to "
        "first token over them (default min(128, context/4),min(1024, context/2))",
    )
    opt(
        "--output-tokens",
        type=int,
        help="tokens generated per request, which weighs time to first token against decode "
        "(default 256, or what the context leaves after the longest prompt)",
    )
    opt("--gpu-budget", help="override the device working set, e.g. 512MiB, 8GiB")
    opt("--ram-budget", help="override host RAM available, e.g. 8GB")
    opt("--tiers", help=f"tiers the plan may use (default {PLAN_DEFAULTS['tiers']})")
    opt(
        "--speculative",
        choices=("none", "prompt_lookup", "draft_model", "self"),
        help="speculative decoding: draft tokens from n-grams of the sequence (prompt_lookup), a "
        "smaller model of the same vocabulary (draft_model), or the model's own resident layers "
        "(self); the cost model chooses K (default none)",
    )
    opt(
        "--draft-model",
        metavar="MODEL",
        help="with --speculative draft_model: catalog name or GGUF path, planned together with "
        "the target (its weights and KV cache on the device first)",
    )
    opt(
        "--num-draft-tokens",
        type=int,
        metavar="K",
        help="draft tokens per step, 1..16 (default: the cost model's choice, 1..8)",
    )
    opt(
        "--acceptance-rate",
        type=float,
        metavar="A",
        help="measured share of draft tokens accepted, 0..1 (default: an assumed figure per "
        "method, stated in the plan)",
    )
    opt(
        "--baseline",
        action="store_true",
        help="the baseline rule's plan instead of the ILP's: the first blocks resident in "
        "order, the rest on the next tier (llama.cpp's -ngl/--fit), for comparison",
    )


def add_commands(sub) -> None:
    """Add the planner's subcommands (describe, plan, diff, explain) to ``sub``."""
    d = sub.add_parser(
        "describe", help="model description (YAML) from a GGUF header or an architecture file"
    )
    d.add_argument("model", nargs="?", help="catalog name (smollm2-135m, gemma3-270m) or GGUF path")
    d.add_argument("--arch", help="instead of MODEL: architecture file (profiles/arch/*.yaml)")
    d.add_argument("--ftype", help="with --arch: llama.cpp file type, e.g. Q4_K_M")
    d.add_argument("-o", "--output", help="write here instead of stdout")

    pl = sub.add_parser("plan", help="solve the placement ILP and write a plan")
    pl.add_argument("--model", help="catalog name or GGUF path")
    pl.add_argument("--arch", help="instead of --model: architecture file (profiles/arch/*.yaml)")
    pl.add_argument("--ftype", help="with --arch: llama.cpp file type, e.g. Q4_K_M")
    add_plan_options(pl)
    pl.add_argument(
        "--cluster",
        metavar="FILE",
        help="instead of --profile: a cluster description (hosts, their profiles, the links "
        "between them; profiles/clusters/*.yaml): a pipeline of contiguous blocks per host "
        "(docs/clusters.md)",
    )
    pl.add_argument("-o", "--output", required=True, help="plan file to write")

    df = sub.add_parser("diff", help="what differs between two plans")
    df.add_argument("a")
    df.add_argument("b")

    ex = sub.add_parser("explain", help="why each unit is where it is; the bottleneck")
    ex.add_argument("plan")


def add_synth_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``synth`` (a synthetic GGUF of a real model's shape)."""
    from strata.planner.synthetic import FTYPES, ROUTING, SHAPES
    from strata.planner.synthetic_routing import TARGET_LIFT, TARGET_SHARE

    p.add_argument("--shape", required=True, help=f"preset: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, help="override the number of blocks")
    p.add_argument("--width", type=int, help="override the embedding length")
    p.add_argument("--ffn", type=int, help="override the feed-forward length (per expert for MoE)")
    p.add_argument("--heads", type=int, help="override the query head count")
    p.add_argument("--kv-heads", type=int, help="override the key/value head count")
    p.add_argument(
        "--experts",
        type=int,
        help="override the experts per MoE block (0 makes a llama MoE shape dense)",
    )
    p.add_argument("--experts-used", type=int, help="override the experts chosen per token")
    routing_help = (
        f"{', '.join(ROUTING)}: MoE shapes' routers. 'uniform' (default): every expert equally "
        "likely, layers independent. 'skewed': each layer's top quarter of experts takes about "
        f"{TARGET_SHARE * 100:.0f}%% of the selections, and an expert's designated successor in "
        f"the next layer fires about {TARGET_LIFT:g}x more often than chance when it fired. Both "
        "are built into the weights (a token's routing then depends on its id only; they need "
        "--width 128 or more, skewed at least 4 experts) and their files differ only in the "
        "routers. 'random': plain random routers, nothing designed (not uniform: a random "
        "model's residual stream drifts to a shared component that biases them, more with "
        "depth). See planner/synthetic.py"
    )
    p.add_argument("--routing", default="uniform", help=routing_help)
    p.add_argument("--ftype", default="Q4_0", help=f"{', '.join(FTYPES)} (default Q4_0)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--tokenizer",
        default="smollm2-135m",
        help="catalog name or GGUF path to copy tokenizer.* from (default smollm2-135m)",
    )
    p.add_argument(
        "--logit-std", type=float, default=3.0, help="target std of the logits (default 3)"
    )
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")


SYNTH_DOC = """Write a synthetic GGUF: a real model's shape and quant types, random weights,
SmolLM2's tokenizer.

For exercising tier streaming at sizes no real test model here reaches; llama.cpp runs the files
too. Dense llama shapes and mixture-of-experts shapes (Mixtral: llama with experts; Qwen3-MoE:
qwen3moe). MoE routing is uniform, or skewed and correlated across layers like a trained model's
(--routing skewed), or whatever plain random routers do (--routing random). Argument parsing
only: the work is in planner/synthetic.py (the construction) and planner/synthetic_routing.py
(the routing design and its statistics).
"""

COMMANDS = {
    "describe": cmd_describe,
    "plan": cmd_plan,
    "diff": cmd_diff,
    "explain": cmd_explain,
    "synth": cmd_synth,
}
