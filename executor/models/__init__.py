"""Per-architecture forward passes, one file each, named after GGUF ``general.architecture``."""

from __future__ import annotations

from executor.models.llama import LlamaModel
from planner.errors import StrataError
from planner.schemas import Architecture

ARCHITECTURES = {"llama": LlamaModel}


def model_class(arch: Architecture) -> type[LlamaModel]:
    """The forward-pass class for ``arch.name``.

    Raises:
        StrataError: the architecture is not supported (names it and the supported ones).
    """
    cls = ARCHITECTURES.get(arch.name)
    if cls is None:
        raise StrataError(
            f"architecture {arch.name!r} is not supported by the executor yet "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return cls
