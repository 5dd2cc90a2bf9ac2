"""A split GGUF (llama.cpp's gguf-split shards) runs from its first shard as the whole file does.

The real SmolLM2 split into three shards (``tests/fixtures/gguf_split.py``) is planned from its
first shard, resident and with every FFN streamed from NVMe (the packed store built from the
shards' bytes), and gives the whole file's logits and greedy ids on the reference prompts; a
set missing a shard is refused when the plan is loaded, before any weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import make_plan_file
from gguf_split import split_gguf
from strata.common.errors import GGUFError
from strata.common.schemas import Plan
from strata.common.yamlio import read_yaml
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

TOKENS = 8
"""Greedy tokens per reference case (a streamed plan reads its FFNs for every token)."""


@pytest.fixture(scope="module")
def shards(smollm2_gguf, tmp_path_factory) -> list[Path]:
    """SmolLM2 split into three shards."""
    return split_gguf(smollm2_gguf, tmp_path_factory.mktemp("split"), 3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resident", "ffn-nvme"])
def test_first_shard_runs_as_the_whole_file(
    shards, budget_plans, smollm2_engine, smollm2_serving, reference_cases, tmp_path, name
):
    """Planned from the first shard with the request of the whole file's ``budget_plans[name]``:
    the same placement, bit-identical logits and the same greedy ids as the whole file."""
    whole = read_yaml(budget_plans[name], Plan)
    request = whole.request.model_dump(exclude_defaults=True)
    plan = make_plan_file(str(shards[0]), tmp_path / f"{name}.yaml", **request)
    loaded = load_plan(plan)
    assert loaded.gguf.paths == shards
    assert loaded.plan.tier_of() == whole.tier_of()
    streamed = {u for u, t in whole.tier_of().items() if t == "nvme"}
    assert streamed == (
        {u for u in streamed if u.endswith(".ffn")} if name != "resident" else set()
    )
    assert len(streamed) == (30 if name == "ffn-nvme" else 0)
    serving = ServingEngine(Engine(loaded))
    serving.start()
    try:
        for ref in (r for r in reference_cases if r["model_file"].startswith("SmolLM2")):
            prompt = ref["prompt_ids"]
            ids = prompt + ref["greedy_ids"][:TOKENS]
            got = serving.engine.logits_for(ids)
            assert np.array_equal(got, smollm2_engine.logits_for(ids)), ref["case"]
            a = generate(serving, prompt, SamplingParams(), TOKENS)
            b = generate(smollm2_serving, prompt, SamplingParams(), TOKENS)
            assert a.output_ids == b.output_ids, ref["case"]
            assert (a.stats["bytes_read"]["nvme"] > 0) == bool(streamed), ref["case"]
    finally:
        serving.close()


def test_missing_shard_fails_before_loading(shards, tmp_path):
    """A plan of the set whose second shard is gone fails on loading, naming the shard."""
    folder = tmp_path / "set"
    folder.mkdir()
    for s in shards:
        os.link(s, folder / s.name)  # a hard link: the plan keeps its path
    plan = make_plan_file(str(folder / shards[0].name), tmp_path / "p.yaml", context=256)
    os.remove(folder / shards[1].name)
    with pytest.raises(GGUFError, match="shard 2 of the 3-file split model") as e:
        load_plan(plan)
    assert str(e.value).startswith(f"{folder / shards[1].name}: no such file")
