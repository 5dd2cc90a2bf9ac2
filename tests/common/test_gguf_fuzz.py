"""Mutated GGUF headers (issue 35, acceptance 1): every mutant is accepted or refused with a
one-line ``StrataError``, within a CPU-time bound; never another exception. The full campaign
(10,000 mutants of more seeds) is ``scripts/fuzz_gguf.py``."""

from __future__ import annotations

import random

import pytest
from gguf_bytes import read_parts
from gguf_factory import write_tiny_llama
from gguf_fuzz import mutant, try_file
from strata.common.gguf_file import open_gguf

MUTANTS = 300
CPU_BOUND_S = 2.0  # per mutant, in-process; the campaign's bound is 10 CPU-s


@pytest.mark.parametrize("tied", [True, False])
def test_header_mutants_give_one_line_errors(tmp_path, tied):
    seed = write_tiny_llama(tmp_path / "seed.gguf", tied=tied, seed=int(tied))
    parts, raw = read_parts(seed), seed.read_bytes()
    header_end = open_gguf(seed).data_offset
    rng = random.Random(35 + tied)
    kinds: dict[str, int] = {}
    bad = []
    for i in range(MUTANTS // 2):
        path = tmp_path / "m.gguf"
        what = mutant(parts, raw, header_end, rng, path)
        out = try_file(path)
        kinds[out.kind] = kinds.get(out.kind, 0) + 1
        if out.kind == "traceback" or out.cpu_s > CPU_BOUND_S:
            bad.append(f"mutant {i} ({what}): {out.kind} in {out.cpu_s:.2f} s: {out.detail}")
    assert not bad, "\n".join(bad[:10])
    assert kinds.get("clean", 0) > MUTANTS // 8  # the mutants do reach the checks
