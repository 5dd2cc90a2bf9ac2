"""Per-architecture forward passes, one file each, named after GGUF ``general.architecture``."""

from __future__ import annotations

from strata.common import tensors
from strata.common.schemas import Architecture
from strata.executor.models.gemma3 import Gemma3Model
from strata.executor.models.llama import LlamaModel, MoeRouting
from strata.executor.models.olmoe import OlmoeModel
from strata.executor.models.qwen2 import Qwen2Model
from strata.executor.models.qwen2moe import Qwen2MoeModel
from strata.executor.models.qwen3 import Qwen3Model
from strata.executor.models.qwen3moe import Qwen3MoeModel

ARCHITECTURES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,
    "qwen2": Qwen2Model,
    "qwen3": Qwen3Model,
    "gemma3": Gemma3Model,
    "qwen2moe": Qwen2MoeModel,
    "qwen3moe": Qwen3MoeModel,
    "olmoe": OlmoeModel,
}

MOE_ROUTING: dict[str, MoeRouting] = {
    name: cls.moe_routing
    for name, cls in ARCHITECTURES.items()
    if tensors.ARCHITECTURES[name].experts != "none"
}
"""The router rule of each architecture with MoE blocks, as llama.cpp fixes it in that
architecture's graph code (each model file says where): llama (Mixtral) softmax, top-k,
renormalized; qwen2moe softmax, top-k, not renormalized, plus a sigmoid-gated shared expert;
qwen3moe softmax, top-k, renormalized; olmoe softmax, top-k, not renormalized. None scales the
weights, and none honours ``expert_weights_norm``, ``expert_gating_func`` or
``expert_weights_scale`` from the GGUF (llama.cpp reads them only for other architectures)."""


def model_class(arch: Architecture) -> type[LlamaModel]:
    """The forward-pass class for ``arch.name``.

    Raises:
        StrataError: the architecture is not supported (names it and the supported ones:
            ``strata.common.tensors.arch_rule``; the inventory and this table have the same
            architectures).
    """
    tensors.arch_rule(arch)
    return ARCHITECTURES[arch.name]
