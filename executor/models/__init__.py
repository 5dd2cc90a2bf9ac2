"""Per-architecture forward passes, one file each, named after GGUF ``general.architecture``."""

from __future__ import annotations

import mlx.core as mx

from executor.models.llama import LlamaModel
from executor.weights import WeightStore
from planner.errors import StrataError
from planner.schemas import Architecture

ARCHITECTURES = {"llama": LlamaModel}


def build_model(arch: Architecture, store: WeightStore, dtype: mx.Dtype) -> LlamaModel:
    """The forward pass for ``arch.name``.

    Raises:
        StrataError: the architecture is not supported (names it and the supported ones).
    """
    cls = ARCHITECTURES.get(arch.name)
    if cls is None:
        raise StrataError(
            f"architecture {arch.name!r} is not supported by the executor yet "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return cls(arch, store, dtype)
