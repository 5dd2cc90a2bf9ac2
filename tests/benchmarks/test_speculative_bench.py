"""Smoke test of ``benchmarks/speculative.py`` on a tiny synthetic model (3 blocks, SmolLM2's
tokenizer): every task, placement and drafter runs, the ids equal plain greedy decoding's, the
summary has the figures the bench promises, and only the streamed placement reads NVMe.
"""

from __future__ import annotations

import json

from conftest import DEV_PROFILE
from gguf_factory import write_arch_model


def _bench_module():
    from strata.benchmarks import speculative

    return speculative


def test_speculative_bench_runs_and_checks(tmp_path, smollm2_gguf, capsys):
    model = write_arch_model(tmp_path / "qwen3.gguf", "qwen3", smollm2_gguf)
    out = tmp_path / "out"
    args = ["--profile", str(DEV_PROFILE), "--out", str(out), "--model", str(model)]
    args += ["--tokens", "5", "--warmup", "1", "--draft-blocks", "1", "--num-draft-tokens", "2"]
    assert _bench_module().main(args) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["check_passed"] and not s["mismatches"]
    assert s["settings"]["stream_from_block"] == 1  # half of 3 blocks
    assert s["settings"]["self_layers"] == {"resident": 2, "streamed": 3}
    assert s["streamed_units"] == ["blk.1.ffn", "blk.2.ffn"]
    assert s["settings"]["self_skipped_units"]["streamed"] == ["blk.1.ffn", "blk.2.ffn"]
    assert s["plans"]["streamed"]["bytes_by_tier"]["nvme"] > 0
    rows = {(r["task"], r["placement"], r["drafter"]): r for r in s["rows"]}
    assert len(rows) == 2 * 2 * 4
    for (_task, placement, drafter), r in rows.items():
        assert r["ids_equal_reference"]
        assert r["output_tokens"] == 5
        assert r["decode_tok_s"] > 0 and r["ttft_s"] > 0
        assert (r["nvme_bytes_per_output_token"] > 0) == (placement == "streamed")
        if drafter == "none":
            assert r["speedup"] == 1.0 and r["proposed"] == 0
        elif drafter != "prompt_lookup":  # random weights: the text need not repeat any n-gram
            assert r["proposed"] > 0 and 1.0 <= r["tokens_per_verification_step"] <= 3.0
    assert "check_passed: True" in capsys.readouterr().out
