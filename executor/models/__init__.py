"""Per-architecture forward passes, one file each, named after GGUF ``general.architecture``."""

from __future__ import annotations

from strata.common import tensors
from strata.common.schemas import Architecture
from strata.executor.models.deepseek2 import Deepseek2Model
from strata.executor.models.gemma3 import Gemma3Model
from strata.executor.models.glm4moe import Glm4MoeModel
from strata.executor.models.gpt_oss import GptOssModel
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
    "deepseek2": Deepseek2Model,
    "qwen2moe": Qwen2MoeModel,
    "qwen3moe": Qwen3MoeModel,
    "olmoe": OlmoeModel,
    "glm4moe": Glm4MoeModel,
    "gpt-oss": GptOssModel,
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
``expert_weights_scale`` from the GGUF (llama.cpp reads them only for other architectures).
glm4moe: sigmoid with the selection bias, not renormalized, unscaled by default, and all three
keys read from the GGUF (``MoeRouting.gguf_keys``). gpt-oss: top-k by logit (plus the router's
bias), then a softmax over the k chosen (llama.cpp's SOFTMAX_WEIGHT), no key read."""


def model_class(arch: Architecture) -> type[LlamaModel]:
    """The forward-pass class for ``arch.name``.

    Raises:
        StrataError: the architecture is not supported (names it and the supported ones), or
            is one Strata describes and plans but does not run yet (qwen3next, qwen35moe:
            ``strata.common.tensors.executor_rule``; this table has every other architecture of
            the inventory).
    """
    tensors.executor_rule(arch)
    return ARCHITECTURES[arch.name]
