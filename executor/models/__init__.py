"""Per-architecture forward passes, one file each, named after GGUF ``general.architecture``."""

from __future__ import annotations

from executor.models.gemma3 import Gemma3Model
from executor.models.llama import LlamaModel
from executor.models.qwen2 import Qwen2Model
from executor.models.qwen3 import Qwen3Model
from planner.errors import StrataError
from planner.schemas import Architecture

ARCHITECTURES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,
    "qwen2": Qwen2Model,
    "qwen3": Qwen3Model,
    "gemma3": Gemma3Model,
}


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
