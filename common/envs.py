"""Every environment variable Strata reads, in one table (vLLM's ``envs.py`` habit).

No other module reads ``os.environ`` for a ``STRATA_*`` setting: it asks :func:`get` (or reads
the attribute, ``envs.STRATA_CACHE``). Each read looks at the environment at that moment, so a
test's ``monkeypatch.setenv`` takes effect at once; the executor reads its settings once, when it
builds its runtime config (``strata.executor.config.RuntimeConfig.build``).

================================ ======= =================== =======================================
Variable                         Type    Default             Meaning
================================ ======= =================== =======================================
``STRATA_API_KEY``               text    none                The API key ``strata serve`` requires
                                                             (``Authorization: Bearer KEY``) when
                                                             neither ``--api-key`` nor
                                                             ``--api-key-file`` is given;
                                                             surrounding spaces are dropped. Empty:
                                                             no key.
``STRATA_CACHE``                 path    ``~/.cache/strata`` Where catalog models, their verified
                                                             sha256s and packed stores
                                                             (``executor.pack``) are kept. Empty:
                                                             the default.
``STRATA_COMPILED_PASSES``       boolean on                  Replay compiled graphs for small
                                                             resident passes
                                                             (``executor.pass_graph``); ``0``,
                                                             ``false``, ``off`` or ``no`` runs every
                                                             pass eagerly (``1``, ``true``, ``on``,
                                                             ``yes``: on). Empty: the default.
``STRATA_LONE_DECODE_KERNEL``    boolean on                  A lone decode attends with Strata's
                                                             paged kernel (compiled passes then take
                                                             it) on MLX's CUDA backend; ``0`` takes
                                                             MLX's SDPA. Empty: the default.
``STRATA_PIPELINED_STEPS``       boolean on                  Build each greedy serving step while
                                                             the device computes the one before
                                                             (``executor.serving``); ``0`` waits for
                                                             every step's tokens first. Empty: the
                                                             default.
``STRATA_PIPELINE_FLOW``         boolean on                  A cluster plan's prompt chunks before
                                                             the last flow through the ranks without
                                                             coming back (``executor.pipeline``);
                                                             ``0`` runs every pass lock-step. Empty:
                                                             the default.
``STRATA_DECODE_MICRO_BATCHES``  integer the plan's          A cluster plan's decode steps of
                                                             several sequences are cut into up to
                                                             this many micro-batches flowing through
                                                             the ranks (``executor.pipeline``);
                                                             ``1`` runs them whole. Empty: the
                                                             plan's ``micro_batches``.
================================ ======= =================== =======================================
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.common.errors import StrataError

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _flag(name: str, text: str) -> bool:
    """A boolean variable's value; any other spelling is refused rather than guessed."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise StrataError(
        f"{name}={text!r} is not a boolean; set it to one of {', '.join(_TRUE + _FALSE)} "
        "or unset it"
    )


def _count(name: str, text: str) -> int:
    """A whole number of at least 1; anything else is refused."""
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise StrataError(f"{name}={text!r} is not a whole number >= 1; set one or unset it")
    return value


def _path(name: str, text: str) -> Path:
    return Path(text)


def _text(name: str, text: str) -> str:
    """The text without surrounding white space; only white space is refused."""
    if not text.strip():
        raise StrataError(f"{name} holds only white space; set it to a value or unset it")
    return text.strip()


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, how its text is parsed (``parse(name, text)``, which
    raises ``StrataError`` naming the fix), the value when it is unset or empty (a callable where
    the default depends on the machine, e.g. the home folder), and what it means."""

    name: str
    parse: Callable[[str, str], Any]
    default: Callable[[], Any]
    meaning: str


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "STRATA_API_KEY",
            _text,
            lambda: None,
            "the API key strata serve requires when no --api-key or --api-key-file is given",
        ),
        EnvVar(
            "STRATA_CACHE",
            _path,
            lambda: Path.home() / ".cache" / "strata",
            "folder of catalog models, their verified sha256s and packed stores",
        ),
        EnvVar(
            "STRATA_COMPILED_PASSES",
            _flag,
            lambda: True,
            "replay compiled graphs for small resident passes (executor.pass_graph); "
            "0/false/off/no: every pass eager",
        ),
        EnvVar(
            "STRATA_LONE_DECODE_KERNEL",
            _flag,
            lambda: True,
            "a lone decode attends with Strata's paged kernel on MLX's CUDA backend (compiled "
            "passes then take it); 0/false/off/no: MLX's SDPA",
        ),
        EnvVar(
            "STRATA_PIPELINED_STEPS",
            _flag,
            lambda: True,
            "build each greedy serving step while the device computes the one before "
            "(executor.serving); 0/false/off/no: wait for every step's tokens first",
        ),
        EnvVar(
            "STRATA_PIPELINE_FLOW",
            _flag,
            lambda: True,
            "a cluster plan's prompt chunks before the last flow through the ranks without "
            "coming back (executor.pipeline); 0/false/off/no: every pass lock-step",
        ),
        EnvVar(
            "STRATA_DECODE_MICRO_BATCHES",
            _count,
            lambda: None,
            "a cluster plan's decode steps of several sequences are cut into up to this many "
            "micro-batches flowing through the ranks (executor.pipeline); 1: whole; unset: the "
            "plan's micro_batches",
        ),
    )
}
"""The table the module docstring renders: name -> :class:`EnvVar`."""


def get(name: str) -> Any:
    """The value of variable ``name`` now: parsed from the environment, or its default where it
    is unset or empty.

    Raises:
        KeyError: ``name`` is not in :data:`VARIABLES` (add it there, with its meaning).
        StrataError: the variable's text does not parse (the message names the fix).
    """
    var = VARIABLES[name]
    text = os.environ.get(name, "")
    return var.parse(name, text) if text else var.default()


def child_environment(**values: str) -> dict[str, str]:
    """This process's environment with Strata variables set for a child process (by name,
    e.g. ``STRATA_CACHE="/tmp/c"``).

    Raises:
        KeyError: a name not in :data:`VARIABLES`.
    """
    for name in values:
        VARIABLES[name]  # noqa: B018 - a KeyError names an unknown variable
    return {**os.environ, **values}


def __getattr__(name: str) -> Any:
    """``envs.STRATA_CACHE`` reads the variable now (module attribute access, PEP 562)."""
    if name in VARIABLES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
