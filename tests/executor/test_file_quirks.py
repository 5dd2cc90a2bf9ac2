"""Files as llama.cpp reads them (issue 37): trailing one-element tensor dimensions and per-layer
hyperparameter arrays, on tiny synthetic GGUFs (``gguf_factory.QUIRK_MODELS``).

- A tensor stored with a trailing one-element dimension (qwen2moe's shared-expert gate as the
  converter writes it, GGUF ``[d, 1]`` where llama.cpp creates ``[d]``; a qwen3 norm ``[d, 1]``)
  and ``head_count``/``head_count_kv``/``feed_forward_length`` written as one equal value per
  block are read as the plain model. Two oracles: llama.cpp's outputs on each quirk file
  itself (tests/fixtures/data/llamacpp_quirks.json, ``make_arch_references.py --quirks``, which
  also checked that they equal its outputs on the plain file), and its outputs on the plain
  model (tests/fixtures/data/llamacpp_arch.json, llamacpp_moe.json), the quirk file holding the
  plain file's very tensor bytes (checked here). The correctness rule at the synthetic threshold:
  gap 1.0, top-10 logits within 1.0.
- Per-layer values that differ are refused with one line naming the key and each block's value
  (llama.cpp refuses that file too, "check_tensor_dims: tensor 'blk.1.attn_k.weight' has wrong
  shape": ``make_arch_references.py --quirks`` checks it); an array of
  another length than ``block_count`` is refused as llama.cpp refuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
from conftest import DATA
from gguf_factory import KV_PER_LAYER_MODEL, QUIRK_MODELS, write_arch_model
from reference_check import (
    assert_correctness_rule,
    references_by_model,
    regenerated_models,
    resident_engine,
)
from strata.common.describe import describe
from strata.common.errors import GGUFError, StrataError
from strata.common.gguf_file import open_gguf
from strata.common.tensors import same_up_to_trailing_ones
from strata.executor.engine import check_tensors
from strata.executor.models import model_class

GAP = 1.0
"""llama.cpp's top-2 gap from which our argmax must match (the synthetic threshold)."""
TOL = 1.0
"""Largest allowed |ours - llama.cpp| over its top-10 logits after the prompt."""
CONTEXT = 512
NAMES = list(QUIRK_MODELS)
PLAIN_REFERENCES = (DATA / "llamacpp_arch.json", DATA / "llamacpp_moe.json")
QUIRK_REFERENCES = DATA / "llamacpp_quirks.json"


@pytest.fixture(scope="session")
def plain_references() -> dict[str, list[dict]]:
    """llama.cpp's outputs on each quirk model's plain model, by plain name."""
    out: dict[str, list[dict]] = {}
    for path in PLAIN_REFERENCES:
        out.update(references_by_model(path))
    return out


@pytest.fixture(scope="session")
def quirk_ggufs(tmp_path_factory, smollm2_gguf, plain_references) -> dict[str, tuple[Path, Path]]:
    """Each quirk model and its plain model (regenerated and checked to be the file llama.cpp's
    references are of), the quirk file holding the plain file's tensor bytes."""
    folder = tmp_path_factory.mktemp("quirk-models")
    plain = regenerated_models(
        sorted({base for base, _ in QUIRK_MODELS.values()}),
        plain_references,
        folder,
        smollm2_gguf,
        "tests/fixtures/make_arch_references.py [--moe] --llama-python PYTHON",
    )
    out = {}
    for name, (base, _) in QUIRK_MODELS.items():
        out[name] = (write_arch_model(folder / f"{name}.gguf", name, smollm2_gguf), plain[base])
        got, want = open_gguf(out[name][0]), open_gguf(plain[base])
        assert [t.name for t in got.tensor_infos] == [t.name for t in want.tensor_infos]
        for a, b in zip(got.tensor_infos, want.tensor_infos, strict=True):
            assert bytes(got.tensor_bytes(a)) == bytes(want.tensor_bytes(b)), (name, a.name)
    return out


@pytest.fixture(scope="module", params=NAMES)
def quirk(request, quirk_ggufs, tmp_path_factory):
    """(name, all-resident plan path, engine) of one quirk model."""
    yield from resident_engine(
        request.param, quirk_ggufs[request.param][0], tmp_path_factory, CONTEXT
    )


def test_correctness_rule_against_llamacpp_on_the_plain_file(
    quirk, plain_references, record_property
):
    """The quirk file meets the rule against llama.cpp's outputs on the plain file (the same
    tensor bytes)."""
    name, _, engine = quirk
    refs = plain_references[QUIRK_MODELS[name][0]]
    assert_correctness_rule(name, engine, refs, GAP, TOL, record_property)


def test_correctness_rule_against_llamacpp_on_the_quirk_file(quirk, quirk_ggufs, record_property):
    """The rule against llama.cpp's outputs on the quirk file itself (llamacpp_quirks.json,
    made on the file regenerated here: same sha256)."""
    name, _, engine = quirk
    refs = references_by_model(QUIRK_REFERENCES)[name]
    got = hashlib.sha256(quirk_ggufs[name][0].read_bytes()).hexdigest()
    assert {r["model_sha256"] for r in refs} == {got}, (
        f"{name}: the factory writes other bytes now; re-make the references: "
        "tests/fixtures/make_arch_references.py --quirks --llama-python PYTHON"
    )
    assert_correctness_rule(name, engine, refs, GAP, TOL, record_property)


@pytest.mark.parametrize(
    ("have", "want", "same"),
    [
        ([64, 1], [64], True),
        ([64], [64, 1], True),
        ([64, 1, 1], [64], True),
        ([64, 32, 1], [64, 32], True),
        ([64, 2], [64], False),
        ([1, 64], [64], False),
        ([64, 32], [64, 32, 8], False),
    ],
)
def test_same_up_to_trailing_ones(have, want, same):
    """llama.cpp's check_tensor_dims: the four ne compared, unused ones being 1."""
    assert same_up_to_trailing_ones(have, want) is same


def test_descriptions_read_the_quirk_files_as_their_plain_models(quirk_ggufs):
    """The [d, 1] tensors are described as [d] (what the forward pass takes), the arrays as one
    value: description and plan inputs equal the plain model's."""
    for name, (_, variant) in QUIRK_MODELS.items():
        quirk_path, plain_path = quirk_ggufs[name]
        file_shapes = {t.name: list(t.shape) for t in open_gguf(quirk_path).tensor_infos}
        for key in variant.trailing_one:  # the file does have the trailing dimension
            assert any(
                s[-1] == 1 and len(s) == 2 for n, s in file_shapes.items() if n.endswith(key)
            ), (name, key)
        got, want = describe(str(quirk_path))[0], describe(str(plain_path))[0]
        assert got.architecture == want.architecture, name
        assert [(t.name, t.shape) for t in got.tensors] == [
            (t.name, t.shape) for t in want.tensors
        ], name
        assert got.kv_bytes_per_token == want.kv_bytes_per_token, name


def test_check_tensors_takes_trailing_ones_and_refuses_other_shapes(quirk_ggufs):
    desc = describe(str(quirk_ggufs["qwen3-norm-2d"][0]))[0]
    expected = model_class(desc.architecture).expected_shapes(desc.architecture)

    def with_shape(name: str, shape: list[int]):
        tensors = [
            t.model_copy(update={"shape": shape}) if t.name == name else t for t in desc.tensors
        ]
        return desc.model_copy(update={"tensors": tensors})

    check_tensors(with_shape("blk.1.ffn_norm.weight", [64, 1]), expected)
    check_tensors(with_shape("blk.1.attn_q_norm.weight", [32, 1, 1]), expected)
    with pytest.raises(StrataError, match=r"blk.1.ffn_norm.weight has shape \[64, 2\]"):
        check_tensors(with_shape("blk.1.ffn_norm.weight", [64, 2]), expected)


def test_differing_per_layer_kv_heads_refused_naming_key_and_blocks(smollm2_gguf, tmp_path):
    """llama.cpp sizes every llama block's K and V from block 0's head_count_kv and refuses this
    file at block 1; Strata refuses it before any tensor, naming the key and the values."""
    path = write_arch_model(tmp_path / "kv.gguf", "kv", smollm2_gguf, model=KV_PER_LAYER_MODEL)
    with pytest.raises(GGUFError) as e:
        describe(str(path))
    msg = str(e.value)
    assert "'llama.attention.head_count_kv' has different values per block" in msg
    assert "block 0: 2, block 1: 1, block 2: 2" in msg and "\n" not in msg


def test_per_layer_array_of_another_length_refused(smollm2_gguf, tmp_path):
    """An array of 4 values for 3 blocks (llama.cpp: "wrong array length")."""
    model = dataclasses.replace(KV_PER_LAYER_MODEL, kv_heads_per_layer=(2, 2, 2, 2))
    path = write_arch_model(tmp_path / "kv4.gguf", "kv4", smollm2_gguf, model=model)
    with pytest.raises(GGUFError, match=r"is an array of 4 values but the model has 3 blocks"):
        describe(str(path))
