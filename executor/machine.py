"""This machine as a plan needs it, found in milliseconds (no benchmark): the MLX backend and the
bytes of the device working set and of host RAM, with the rules ``strata profile`` uses
(``executor.profile``); and the last profile measured on this host, kept in the cache by
``strata profile`` so that a plan's bandwidths can be compared with this machine's.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import psutil
from strata.common.catalog import cache_dir
from strata.common.errors import SchemaError
from strata.common.schemas import HardwareProfile
from strata.common.yamlio import read_yaml, write_yaml
from strata.executor.profile import detect_backend, device_info, os_reserve_bytes, working_set


@dataclass(frozen=True)
class MachineNow:
    """The running machine's backend and capacities (bytes)."""

    backend: str
    """MLX backend: ``cpu``, ``metal`` or ``cuda``."""
    gpu_bytes: int
    """The device working set (``strata profile``'s ``gpu.working_set_bytes`` rule)."""
    ram_bytes: int
    """Host RAM less the OS reserve (``os_reserve_bytes``)."""
    unified: bool
    """GPU and CPU share one memory (every backend but CUDA)."""


def machine_now() -> MachineNow:
    """The running machine's backend and capacities, as ``strata profile`` measures them."""
    backend = detect_backend()
    total = int(psutil.virtual_memory().total)
    reserve = os_reserve_bytes(total)
    gpu = int(working_set(backend, total, reserve, device_info(backend)).value)
    return MachineNow(backend, gpu, max(0, total - reserve), backend != "cuda")


def host_profile_name() -> str:
    """The name a profile of this host gets by default: the host name's first label, lowercase
    (``this-machine`` where there is none)."""
    return socket.gethostname().split(".")[0].lower() or "this-machine"


def kept_profile_path() -> Path:
    """Where this host's kept profile is: ``<cache>/machine/<host name>.yaml``."""
    return cache_dir() / "machine" / f"{socket.gethostname()}.yaml"


def keep_profile(profile: HardwareProfile) -> None:
    """Keep ``profile`` in the cache as this host's latest measurement (``last_profile``)."""
    write_yaml(profile, kept_profile_path())


def last_profile() -> HardwareProfile | None:
    """The profile ``strata profile`` last measured on this host (by host name), or None."""
    p = kept_profile_path()
    if not p.is_file():
        return None
    try:
        return read_yaml(p, HardwareProfile)
    except SchemaError:  # an unreadable cache entry (an older format) is ignored, never trusted
        return None
