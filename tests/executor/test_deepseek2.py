"""Architecture ``deepseek2`` (multi-head latent attention, leading dense blocks, shared experts,
softmax or biased sigmoid routing, grouped top-k, YaRN and linear RoPE scaling) on tiny
synthetic GGUFs (``gguf_deepseek2.DEEPSEEK2_MODELS``: width 64, 3 blocks, 4 heads,
kv_lora_rank 32, 16 RoPE dims; with and without q_lora, the split ``attn_k_b``/``attn_v_b`` and
the legacy ``attn_kv_b`` layouts, float and Q8_0; 8 experts top-2 with one shared expert;
SmolLM2's tokenizer).

- The correctness rule (tests/fixtures/reference_check.py) against llama.cpp's outputs stored in
  tests/fixtures/data/llamacpp_deepseek2.json (``make_deepseek2_references.py``; CI has no
  llama.cpp), at the synthetic threshold: argmax where llama.cpp's top-2 gap >= 1.0, top-10 logits
  after the prompt within 1.0; free-running greedy decode through the serving engine; chunked
  prefill equal to one pass.
- The KV cache holds one row of kv_lora_rank + rope elements per token and block (the latent and
  the RoPE'd key part, the values a slice of it), and the description counts exactly that.
- The absorbed attention equals the decompressed one (per-head K and V from the latent), in plain
  numpy, on one block.
- With experts streamed from NVMe (through the expert cache) and with everything on NVMe, the
  logits and greedy tokens are bit-identical to the all-resident run.
- Prefix-cache hits (whole and partial blocks) and speculative decoding's rollback on the latent
  cache keep the greedy tokens; ``attention.temperature_scale`` is refused.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import DATA, make_plan_file
from gguf_deepseek2 import DEEPSEEK2_MODELS, write_deepseek2_model
from plan_edits import experts_moved
from reference_check import (
    assert_chunked_prefill,
    assert_correctness_rule,
    assert_prompt_ids,
    assert_references_cover,
    greedy_divergence,
    references_by_model,
    regenerated_models,
    resident_engine,
    started_serving,
)
from strata.common.describe import describe
from strata.common.schemas import Plan
from strata.common.yamlio import read_yaml
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.models.deepseek2 import Deepseek2Model
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

GAP = 1.0
"""llama.cpp's top-2 gap from which our argmax must match (the synthetic threshold)."""
TOL = 1.0
"""Largest allowed |ours - llama.cpp| over its top-10 logits after the prompt."""
CONTEXT = 512
REFERENCES = DATA / "llamacpp_deepseek2.json"
NAMES = list(DEEPSEEK2_MODELS)
MOE_NAMES = [n for n, m in DEEPSEEK2_MODELS.items() if m.experts]
REMAKE = "tests/fixtures/make_deepseek2_references.py --llama-python PYTHON"


@pytest.fixture(scope="session")
def ds2_references() -> dict[str, list[dict]]:
    """llama.cpp's outputs per synthetic deepseek2 model."""
    return references_by_model(REFERENCES)


@pytest.fixture(scope="session")
def ds2_ggufs(tmp_path_factory, smollm2_gguf, ds2_references) -> dict[str, Path]:
    """Each synthetic model, regenerated, checked to be the file the references are of."""
    folder = tmp_path_factory.mktemp("deepseek2-models")
    return regenerated_models(
        NAMES, ds2_references, folder, smollm2_gguf, REMAKE, write=write_deepseek2_model
    )


@pytest.fixture(scope="module", params=NAMES)
def ds2(request, ds2_ggufs, tmp_path_factory):
    """(name, all-resident plan path, engine) of one synthetic deepseek2 model."""
    yield from resident_engine(request.param, ds2_ggufs[request.param], tmp_path_factory, CONTEXT)


@pytest.fixture(scope="module")
def ds2_serving(ds2):
    """The serving engine over ``ds2``'s engine (``strata run``'s), started."""
    yield from started_serving(ds2[2])


# --------------------------------------------------------------------------- against llama.cpp


def test_references_cover_every_model_and_case(ds2_references):
    assert_references_cover(ds2_references, NAMES)


def test_prompt_ids_exact(ds2, ds2_references):
    name, _, engine = ds2
    assert_prompt_ids(name, engine, ds2_references[name])


def test_correctness_rule_against_llamacpp(ds2, ds2_references, record_property):
    """Teacher-forced argmax where llama.cpp's gap >= 1.0; top-10 logits after the prompt within
    1.0."""
    name, _, engine = ds2
    assert isinstance(engine.model, Deepseek2Model)
    assert_correctness_rule(name, engine, ds2_references[name], GAP, TOL, record_property)


def test_greedy_decode_follows_llamacpp_until_a_near_tie(ds2, ds2_serving, ds2_references):
    """Free-running greedy decode (the serving engine's paged cache, one token at a time)."""
    name = ds2[0]
    for ref in ds2_references[name]:
        assert greedy_divergence(ds2_serving, ref, GAP) is None, name


def test_chunked_prefill_matches_one_pass(ds2, ds2_references):
    name, _, engine = ds2
    assert_chunked_prefill(engine, ds2_references[name][-1])


# --------------------------------------------------------------------------- the latent cache


def test_kv_cache_holds_the_latent_and_rope_part_per_token(ds2):
    """One row of kv_lora_rank + rope elements per token and block, values a slice of it (no
    value pool); the description's kv_elements_per_token counts exactly those."""
    name, plan, engine = ds2
    m = DEEPSEEK2_MODELS[name]
    row = m.kv_lora_rank + m.rope_dims
    kv = engine.model.make_paged_cache(4, 16)
    assert kv.values == [] and kv.value_dim == m.kv_lora_rank
    assert [k.shape for k in kv.keys] == [(64, 1, row)] * m.layers
    cache = engine.model.make_cache(40)
    assert cache.kv.values == [] and cache.kv.keys[0].shape[1:] == (1, row)
    desc = load_plan(plan).desc
    assert desc.kv_elements_per_token == m.layers * row
    stored = sum(k.size for k in kv.keys) // kv.num_slots
    assert stored == desc.kv_elements_per_token
    # What a per-head K/V cache would hold: heads * (nope + rope + v) per block.
    expanded = m.layers * m.heads * (m.nope_dims + m.rope_dims + m.v_dims)
    assert desc.kv_elements_per_token < expanded


def test_absorbed_attention_equals_the_decompressed_one(ds2_ggufs):
    """One block's latent attention (``Deepseek2Model.attention``, over the paged cache) against
    numpy's statement of the decompressed form (llama.cpp's non-MLA path: per-head
    k = [latent @ k_b^T, k_pe], v = latent @ v_b^T, softmax(q k^T / sqrt(nope + rope)) v)."""
    from strata.executor.paged_kv import ForwardBatch

    path = ds2_ggufs["ds2-dense-qlora"]
    m = DEEPSEEK2_MODELS["ds2-dense-qlora"]
    plan = make_plan_file(str(path), path.with_suffix(".yaml"), context=64)
    engine = Engine(load_plan(plan))
    try:
        model = engine.model
        t, d, h = 7, m.width, m.heads
        nope, rope, v, rank = m.nope_dims, m.rope_dims, m.v_dims, m.kv_lora_rank
        x = mx.array(np.random.default_rng(1).normal(size=(1, t, d)).astype(np.float32))
        cache = model.make_cache(16)
        batch = ForwardBatch.build([cache.next_input(list(range(t)), "all")])
        w = model.store.unit("blk.0.attn")
        got = np.array(model.attention(w, 0, x, batch, cache.kv) - x)[0]
        wn = {k.removeprefix("blk.0."): np.array(a) for k, a in w.items()}

        def rms(a, weight):
            return a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * weight

        def rotate(a, pos):  # adjacent pairs (NORM RoPE), base 10000, every row at its position
            inv = 10000.0 ** (-np.arange(0, rope, 2) / rope)
            ang = pos[:, None] * inv[None, :]
            shape = (len(pos),) + (1,) * (a.ndim - 2) + (rope // 2,)
            cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
            a0, a1 = a[..., 0::2], a[..., 1::2]
            out = np.empty_like(a)
            out[..., 0::2], out[..., 1::2] = a0 * cos - a1 * sin, a0 * sin + a1 * cos
            return out

        xn = rms(np.array(x)[0], wn["attn_norm.weight"])
        q = rms(xn @ wn["attn_q_a.weight"].T, wn["attn_q_a_norm.weight"])
        q = (q @ wn["attn_q_b.weight"].T).reshape(t, h, nope + rope)
        kv_a = xn @ wn["attn_kv_a_mqa.weight"].T
        latent = rms(kv_a[:, :rank], wn["attn_kv_a_norm.weight"])
        pos = np.arange(t, dtype=np.float64)
        k_pe = rotate(kv_a[:, rank:], pos)  # [t, rope], one for all heads
        q_pe = rotate(q[..., nope:], pos)
        k_nope = np.einsum("tr,hnr->thn", latent, wn["attn_k_b.weight"].transpose(0, 2, 1))
        values = np.einsum("tr,hvr->thv", latent, wn["attn_v_b.weight"])
        keys = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None], (t, h, rope))], -1)
        queries = np.concatenate([q[..., :nope], q_pe], -1)
        scores = np.einsum("qhd,khd->hqk", queries, keys) / math.sqrt(nope + rope)
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        heads_out = np.einsum("hqk,khv->qhv", probs, values).reshape(t, h * v)
        want = heads_out @ wn["attn_output.weight"].T
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    finally:
        engine.close()


# --------------------------------------------------------------------------- tiers


PROMPT = [1, 17, 400, 2048, 77, 9001, 31, 5, 600, 12000, 42, 7, 88, 1234, 3, 999]
DECODE = 10


def _run(plan: Path, mode: str | None = None):
    serving = ServingEngine(Engine(load_plan(plan), expert_cache_mode=mode))
    serving.start()
    try:
        logits = serving.engine.logits_for(PROMPT)
        gen = generate(serving, PROMPT, SamplingParams(), DECODE, stop_at_eog=False)
        return logits, gen
    finally:
        serving.close()


@pytest.mark.parametrize("name", [*MOE_NAMES, "ds2-dense-q8kb", "ds2-dense-kvb-q8"])
def test_tiers_are_bit_identical(name, ds2_ggufs, tmp_path, monkeypatch):
    """All resident; everything on NVMe (the pack: ``ds2-dense-q8kb``'s three-dimensional
    quantized ``attn_k_b``/``attn_v_b`` too, ``ds2-dense-kvb-q8``'s quantized legacy
    ``attn_kv_b``, used as views of its packed rows); for the MoE models, experts on NVMe
    through a 3-slot cache (fewer than a prompt's experts: a block loads in several groups) and
    a 12-slot prefetching one."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    gguf = ds2_ggufs[name]
    moe = bool(DEEPSEEK2_MODELS[name].experts)
    resident = make_plan_file(str(gguf), tmp_path / "resident.yaml", context=64)
    want_logits, want = _run(resident)
    nvme = make_plan_file(str(gguf), tmp_path / "nvme.yaml", context=64, tiers=["nvme"])
    assert {p.tier for p in read_yaml(nvme, Plan).placement} == {"nvme"}
    runs = {"all-nvme": (nvme, None)}
    if moe:
        assert want.stats["experts"]["uses_gpu"] > 0
        e3 = experts_moved(resident, tmp_path / "e3.yaml", "nvme", slots=3, prefetch=2)
        e12 = experts_moved(resident, tmp_path / "e12.yaml", "nvme", slots=12, prefetch=2)
        runs["experts-3-cache"] = (e3, "cache")
        runs["experts-12-prefetch"] = (e12, "prefetch")
    for label, (path, mode) in runs.items():
        logits, gen = _run(path, mode)
        assert np.array_equal(logits, want_logits), label
        assert gen.output_ids == want.output_ids, label
        if moe:
            ex = gen.stats["experts"]
            assert ex["hits"] + ex["misses"] > 0 and ex["uses_gpu"] == 0, label


def test_prefix_cache_hits_and_speculation_keep_the_tokens(ds2_ggufs, tmp_path):
    """On the latent cache: a request whose prompt begins like a cached one (a whole block
    served by the prefix cache, then a partial block whose lent slots ``copy_slots`` copies into
    the sequence's own block), and speculative decoding with the self-drafter (its first two
    blocks writing draft rows into the latent cache, the rejected ones rolled back), give the
    greedy tokens of the same request run with nothing cached and no drafts."""
    from strata.executor.self_drafter import SelfDrafter, streamed_units

    path = ds2_ggufs["ds2-moe-v3"]
    plan = make_plan_file(str(path), tmp_path / "p.yaml", context=128)
    base = PROMPT * 2 + [5, 6, 7, 8]  # 36 tokens
    other = base[:24] + [321, 654, 987]  # block 0 whole, block 1's first 8 tokens shared
    serving = ServingEngine(Engine(load_plan(plan)), speculative=False)
    serving.start()
    try:
        fresh = {}
        for label, ids in (("other", other), ("base", base)):
            serving.reset_prefix_cache()
            g = generate(serving, ids, SamplingParams(), DECODE, stop_at_eog=False)
            assert g.stats["cached_tokens"] == 0
            fresh[label] = g.output_ids
        serving.reset_prefix_cache()
        generate(serving, other, SamplingParams(), DECODE, stop_at_eog=False)
        hit = generate(serving, base, SamplingParams(), DECODE, stop_at_eog=False)
        assert hit.stats["cached_tokens"] == 24  # 16 from a whole block, 8 lent and copied
        assert hit.output_ids == fresh["base"]
        again = generate(serving, other, SamplingParams(), DECODE, stop_at_eog=False)
        assert again.stats["cached_tokens"] >= 16 and again.output_ids == fresh["other"]
    finally:
        serving.close()
    engine, holder = Engine(load_plan(plan)), []
    drafter = SelfDrafter(
        engine.model, lambda: holder[0].kv, 2, streamed_units(engine.model.store, 2)
    )
    spec = ServingEngine(engine, drafter, 3, speculative=False)
    holder.append(spec)
    spec.start()
    try:
        for label, ids in (("base", base), ("other", other)):
            spec.reset_prefix_cache()
            g = generate(spec, ids, SamplingParams(), DECODE, stop_at_eog=False)
            assert g.output_ids == fresh[label], label
        stats = spec.spec_stats()
        assert 0 < stats["proposed"] and stats["accepted"] < stats["proposed"]  # some rolled back
    finally:
        spec.close()


def test_describe_reads_the_mla_widths(ds2_ggufs):
    desc, _ = describe(str(ds2_ggufs["ds2-dense-kvb"]))
    a = desc.architecture
    assert (a.kv_lora_rank, a.q_lora_rank, a.key_length_mla, a.value_length_mla) == (32, 0, 40, 16)
    assert a.mla_legacy_kv_b
    desc, _ = describe(str(ds2_ggufs["ds2-moe-v3"]))
    a = desc.architecture
    assert (a.kv_lora_rank, a.q_lora_rank, a.key_length_mla, a.value_length_mla) == (32, 48, 32, 16)
    assert not a.mla_legacy_kv_b and a.head_dim == 48 and a.head_count_kv == 1
    assert (a.leading_dense_block_count, a.expert_shared_count) == (1, 1)
    assert (a.expert_group_count, a.expert_group_used_count) == (4, 2)
    a = describe(str(ds2_ggufs["ds2-dense-yarn"]))[0].architecture
    assert (a.rope_scaling_type, a.rope_freq_scale, a.rope_yarn_log_mul) == ("yarn", 0.25, 1.0)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("attention.key_length", 40, r"must be kv_lora_rank \+ rope.dimension_count = 48"),
        ("attention.key_length_mla", 16, "leaves no dimension without RoPE"),
    ],
)
def test_inconsistent_mla_widths_are_refused(ds2_ggufs, tmp_path, key, value, says):
    """A file whose latent widths contradict each other is refused in one line naming the key
    (llama.cpp asserts on it, or sizes its cache wrong)."""
    from gguf_bytes import VT, read_parts, write_parts
    from strata.common.errors import GGUFError

    parts = read_parts(ds2_ggufs["ds2-dense-qlora"]).set(f"deepseek2.{key}", VT.UINT32, value)
    path = write_parts(tmp_path / "bad.gguf", parts)
    with pytest.raises(GGUFError, match=says) as e:
        describe(str(path))
    assert "\n" not in str(e.value) and "re-convert" in str(e.value)


def test_attention_temperature_scale_is_refused(ds2_ggufs, tmp_path):
    """Mistral-Large-3's ``attention.temperature_scale``: llama.cpp scales each query by a
    factor of its position (its logits move by tens on the synthetic model), which Strata does
    not: refused in one line when the file is described, rather than run with other logits."""
    from gguf_bytes import VT, read_parts, write_parts
    from strata.common.errors import GGUFError

    parts = read_parts(ds2_ggufs["ds2-dense"])
    parts = parts.set("deepseek2.attention.temperature_scale", VT.FLOAT32, 0.5)
    parts = parts.set("deepseek2.attention.temperature_length", VT.UINT32, 8)
    path = write_parts(tmp_path / "temp.gguf", parts)
    with pytest.raises(GGUFError, match="attention.temperature_scale is 0.5") as e:
        describe(str(path))
    assert "\n" not in str(e.value)


def test_latent_cache_gathers_and_copies_values_as_part_of_the_keys():
    """``PagedKVCache(value_dim=...)``: no value pool; ``gather`` gives the keys and their first
    ``value_dim`` elements; ``copy_slots`` (prefix caching) copies the rows, values with them."""
    from strata.executor.paged_kv import PagedKVCache

    kv = PagedKVCache(2, 1, 6, 2, 4, mx.float32, value_dim=4)
    assert kv.values == [] and kv.value_width == 4
    rows = mx.arange(2 * 3 * 6, dtype=mx.float32).reshape(2, 3, 1, 6)
    for layer in range(2):
        kv.write(layer, mx.array([0, 1, 2]), rows[layer], None)
    kv.copy_slots(mx.array([0, 1]), mx.array([5, 6]))
    for layer in range(2):
        k, v = kv.gather(layer, mx.array([[5, 6, 2]]))
        want = np.array(rows[layer])[[0, 1, 2]].transpose(1, 0, 2)[None]  # [1, 1, 3, 6]
        assert np.array_equal(np.array(k), want)
        assert np.array_equal(np.array(v), want[..., :4])


def test_batched_prefill_and_decode_equal_each_sequence_alone(ds2_ggufs, ds2_references):
    """Two sequences of different lengths in one pass (two prefill chunks, then the decode group
    with its padding mask over the latent cache) give each sequence's logits alone."""
    from strata.executor.paged_kv import ForwardBatch, SeqInput, slot_table
    from strata.executor.runner import forward

    name = "ds2-moe-v3"
    path = ds2_ggufs[name]
    engine = Engine(load_plan(make_plan_file(str(path), path.with_suffix(".b.yaml"), context=64)))
    try:
        ref = ds2_references[name][0]
        ids = ref["prompt_ids"] + ref["greedy_ids"]
        a, b, ta, tb = ids[:9], ids[:4], ids[9], 77
        kv = engine.model.make_paged_cache(6, 16)
        slots_a, slots_b = slot_table([4, 0], 16, 10), slot_table([2], 16, 5)
        pre = ForwardBatch.build([SeqInput(a, 0, slots_a, "last"), SeqInput(b, 0, slots_b, "last")])
        first = np.array(forward(engine.model, pre, kv))
        dec = ForwardBatch.build([SeqInput([ta], 9, slots_a), SeqInput([tb], 4, slots_b)])
        assert dec.decode_rows == 2 and dec.decode_mask(0) is not None
        second = np.array(forward(engine.model, dec, kv))
        alone_a, alone_b = engine.logits_for(a + [ta]), engine.logits_for(b + [tb])
        np.testing.assert_allclose(first[0], alone_a[-2], atol=1e-4)
        np.testing.assert_allclose(first[1], alone_b[-2], atol=1e-4)
        np.testing.assert_allclose(second[0], alone_a[-1], atol=1e-4)
        np.testing.assert_allclose(second[1], alone_b[-1], atol=1e-4)
    finally:
        engine.close()


def test_glm47_flash_files_without_a_gating_key_route_by_sigmoid(ds2_ggufs):
    """llama.cpp's default router for deepseek2 files without ``expert_gating_func`` is softmax,
    except for GLM-4.7-Flash's (47 or 48 blocks, 154,880 tokens), whose is sigmoid."""
    from strata.executor.config import RuntimeConfig
    from strata.executor.models.deepseek2 import GLM47_FLASH_VOCAB

    base = describe(str(ds2_ggufs["ds2-moe-softmax"]))[0].architecture
    plain = base.model_copy(update={"expert_gating_func": None})
    glm = plain.model_copy(update={"block_count": 47, "vocab_size": GLM47_FLASH_VOCAB})
    keyed = glm.model_copy(update={"expert_gating_func": "softmax"})
    gating = {
        label: Deepseek2Model(a, None, mx.float32, RuntimeConfig.build()).routing.gating
        for label, a in (("plain", plain), ("glm", glm), ("keyed", keyed))
    }
    assert gating == {"plain": "softmax", "glm": "sigmoid", "keyed": "softmax"}
