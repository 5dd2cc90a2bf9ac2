"""The model classes and the tensor inventory (``strata.common.tensors``) agree: every
architecture the executor runs is in the inventory, and each forward-pass switch that uses a
tensor is on exactly where the inventory gives the architecture that tensor."""

from __future__ import annotations

import pytest
from strata.common import tensors
from strata.executor.models import ARCHITECTURES, MOE_ROUTING


def test_the_executor_runs_every_architecture_of_the_inventory():
    # ... but those the inventory marks as described and planned only (ArchRule.not_executed).
    runs = {name for name, rule in tensors.ARCHITECTURES.items() if not rule.not_executed}
    assert set(ARCHITECTURES) == runs
    assert {"qwen3next", "qwen35moe"} <= set(tensors.ARCHITECTURES) - runs
    assert set(MOE_ROUTING) == {
        "llama",
        "qwen2moe",
        "qwen3moe",
        "olmoe",
        "glm4moe",
        "gpt-oss",
        "deepseek2",
    }


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_forward_pass_switches_follow_the_inventory(name):
    cls, rule = ARCHITECTURES[name], tensors.ARCHITECTURES[name]
    assert cls.qk_norm == (rule.qk_norm != "none"), name
    assert cls.qk_norm_full == (rule.qk_norm == "full"), name
    assert cls.post_norms == rule.post_norms, name
    assert cls.rope_freqs_tensor == rule.rope_freqs, name
    # Gated (qwen2moe) or ungated (ArchRule.shared_count: glm4moe, deepseek2) shared experts.
    assert cls.shared_expert == (rule.shared_expert or rule.shared_count), name
