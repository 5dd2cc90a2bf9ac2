"""``strata cache ls`` and ``strata cache rm``: what Strata keeps in its cache folder
(``$STRATA_CACHE``, default ``~/.cache/strata``), how large each thing is, and removing it.

Each kind of thing is one row of ``KINDS``: where it lives under the cache folder, how its files
group into entries (a pack and its manifest are one entry) and what each entry is (the catalog
name of a model file, the model a pack or cached plan belongs to). Anything else at the top of
the folder is listed as ``other`` and never removed: the folder may be shared with other files.

``rm`` takes kinds (``packs``), ``all`` (every kind), entry names as ``ls`` shows them
(``b179c9523d0e6a0f``) or a model's name (``gemma3-270m``: its file, packs, tokenizer and cached
plans); it removes only paths inside the cache folder, a symbolic link as the link itself.
Everything removed is rebuilt when next needed (a model is fetched again, a pack rebuilt, a model
file hashed again, a profile or plan measured or made again).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from strata.common.catalog import CATALOG, cache_dir
from strata.common.errors import StrataError
from strata.common.sizes import format_size

HASHES = "sha256-cache.json"
"""The remembered sha256s of model files (``strata.common.catalog.file_sha256``)."""


@dataclass(frozen=True)
class Entry:
    """One thing in the cache: what ``ls`` shows on a line and ``rm`` removes at once.

    Attributes:
        kind: its kind's name (``KINDS``), or ``other``.
        name: its name in ``ls`` and ``rm`` (a file's name; a pack's model sha256 prefix).
        paths: the files and folders it is made of, inside the cache folder.
        size: bytes, all its paths together (a folder's files summed, links not followed).
        what: what it is, for people.
        model: the model it belongs to (catalog name, else the model file's name), or None;
            ``rm MODEL`` removes every entry of that model.
    """

    kind: str
    name: str
    paths: tuple[Path, ...]
    size: int
    what: str
    model: str | None = None


class Models:
    """Names of models from what the cache knows: the catalog (by file name and by sha256)
    and the model files this machine hashed (``sha256-cache.json``), read once."""

    def __init__(self, root: Path):
        self.root = root

    @cached_property
    def _hashed(self) -> dict[str, list[Path]]:
        """sha256 -> files hashed to it that still exist."""
        try:
            known = json.loads((self.root / HASHES).read_text())
        except (OSError, ValueError):
            return {}
        out: dict[str, list[Path]] = {}
        for key, digest in known.items() if isinstance(known, dict) else ():
            path = Path(str(key).rsplit("|", 3)[0])
            if isinstance(digest, str) and path.is_file():
                out.setdefault(digest, []).append(path)
        return out

    @cached_property
    def _headers(self) -> dict[str, str]:
        """header sha256 -> model, for the model files in the cache's ``models`` folder (their
        headers read, not their weights) and the models of cached plans."""
        from strata.common.gguf_file import open_gguf

        def files(where: str) -> list[Path]:
            folder = self.root / where
            return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []

        out: dict[str, str] = {}
        for p in files("plans"):
            fields = _plan_fields(p)
            model = _plan_model(fields, self)
            if model and "header_sha256" in fields:
                out[fields["header_sha256"]] = model
        for p in files("models"):
            try:
                out[open_gguf(p).header_sha256] = self.by_file(p.name) or p.name
            except (OSError, ValueError, StrataError):
                pass  # not a GGUF file, or a damaged one: nothing to name
        return out

    def by_header(self, sha: str) -> str | None:
        """The model whose GGUF header has sha256 ``sha`` (tokenizers are cached by it), among
        the cached model files and plans, or None."""
        return self._headers.get(sha)

    def by_file(self, name: str) -> str | None:
        """The catalog name of a cached model file's name, or None."""
        return next((n for n, e in CATALOG.items() if e.filename == name), None)

    def by_sha(self, sha: str) -> str | None:
        """The model whose sha256 is or starts with ``sha``: its catalog name, else the name of
        a file this machine hashed to it, else None."""
        if len(sha) < 12:
            return None
        name = next((n for n, e in CATALOG.items() if e.sha256.startswith(sha)), None)
        if name:
            return name
        files = [p for digest, ps in self._hashed.items() if digest.startswith(sha) for p in ps]
        return files[0].name if files else None


def _of(model: str | None, sha: str) -> str:
    return model if model else f"model sha256 {sha[:12]}… (its file is not known here)"


def _group_by_stem(name: str) -> str:
    """A pack's ``SHA.v1.pack`` and ``SHA.v1.json`` are one entry, ``SHA``; a file being written
    (``.NAME.XXXX.partial``) is one of its own."""
    return name if name.startswith(".") else name.split(".")[0]


def _group_by_sha16(name: str) -> str:
    """``_group_by_stem``, a sha256 shortened to its first 16 digits as packs are named."""
    stem = _group_by_stem(name)
    return stem[:16] if _SHA.match(stem) else stem


_SHA = re.compile(r"^[0-9a-f]{12,64}$")
_DANGLING = "a link to nothing (its target is gone)"
_PARTIAL = "unfinished write (a process writing it, or one interrupted)"


def _describe_model(name: str, paths: list[Path], models: Models) -> tuple[str, str | None]:
    if name.endswith(".partial"):
        return _PARTIAL, None
    if paths[0].is_dir():
        return "download in progress, or one interrupted", None
    catalog = models.by_file(name)
    if catalog:
        return f"{catalog} (catalog model)", catalog
    return "model file", name


def _describe_pack(name: str, paths: list[Path], models: Models) -> tuple[str, str | None]:
    if name.endswith(".partial"):
        return _PARTIAL, None
    manifest = next((p for p in paths if p.suffix == ".json"), None)
    try:
        sha = str(json.loads(manifest.read_text())["model_sha256"]) if manifest else name
    except (OSError, ValueError, KeyError, TypeError):
        sha = name
    if not any(p.suffix == ".pack" for p in paths):
        return "pack manifest without its pack (rebuilt when next used)", models.by_sha(sha)
    model = models.by_sha(sha)
    return f"packed store (NVMe streaming) of {_of(model, sha)}", model


def _describe_profile(name: str, paths: list[Path], models: Models) -> tuple[str, str | None]:
    if name.endswith(".partial"):
        return _PARTIAL, None
    host = name.removesuffix(".yaml")
    here = " (this host)" if host == socket.gethostname() else ""
    return f"hardware profile of host {host}{here}, measured by strata profile", None


def _plan_fields(path: Path) -> dict[str, str]:
    """The ``model:`` section's name, path, sha256 and header_sha256 of a plan file, those
    given (read from the top of the file, not parsed whole: a plan can be large)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for _, line in zip(range(16), f, strict=False):
                m = re.match(r"^  (name|path|sha256|header_sha256): (.+)$", line.rstrip("\n"))
                if m and m.group(2).strip() not in ("null", "''"):
                    fields.setdefault(m.group(1), m.group(2).strip().strip("'\""))
    except OSError:
        pass
    return fields


def _plan_model(fields: dict[str, str], models: Models) -> str | None:
    """A plan's model (``_plan_fields``): its catalog name, else by its sha256, else its name,
    else its path's file name."""
    if fields.get("name") in CATALOG:
        return fields["name"]
    by_sha = models.by_sha(fields["sha256"]) if "sha256" in fields else None
    return by_sha or fields.get("name") or (Path(fields["path"]).name if "path" in fields else None)


def _describe_plan(name: str, paths: list[Path], models: Models) -> tuple[str, str | None]:
    if name.endswith(".partial"):
        return _PARTIAL, None
    model = _plan_model(_plan_fields(paths[0]), models) if paths[0].is_file() else None
    return f"plan made by strata run/chat/serve for {model or 'an unknown model'}", model


def _describe_tokenizer(name: str, paths: list[Path], models: Models) -> tuple[str, str | None]:
    if name.endswith(".partial"):
        return _PARTIAL, None
    sha = paths[0].name.split(".")[0]  # the model's GGUF header's sha256 (executor.tokenizer)
    if _SHA.match(sha):
        model = models.by_header(sha)
        what = model or f"the model of header sha256 {sha[:12]}… (not cached here)"
        return f"built tokenizer of {what}", model
    return "tokenizer", None


def _describe_routing(name: str, paths: list[Path], models: Models) -> tuple[str, str | None]:
    if name.endswith(".partial"):
        return _PARTIAL, None
    return "MoE routing profile kept by strata plan --routing-profile", None


def _describe_hashes(name: str, paths: list[Path], models: Models) -> tuple[str, str | None]:
    try:
        n = len(json.loads(paths[0].read_text()))
    except (OSError, ValueError, TypeError):
        n = 0
    return f"sha256s of {n} model file versions, so that each is hashed once", None


@dataclass(frozen=True)
class Kind:
    """One kind of cached thing.

    Attributes:
        name: as ``ls`` shows it and ``rm`` takes it.
        where: its folder (or, for one file, the file) under the cache folder.
        describe: ``(entry name, its paths, Models) -> (what it is, its model or None)``.
        group: a file name -> the name of the entry it belongs to (default: itself).
    """

    name: str
    where: str
    describe: Callable[[str, list[Path], Models], tuple[str, str | None]]
    group: Callable[[str], str] = lambda name: name


KINDS: tuple[Kind, ...] = (
    Kind("models", "models", _describe_model),  # strata.common.catalog.fetch
    Kind("packs", "packs", _describe_pack, _group_by_stem),  # strata.executor.pack.PackStore
    Kind("tokenizers", "tokenizers", _describe_tokenizer, _group_by_sha16),  # executor.tokenizer
    Kind("plans", "plans", _describe_plan),  # plans made without a plan file
    Kind("profiles", "machine", _describe_profile),  # strata.executor.machine.keep_profile
    Kind("routing", "routing", _describe_routing),  # strata.common.catalog.routing_cache_path
    Kind("hashes", HASHES, _describe_hashes),  # strata.common.catalog.file_sha256
)
"""Every kind of thing in the cache, in ``ls``'s order (a new kind is one row here)."""


def _size(path: Path) -> int:
    """Bytes of a file, a link (itself) or a folder's files (links not followed)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += (Path(folder) / f).lstat().st_size
            except OSError:
                pass
    return total


def entries(root: Path | None = None) -> list[Entry]:
    """Everything in the cache folder ``root`` (default: ``cache_dir()``), kind by kind in
    ``KINDS``' order, then what is not Strata's (kind ``other``)."""
    root = root or cache_dir()
    models = Models(root)
    out: list[Entry] = []
    for kind in KINDS:
        place = root / kind.where
        if not place.exists() and not place.is_symlink():
            continue
        if place.is_file():
            what, model = kind.describe(place.name, [place], models)
            out.append(Entry(kind.name, place.name, (place,), _size(place), what, model))
            continue
        if not place.is_dir():  # a link to nothing, or to something gone
            out.append(Entry(kind.name, place.name, (place,), _size(place), _DANGLING, None))
            continue
        groups: dict[str, list[Path]] = {}
        for p in sorted(place.iterdir()):
            groups.setdefault(kind.group(p.name), []).append(p)
        for name, paths in groups.items():
            what, model = kind.describe(name, paths, models)
            size = sum(_size(p) for p in paths)
            out.append(Entry(kind.name, name, tuple(paths), size, what, model))
    known = {k.where: k for k in KINDS}
    for p in sorted(root.iterdir()):
        if p.name in known:
            continue
        # A file kind's own file being written beside it (strata.common.atomic.replaced).
        kind = next((k for w, k in known.items() if p.name.startswith(f".{w}.")), None)
        if kind is not None and p.name.endswith(".partial"):
            out.append(Entry(kind.name, p.name, (p,), _size(p), _PARTIAL))
        else:
            what = "not Strata's: left alone by strata cache rm"
            out.append(Entry("other", p.name, (p,), _size(p), what))
    return out


def select(found: list[Entry], names: list[str]) -> list[Entry]:
    """The entries ``names`` pick: ``all`` (every kind's, not ``other``), a kind (its name or
    folder), an entry's name or a model's name (its entries), in ``found``'s order.

    Raises:
        StrataError: a name that is none of these (the message lists what there is), or one of
            an entry that is not Strata's.
    """
    picked: set[int] = set()
    kinds = {k.name: k.name for k in KINDS} | {k.where: k.name for k in KINDS}
    for name in names:
        if name == "all":
            hits = [i for i, e in enumerate(found) if e.kind != "other"]
        elif name in kinds:
            hits = [i for i, e in enumerate(found) if e.kind == kinds[name]]
        else:
            hits = [
                i for i, e in enumerate(found) if e.kind != "other" and name in (e.name, e.model)
            ]
            if not hits and any(e.name == name for e in found):
                raise StrataError(
                    f"{name} is not one of Strata's caches (kind other); remove it yourself"
                )
            if not hits and name not in CATALOG:
                models = sorted({e.model for e in found if e.model})
                names = [e.name for e in found if e.kind != "other"]
                raise StrataError(
                    f"nothing in the cache is called {name!r}; give all, a kind "
                    f"({', '.join(k.name for k in KINDS)})"
                    + (f", a model ({', '.join(models)})" if models else "")
                    + (f" or an entry ({', '.join(names)})" if names else " (the cache is empty)")
                )
        picked.update(hits)
    return [e for i, e in enumerate(found) if i in picked]


def _inside(path: Path, root: Path) -> Path:
    """``path`` with its folder resolved, checked to lie inside ``root`` (resolved).

    Raises:
        StrataError: it does not (a kind's folder linked elsewhere): nothing is removed.
    """
    real = path.parent.resolve() / path.name
    if root.resolve() not in real.parents:
        raise StrataError(
            f"{path} lies outside the cache folder {root} (a link?); remove it yourself"
        )
    return real


def remove(chosen: list[Entry], root: Path | None = None) -> int:
    """Remove ``chosen``'s paths (a link as itself, a folder with everything in it).

    Returns:
        The bytes freed (the entries' sizes as listed).

    Raises:
        StrataError: a path outside the cache folder (checked for all before any is removed),
            or one that cannot be removed (the message names it and why).
    """
    root = root or cache_dir()
    paths = [_inside(p, root) for e in chosen for p in e.paths]
    for p in paths:
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        except OSError as e:
            raise StrataError(f"cannot remove {p}: {e.strerror or e}") from None
    return sum(e.size for e in chosen)


def _table(rows: list[Entry]) -> list[str]:
    cells = [("KIND", "NAME", "SIZE", "WHAT")] + [
        (e.kind, e.name, format_size(e.size), e.what) for e in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return [
        f"{k:<{widths[0]}}  {n:<{widths[1]}}  {s:>{widths[2]}}  {w}".rstrip()
        for k, n, s, w in cells
    ]


def _totals(rows: list[Entry]) -> str:
    by_kind: dict[str, list[Entry]] = {}
    for e in rows:
        by_kind.setdefault(e.kind, []).append(e)
    parts = [
        f"{kind} {format_size(sum(e.size for e in es))} ({len(es)})" for kind, es in by_kind.items()
    ]
    return f"total {format_size(sum(e.size for e in rows))}: " + ", ".join(parts)


def cmd_cache(args: argparse.Namespace) -> None:
    """``strata cache ls [NAME ...]`` and ``strata cache rm NAME ...`` (module docstring)."""
    root = cache_dir()
    found = entries(root)
    if args.action == "ls":
        rows = select(found, args.names) if args.names else found
        if not rows:
            print(f"nothing cached in {root}")
            return
        print("\n".join(_table(rows)))
        print(f"{_totals(rows)}, in {root}")
        return
    chosen = select(found, args.names)
    if not chosen:
        print(f"nothing to remove for {' '.join(args.names)} in {root}")
        return
    freed = remove(chosen, root)
    for e in chosen:
        print(f"removed {e.kind} {e.name} ({format_size(e.size)}): {e.what}")
    print(f"freed {format_size(freed)} in {len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'}")


def add_command(sub) -> None:
    """Add ``cache ls`` and ``cache rm`` to ``sub``."""
    names = ", ".join(k.name for k in KINDS)
    c = sub.add_parser(
        "cache",
        help="list or remove what Strata keeps in its cache folder ($STRATA_CACHE)",
        description="List or remove what Strata keeps in its cache folder ($STRATA_CACHE, default "
        "~/.cache/strata): models, packs, tokenizers, plans, profiles, routing profiles and "
        "sha256s. Everything removed is made again when next needed.",
    )
    actions = c.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", help="list the cache's entries with their sizes and a total")
    ls.add_argument("names", nargs="*", metavar="NAME", help="only these (as for rm)")
    rm = actions.add_parser("rm", help="remove entries; say what and how many bytes were freed")
    rm.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help=f"all, a kind ({names}), an entry's name as ls shows it, or a model's name "
        "(e.g. gemma3-270m: its file, packs, tokenizer and cached plans)",
    )


COMMANDS = {"cache": cmd_cache}
