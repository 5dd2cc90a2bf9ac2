"""``yamlio.read_yaml`` bounds what it parses (issue 35): no YAML aliases (an alias bomb of a few
hundred bytes would expand to 10^10 values), at most ``MAX_DEPTH`` levels of nesting (5,000 was a
``RecursionError``), at most ``MAX_DOCUMENT_BYTES``; each a one-line ``SchemaError`` naming the
line, refused in milliseconds."""

from __future__ import annotations

import time

import pytest
from conftest import ROOT
from strata.common import yamlio
from strata.common.errors import SchemaError
from strata.common.schemas import HardwareProfile, Plan


def _refused(path, model, match) -> None:
    t0 = time.process_time()
    with pytest.raises(SchemaError, match=match) as e:
        yamlio.read_yaml(path, model)
    assert "\n" not in str(e.value)
    assert time.process_time() - t0 < 1.0


def test_alias_bomb_and_deep_nesting_are_refused(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    bomb.write_text("\n".join(lines) + "\n")
    _refused(bomb, Plan, r"bomb.yaml: YAML aliases \(\*a0\) are not allowed \(line 2\)")
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    _refused(deep, HardwareProfile, f"nested more than {yamlio.MAX_DEPTH} levels deep")


def test_an_oversized_document_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(yamlio, "MAX_DOCUMENT_BYTES", 1000)
    big = tmp_path / "big.yaml"
    big.write_text("x: " + "y" * 2000 + "\n")
    _refused(big, Plan, "over the 0 MiB")


def test_shipped_documents_are_within_the_bounds():
    for path in sorted((ROOT / "plans").glob("*.yaml")):
        yamlio.read_yaml(path, Plan)
    for path in sorted((ROOT / "profiles").glob("*.yaml")):
        yamlio.read_yaml(path, HardwareProfile)


@pytest.mark.parametrize(
    ("key", "value"),
    [("kv_num_blocks", 10**9), ("context", 10**9), ("slots", 10**9), ("max_num_seqs", 10**6)],
)
def test_counts_in_a_plan_are_bounded(tmp_path, key, value):
    """A count far beyond any machine (a typo or an attack) is refused when the plan is read,
    before anything is allocated for it."""
    import re

    text = (ROOT / "plans" / "smollm2-135m.dev-linux-cpu.yaml").read_text()
    edited, n = re.subn(rf"(\b{key}: )\d+", rf"\g<1>{value}", text, count=1)
    assert n == 1
    path = tmp_path / "p.yaml"
    path.write_text(edited)
    _refused(path, Plan, f"{key}': Input should be less than or equal to")


def test_a_gzip_document_is_read_as_its_text_and_bounded_inflated(tmp_path, monkeypatch):
    """A path ending in .gz is written gzip-compressed with no timestamp (equal documents, equal
    bytes) and read back as the same document; a compressed file that inflates past
    ``MAX_DOCUMENT_BYTES`` is refused having inflated no more than that, and a damaged stream
    is one line."""
    import gzip

    profile = yamlio.read_yaml(ROOT / "profiles" / "m1-max-32gb.yaml", HardwareProfile)
    a, b = tmp_path / "a.yaml.gz", tmp_path / "b.yaml.gz"
    yamlio.write_yaml(profile, a)
    yamlio.write_yaml(profile, b)
    assert a.read_bytes() == b.read_bytes() and a.read_bytes()[:2] == b"\x1f\x8b"
    assert yamlio.read_yaml(a, HardwareProfile) == profile
    assert yamlio.document_text(a) == yamlio.to_yaml(profile)
    bomb = tmp_path / "bomb.yaml.gz"
    bomb.write_bytes(gzip.compress(b"x: " + b"y" * (64 << 20)))  # 64 MiB in about 64 KB
    _refused(bomb, Plan, "over the 32 MiB")
    broken = tmp_path / "broken.yaml.gz"
    broken.write_bytes(a.read_bytes()[:40])
    _refused(broken, HardwareProfile, "broken.yaml.gz: cannot be read")


def test_figures_in_exponent_form_are_numbers(tmp_path):
    """Review: a link's bandwidth written ``1e9`` (no dot, no exponent sign) was a string to
    PyYAML's YAML 1.1 reader, refused as "not a valid number"; it is 10^9 as in YAML 1.2."""
    from strata.common.schemas import ClusterLink

    p = tmp_path / "link.yaml"
    p.write_text(
        "hosts: [a, b]\n"
        "bandwidth_bytes_s: {value: 1e9, source: assumed, how: a guess}\n"
        "latency_s: {value: 2.5e-5, source: assumed, how: a guess}\n"
    )
    link = yamlio.read_yaml(p, ClusterLink)
    assert link.bandwidth_bytes_s.value == 1e9 and link.latency_s.value == 2.5e-5
    p.write_text("hosts: [a, b]\nbandwidth_bytes_s: {value: '1e9', source: assumed, how: x}\n")
    with pytest.raises(SchemaError):  # quoted, it stays a string
        yamlio.read_yaml(p, ClusterLink)
