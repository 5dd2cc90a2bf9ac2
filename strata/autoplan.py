"""One command from a model to tokens: ``strata run|serve|chat MODEL``, where MODEL is a catalog
name or a GGUF path and no plan is given.

The command then plans MODEL for this machine itself, as ``strata plan`` would, and runs that
plan exactly as it would run a plan file:

1. **Profile, once per machine.** The profile ``strata profile`` last kept for this host
   (``executor.machine.last_profile``) is used; where there is none (or it is for another MLX
   backend) this machine is measured once (``executor.profile.measure_profile``, about
   :data:`PROFILE_SECONDS` s) and kept, which one line on stderr says. ``--profile FILE`` plans
   with that profile instead.
2. **Plan, cached by the inputs' digest.** The plan is ``strata plan``'s
   (``planner.cli.plan_from_args``) with its defaults, every option of ``plan`` passed through,
   and kept in ``<cache>/plans/<digest>.yaml`` (written whole: ``common.atomic.replaced``). The
   digest covers the model's sha256 and catalog name, the profile's content, every plan option,
   the routing profile's and draft model's bytes, and the planner (Strata's version, the plan
   format and the source of the planner and the contract layer), so a second run with the same
   inputs reads the plan back without solving, and any change plans again.
3. **Say what was decided**: the plan's path and one line (tiers, context, sequences, predicted
   rate) on stderr; then the command runs with ``args.plan`` set to the plan's path.

Defaults that differ from ``strata plan``'s: the context is 4096 tokens or the model's training
context where that is shorter (a plan longer than it only warns), and ``serve`` plans for
:data:`COMMAND_DEFAULTS` ``["serve"]["concurrency"]`` sequences at once (``run`` and ``chat``
for one).

What the positional is: a path ending ``.yaml``/``.yml`` is a plan file, as is any other existing
file that does not start with the GGUF magic; a catalog name or an existing GGUF (by magic or a
``.gguf`` name) is a model; anything else is a one-line error naming both readings. A plan
option given with a plan file, or ``--model PATH`` (where a plan's GGUF is) given with a model,
is refused in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import sys
import time
from pathlib import Path

from strata import __version__
from strata.common import catalog
from strata.common.atomic import replaced
from strata.common.errors import StrataError
from strata.common.gguf_file import open_gguf
from strata.common.schemas import PLAN_VERSION, HardwareProfile, Plan
from strata.common.sizes import parse_size
from strata.common.tensors import executor_rule
from strata.common.yamlio import canonical_sha256, read_yaml, sha256_of, to_yaml
from strata.planner import cli as planner_cli

COMMANDS = ("run", "serve", "chat")
"""The commands whose positional may be a model, planned here first."""

COMMAND_DEFAULTS: dict[str, dict[str, object]] = {"serve": {"concurrency": 4}}
"""Plan options whose default differs by command: a server plans its KV cache and batch for a
few clients at once (4: each sequence's KV cache at the full context is the cost; pass
``--concurrency``/``--context`` to change it); ``run`` and ``chat`` hold one conversation."""

PROFILE_SECONDS = 20
"""About how long measuring this machine takes (``strata profile``: a disk, memory, copy and
compute test), as the line before it says."""

PLAN_SUFFIXES = (".yaml", ".yml")
PLAN_GZ_SUFFIXES = (".yaml.gz", ".yml.gz")  # a gzip-compressed plan (common.yamlio)


def add_options(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """Add ``strata plan``'s options (``planner.cli.add_plan_options``) to the parser of each of
    :data:`COMMANDS` found in ``parsers`` (a subparsers action's ``choices``), as a group."""
    for name in COMMANDS:
        p = parsers.get(name)
        if p is None:  # plan.py offers none of them
            continue
        group = p.add_argument_group(
            "planning a MODEL (the options of strata plan; not with a PLAN file)"
        )
        concurrency = COMMAND_DEFAULTS.get(name, {}).get("concurrency", 1)
        planner_cli.add_plan_options(group, from_model=True, concurrency=int(concurrency))


def is_model(spec: str) -> bool:
    """Whether the positional ``spec`` names a model (True) or a plan file (False).

    Raises:
        StrataError: neither a plan file, a catalog name nor a GGUF (one line naming both
            readings and the catalog).
    """
    path = Path(spec).expanduser()
    if path.suffix.lower() in PLAN_SUFFIXES or path.name.lower().endswith(PLAN_GZ_SUFFIXES):
        return False  # a missing plan file is the plan reader's error, as it always was
    if spec in catalog.CATALOG and not path.is_file():  # a file of that name is read as one
        return True
    if path.is_file():
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError:
            return False  # unreadable: the plan reader names why
        return magic == b"GGUF" or path.suffix.lower() == ".gguf"
    what = "not a file" if path.exists() else "no such plan file, catalog model or GGUF"
    raise StrataError(
        f"{spec}: {what}; give a plan file (.yaml), a GGUF path or a catalog model "
        f"({', '.join(catalog.CATALOG)})"
    )


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def given_options(args: argparse.Namespace) -> dict[str, object]:
    """The plan options on the command line (declared without defaults, so only those given
    are in ``args``), by ``dest``."""
    return {k: getattr(args, k) for k in planner_cli.PLAN_DEFAULTS if hasattr(args, k)}


def prepare(args: argparse.Namespace) -> None:
    """Before ``run``/``serve``/``chat``: with a model as the positional, plan it (cached) and
    set ``args.plan`` to the plan's path; with a plan file, check that no plan option was
    given and leave everything as it is.

    Raises:
        StrataError: a positional that is neither; plan options with a plan file; ``--model``
            with a model; any planning error (a bad option, an infeasible request ...).
    """
    given = given_options(args)
    if not is_model(args.plan):
        if given:
            flags = ", ".join(_flag(k) for k in given)
            verb = "applies" if len(given) == 1 else "apply"
            raise StrataError(
                f"{flags} {verb} when running a model, not a plan file ({args.plan}); re-plan "
                "with strata plan, or give the model instead of the plan"
            )
        return
    if getattr(args, "model", None) is not None:
        raise StrataError(
            f"--model PATH goes with a plan file (where its GGUF is); {args.plan} is a model "
            "already: drop --model"
        )
    args.plan = str(plan_for(args.plan, args.command, given))


def machine_profile() -> Path:
    """The file of this machine's kept profile (``strata profile``'s), measured and kept first
    where there is none or it is for another MLX backend than this machine runs.

    Raises:
        StrataError: the measurement failed (e.g. the cache's disk cannot be written).
    """
    from strata.executor.machine import (
        host_profile_name,
        keep_profile,
        kept_profile_path,
        last_profile,
    )
    from strata.executor.profile import detect_backend, measure_profile

    kept = last_profile()
    backend = detect_backend()
    if kept is not None and kept.backend == backend:
        return kept_profile_path()
    why = "" if kept is None else f"; the kept one is for MLX's {kept.backend} backend"
    print(
        f"profiling this machine once (~{PROFILE_SECONDS} s{why}; strata profile measures it "
        "again) ...",
        end="",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # its progress lines: one line here
            profile = measure_profile(catalog.cache_dir(), host_profile_name())
    except BaseException:
        print(file=sys.stderr)  # an error (or Ctrl-C) gets a line of its own, after what
        sys.stderr.write(said.getvalue())  # the measurement said
        raise
    keep_profile(profile)
    print(f" done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return kept_profile_path()


def _planner_identity() -> str:
    """Strata's version, the plan format and a digest of the planner's, the contract layer's and
    this module's source files: a cached plan is solved again after any change to the code that
    made it."""
    from strata import common, planner

    h = hashlib.sha256(f"{__version__}|{PLAN_VERSION}".encode())
    for package in (planner, common):
        for f in sorted(Path(package.__file__).parent.glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(Path(__file__).read_bytes())  # this module's defaults (the context rule)
    return h.hexdigest()


def _file_sha256(option: str, path: str) -> str:
    """sha256 of the file an option names.

    Raises:
        StrataError: the file cannot be read.
    """
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError as e:
        raise StrataError(f"{option} {path}: {e.strerror or e}") from None


def plan_digest(
    model: catalog.ResolvedModel, profile: HardwareProfile, options: dict[str, object]
) -> str:
    """sha256 of everything a plan of ``model`` depends on: the model's bytes (sha256) and
    catalog name (or, given by path, its absolute path), the profile's content (not its
    file), every plan option in ``options`` (by ``dest``; sizes in bytes, so ``1GiB`` and
    ``1024MiB`` agree; ``context`` None: the default), the bytes of the routing profile and
    the draft model they name, and the planner (:func:`_planner_identity`).

    Raises:
        StrataError: a size that does not parse; a routing profile or draft model not found.
    """
    opts = dict(options)
    for k in ("gpu_budget", "ram_budget"):
        if opts.get(k):
            opts[k] = parse_size(str(opts[k]))
    files = {}
    if opts.get("routing_profile"):
        files["routing_profile"] = _file_sha256("--routing-profile", str(opts["routing_profile"]))
    if opts.get("draft_model"):
        files["draft_model"] = catalog.resolve_model(str(opts["draft_model"])).sha256
    return sha256_of(
        {
            # A file given by path is also planned by its path (the plan's hint): copies of one
            # GGUF in two places each get a plan that finds its own.
            "model": {
                "sha256": model.sha256,
                "name": model.name,
                "path": None if model.name else str(model.path.resolve()),
            },
            "profile": canonical_sha256(profile),
            "options": opts,
            "files": files,
            "planner": _planner_identity(),
        }
    )


def plans_dir() -> Path:
    """Where plans made from a model are kept: ``<cache>/plans``."""
    return catalog.cache_dir() / "plans"


def _cached(path: Path) -> Plan | None:
    """The plan kept at ``path``, or None where there is none or it does not read (an older
    format, a damaged file): then it is made again."""
    if not path.is_file():
        return None
    try:
        return read_yaml(path, Plan)
    except StrataError:
        return None


def _shown(path: Path) -> str:
    """``path`` with the home folder as ``~``."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except (ValueError, RuntimeError):  # elsewhere, or no home folder known
        return str(path)


def plan_for(spec: str, command: str, given: dict[str, object]) -> Path:
    """The plan of model ``spec`` for this machine, from the cache or solved and kept there;
    one line on stderr says where it is and what it decided.

    Args:
        spec: catalog name or GGUF path.
        command: ``run``, ``serve`` or ``chat``: its defaults (:data:`COMMAND_DEFAULTS`).
        given: plan options from the command line, by ``dest`` (``--profile`` among them).

    Raises:
        StrataError: the model or a profile cannot be read; an architecture the executor does
            not run (``strata.common.tensors.executor_rule``); a bad option; an infeasible
            request; the cache cannot be written.
    """
    from strata.common.describe import describe

    model = catalog.resolve_model(spec, progress=True)
    # An architecture the executor does not run (qwen3next...) is refused from its header, before
    # this machine is measured or the model planned.
    executor_rule(open_gguf(model.path).architecture)
    options = {**planner_cli.PLAN_DEFAULTS, "context": None, **COMMAND_DEFAULTS.get(command, {})}
    options.update(given)
    profile_file = options.pop("profile")
    if profile_file and not Path(str(profile_file)).expanduser().is_file():
        raise StrataError(f"--profile {profile_file}: no such file; measure one (strata profile)")
    profile_path = Path(str(profile_file)).expanduser() if profile_file else machine_profile()
    profile = read_yaml(profile_path, HardwareProfile)
    path = plans_dir() / f"{plan_digest(model, profile, options)[:16]}.yaml"
    plan = _cached(path)
    state = "cached"
    if plan is None:
        desc, _ = describe(spec)
        if options["context"] is None:
            trained = desc.architecture.context_length
            default = int(planner_cli.PLAN_DEFAULTS["context"])  # type: ignore[call-overload]
            options["context"] = min(default, trained) if trained else default
        args = argparse.Namespace(
            **options, model=spec, profile=str(profile_path), arch=None, ftype=None
        )
        plan = planner_cli.plan_from_args(args, desc=desc)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with replaced(path, "w") as f:  # whole or not at all, beside other runs planning it
                f.write(to_yaml(plan))
        except OSError as e:
            raise StrataError(
                f"cannot keep the plan in {path.parent} ({e.strerror or e}); set STRATA_CACHE "
                "to a writable folder"
            ) from None
        state = "new"
    n = plan.request.concurrency
    print(
        f"plan: {_shown(path)} ({state}): context {plan.request.context}, {n} "
        f"sequence{'s' if n != 1 else ''}; "
        f"{planner_cli.plan_summary(plan, bool(options['baseline']))}",
        file=sys.stderr,
    )
    return path
