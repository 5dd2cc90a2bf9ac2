"""The server's Prometheus metrics (``GET /metrics``, text format 0.0.4): its own counters and
latency histograms, rendered together with the serving engine's counters."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40)
"""Upper bounds of the time-to-first-token histogram, seconds."""
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
"""Upper bounds of the time-per-output-token histogram, seconds."""


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count).

    Args:
        buckets: upper bounds, increasing (``+Inf`` is added).
    """

    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Record one value."""
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value

    def lines(self, name: str) -> Iterator[str]:
        """The exposition lines ``name_bucket{le=..}``, ``name_sum``, ``name_count``."""
        total = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            yield f'{name}_bucket{{le="{le}"}} {total}'
        yield f"{name}_sum {self.sum!r}"
        yield f"{name}_count {total}"


class ServerMetrics:
    """The server's own counters (updated on the event loop thread only)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def render(self, engine: dict) -> str:
        """Prometheus text exposition (format 0.0.4) of these counters and ``engine``'s
        (``ServingEngine.metrics()``)."""
        e = defaultdict(int, engine)
        used, total = e["kv_blocks_in_use"], e["kv_blocks_total"]
        query, hit = e["prefix_query_tokens"], e["prefix_hit_tokens"]
        requests = [
            (f'{{endpoint="{ep}",status="{st}"}}', n)
            for (ep, st), n in sorted(self.requests.items())
        ]
        tiers = [(f'{{tier="{t}"}}', b) for t, b in sorted(engine.get("bytes_read", {}).items())]
        # (name, type, help, [(labels, value)]) in exposition order.
        table: list[tuple[str, str, str, Any]] = [
            ("requests_total", "counter", "HTTP requests answered by endpoint and status.",
             requests),
            ("prompt_tokens_total", "counter", "Prompt tokens of submitted requests.",
             [("", self.prompt_tokens)]),
            ("generation_tokens_total", "counter", "Tokens generated.",
             [("", self.generation_tokens)]),
            ("time_to_first_token_seconds", "histogram",
             "Time from submission to the first generated token, seconds.", self.ttft),
            ("time_per_output_token_seconds", "histogram",
             "Mean time per generated token after the first, per request, seconds.", self.tpot),
            ("kv_blocks_in_use", "gauge", "KV-cache blocks in use.", [("", used)]),
            ("kv_blocks_total", "gauge", "KV-cache blocks in the pool.", [("", total)]),
            ("kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.",
             [("", used / total if total else 0.0)]),
            ("prefix_cache_queries_total", "counter",
             "Prompt tokens looked up in the prefix cache.", [("", query)]),
            ("prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.",
             [("", hit)]),
            ("prefix_cache_hit_rate", "gauge", "Prefix-cache hit tokens / query tokens so far.",
             [("", hit / query if query else 0.0)]),
            ("bytes_read_total", "counter", "Weight bytes read, by tier.", tiers),
            ("num_requests_running", "gauge", "Sequences in the running batch.",
             [("", e["running"])]),
            ("num_requests_waiting", "gauge", "Sequences waiting for admission.",
             [("", e["waiting"])]),
            ("preemptions_total", "counter",
             "Sequences preempted (recomputed) for lack of KV blocks.", [("", e["preemptions"])]),
            ("engine_steps_total", "counter", "Engine steps run.", [("", e["steps"])]),
            ("pipelined_steps_total", "counter",
             "Engine steps launched while the step before was still computing (their tokens "
             "read one step later).", [("", e["pipelined_steps"])]),
            ("cluster_passes_flowed_total", "counter",
             "Cluster plans: passes sent through the ranks without waiting for them to come "
             "back (prompt chunks before the last; executor.pipeline).",
             [("", e["cluster_passes_flowed"])]),
            ("cluster_passes_micro_batched_total", "counter",
             "Cluster plans: passes that were one micro-batch of a decode step cut to flow "
             "through the ranks (executor.pipeline).",
             [("", e["cluster_passes_micro_batched"])]),
            ("batched_tokens_total", "counter",
             "Tokens run through the model (prefill chunks and decodes).",
             [("", e["batched_tokens"])]),
            ("spec_draft_tokens_total", "counter",
             "Speculative decoding: draft tokens verified (proposed in steps whose sampling "
             "succeeded).", [("", e["spec_proposed_tokens"])]),
            ("spec_accepted_tokens_total", "counter",
             "Speculative decoding: draft tokens accepted by verification.",
             [("", e["spec_accepted_tokens"])]),
            ("spec_verification_steps_total", "counter",
             "Speculative decoding: verifications of one sequence's drafts (each yields the "
             "accepted drafts plus one token).", [("", e["spec_verification_steps"])]),
            ("compiled_pass_traces_total", "counter",
             "Target-model forward passes traced into a compiled graph (executor.pass_graph).",
             [("", e["compiled_pass_traces"])]),
            ("compiled_pass_replays_total", "counter",
             "Target-model forward passes replayed from a compiled graph.",
             [("", e["compiled_pass_replays"])]),
            ("batch_invariant", "gauge",
             "1 when serving batch-invariant (--batch-invariant), else 0.",
             [("", e["batch_invariant"])]),
        ]  # fmt: skip
        out: list[str] = []
        for short, kind, help, samples in table:
            name = f"strata_{short}"
            out += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
            if kind == "histogram":
                out.extend(samples.lines(name))
            else:
                out.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)
        return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))
