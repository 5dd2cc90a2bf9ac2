"""``executor.generate``: one request through the serving engine, as ``strata run`` and
``strata bench`` make it, and the figures it reports from the engine's own counters."""

from __future__ import annotations

import pytest
from conftest import make_plan_file
from gguf_factory import write_tiny_llama
from strata.common.errors import StrataError
from strata.executor.engine import Engine
from strata.executor.generate import generate
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import ServingEngine

CONTEXT = 32


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """A started serving engine of a tiny random Llama (context 32, KV blocks of 16)."""
    d = tmp_path_factory.mktemp("generate")
    plan = make_plan_file(str(write_tiny_llama(d / "tiny.gguf")), d / "p.yaml", context=CONTEXT)
    se = ServingEngine(Engine(load_plan(plan)))
    se.start()
    yield se
    se.close()


def test_figures_count_what_ran(serving):
    """Without speculation each decoded token is one engine step; bytes, steps and tokens are
    this request's alone; the prompt is one prefill step; the text is the ids decoded."""
    prompt = list(range(1, 9))
    g = generate(serving, prompt, SamplingParams(), 6, stop_at_eog=False)
    s = g.stats
    assert len(g.output_ids) == s["output_tokens"] == 6 and s["finish_reason"] == "length"
    assert s["prompt_tokens"] == 8 and s["cached_tokens"] == 0
    assert s["prefill_steps"] == 1 and s["decode_steps"] == s["decode_tokens"] == 5
    assert s["prefill_tok_s"] > 0 and s["decode_tok_s"] > 0 and s["decode_s"] > 0
    assert 0 < s["decode_bytes_read"]["gpu"] < s["bytes_read"]["gpu"]
    assert s["bytes_read"]["nvme"] == 0 and "speculative" not in s and "experts" not in s
    assert g.text == serving.tokenizer.decode(g.output_ids)
    again = generate(serving, prompt, SamplingParams(), 6, stop_at_eog=False)
    assert again.output_ids == g.output_ids  # greedy: the same ids every time
    assert again.stats["bytes_read"] == s["bytes_read"]  # counted per request, not in total


def test_a_cached_prefix_is_counted(serving):
    """A prompt whose first KV block another request computed: its cached tokens are reported,
    and its prefill rate counts the tokens computed, not the ones the cache served."""
    prompt = list(range(30, 50))  # 20 tokens: one whole block of 16
    generate(serving, prompt, SamplingParams(), 1)
    g = generate(serving, prompt[:16] + [7, 8, 9], SamplingParams(), 1)
    s = g.stats
    assert s["cached_tokens"] == 16
    assert s["prefill_tok_s"] == pytest.approx((19 - 16) / s["prefill_s"], rel=1e-3)


def test_finish_reasons_and_limits(serving):
    """``length`` at max_tokens, ``context`` where the plan's context ends first, nothing with
    max_tokens 0 (the prompt still computed), text streamed in pieces that join to the text."""
    pieces: list[str] = []
    g = generate(serving, list(range(1, 21)), SamplingParams(), 100, pieces.append, False)
    assert g.stats["finish_reason"] == "context" and len(g.output_ids) == CONTEXT - 20
    assert "".join(pieces) == g.text
    none = generate(serving, [5, 6, 7], SamplingParams(), 0)
    assert none.output_ids == [] and none.text == "" and none.stats["finish_reason"] == "length"
    assert none.stats["prefill_steps"] == 1
    with pytest.raises(StrataError, match="negative"):
        generate(serving, [5, 6, 7], SamplingParams(), -1)
    with pytest.raises(StrataError, match="context"):
        generate(serving, list(range(1, CONTEXT + 1)), SamplingParams(), 4)


def test_a_failing_callback_aborts_the_request(serving):
    """An exception from ``on_text`` (Ctrl-C in ``strata run``) reaches the caller and the
    engine drops the request: its KV blocks are free and the next request runs."""

    def boom(piece: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(serving, list(range(1, 9)), SamplingParams(), 20, boom, False)
    g = generate(serving, list(range(1, 9)), SamplingParams(), 3, stop_at_eog=False)
    assert len(g.output_ids) == 3
    m = serving.metrics()
    assert m["running"] == 0 and m["waiting"] == 0 and m["kv_blocks_in_use"] == 0
