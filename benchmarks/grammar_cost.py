#!/usr/bin/env python3
"""What a grammar (``response_format``, forced tool calls: ``executor.grammar``) costs per
generated token, in-process (no HTTP), at concurrency 1 and 16.

One serving engine of PLAN runs, round after round, three kinds of the same greedy requests:

- ``device``: free text, the argmax taken on the device (pipelined steps where the engine may);
- ``host``: free text with the logits brought to the host for the pick (a logit bias of 0 on
  token 0: the path every grammar-constrained request takes, without a grammar);
- ``grammar``: the nested JSON schema of ``tests/executor/test_structured_outputs.py``.

The grammar requests run first; the free-text ones then generate as many tokens as each grammar
answer did, so that every kind's batch shrinks alike as answers end. Reported per kind and
concurrency: decode tok/s of the aggregate (tokens after each request's
first, over the time from the first to the last token event), and for ``grammar`` the time spent
in the grammar per token on the engine thread (a step's masks, ``executor.runner.grammar_masks``,
worked out while the device runs the pass, and each token's ``Constraint.consume``: each call
timed). The grammar's cost is the ``grammar`` / ``host`` ratio; ``host`` / ``device`` is what
bringing logits to the host costs. Round 0 warms up and is not counted; medians of the rest.

Checks: every ``grammar`` answer is valid JSON of the schema and ends in an end-of-generation
token, or, cut by ``--max-tokens`` (a random-weight model may write a number's digits until then),
is a prefix the grammar takes (counted in the result); each kind's token ids are the same in
every round (greedy is deterministic), and ``host``'s equal ``device``'s (a bias of 0 changes
nothing).

usage: python benchmarks/grammar_cost.py PLAN [--rounds 4] [--concurrency 1,16]
       [--max-tokens 96] [-o FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from strata.executor import grammar as grammar_module
from strata.executor import runner as runner_module
from strata.executor.config import RuntimeConfig
from strata.executor.engine import Engine
from strata.executor.grammar import json_schema_grammar
from strata.executor.plan_loader import load_plan
from strata.executor.sampling import SamplingParams
from strata.executor.serving import GenerationRequest, ServingEngine

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["country", "cities", "capital"],
    "properties": {
        "country": {"type": "string", "maxLength": 24},
        "cities": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "population", "kind", "score"],
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                    "kind": {"enum": ["village", "town", "city"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 10},
                },
            },
        },
        "capital": {"type": "boolean"},
    },
}
"""The acceptance test's nested schema (objects, an array, enums, numbers, a boolean)."""

PROMPT = "Name a country and up to three of its cities, with their population, as JSON."
KINDS = ("grammar", "host", "device")
WAIT_S = 600.0


class _Timer:
    """Sums the engine thread's seconds in the grammar: a step's masks (``executor.runner.
    grammar_masks``, worked out while the device runs the pass, so partly hidden) and each
    token's advance (``Constraint.consume``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        timed_calls = ((runner_module, "grammar_masks"), (grammar_module.Constraint, "consume"))
        for owner, name in timed_calls:
            orig = getattr(owner, name)

            def timed(*args, _orig=orig, **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(*args, **kw)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(owner, name, timed)


def _request(kind: str, rid: str, ids: list[int], max_tokens: int, grammar: str):
    params = SamplingParams(temperature=0, logit_bias=((0, 0.0),) if kind == "host" else ())
    return GenerationRequest(
        rid, ids, max_tokens, params, grammar=grammar if kind == "grammar" else None
    )


def run(
    serving: ServingEngine, kind: str, prompts: list[list[int]], max_tokens: list[int], grammar
):
    """Submit ``prompts`` together (prompt i generating at most ``max_tokens[i]``) and wait;
    ({id: [event times]}, {id: [tokens]}, {id: finish})."""
    done, lock, left = threading.Event(), threading.Lock(), [len(prompts)]
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}

    def handler(rid: str):
        def on_event(ev) -> None:
            if ev.token_ids:
                times[rid].append(time.perf_counter())
                tokens[rid].extend(ev.token_ids)
            if ev.finish_reason:
                finish[rid] = ev.finish_reason if not ev.error else f"error: {ev.error}"
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        return on_event

    for i, ids in enumerate(prompts):
        rid = f"{kind}-{time.time_ns()}-{i}"
        times[rid], tokens[rid] = [], []
        serving.submit(_request(kind, rid, ids, max_tokens[i], grammar), handler(rid))
    if not done.wait(WAIT_S):
        raise SystemExit(f"requests did not finish within {WAIT_S:.0f} s")
    return times, tokens, finish


def decode_rate(times: dict[str, list[float]], tokens: dict[str, list[int]]) -> float:
    """Aggregate decode tok/s: tokens after each request's first event, over the span from the
    earliest first event to the latest last one."""
    after_first = sum(len(tokens[r]) - 1 for r in tokens)
    start = min(t[0] for t in times.values())
    end = max(t[-1] for t in times.values())
    return after_first / (end - start) if end > start else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    loaded = load_plan(args.plan)
    serving = ServingEngine(Engine(loaded, config=RuntimeConfig.build(loaded.plan.runtime)))
    serving.start()
    tok = serving.tokenizer
    grammar = json_schema_grammar(SCHEMA)
    vocab = grammar_module.vocabulary(tok, serving.vocab_size)
    timer = _Timer()
    results: dict = {}
    failures: list[str] = []
    try:
        for c in levels:
            prompts = [tok.encode(f"{PROMPT} ({i})") for i in range(c)]
            rates: dict[str, list[float]] = {k: [] for k in KINDS}
            per_token: list[float] = []
            first_ids: dict[str, list[list[int]]] = {}
            cut = 0
            for r in range(args.rounds):
                lengths = [args.max_tokens] * c
                for kind in KINDS:
                    before = timer.seconds
                    times, tokens, finish = run(serving, kind, prompts, lengths, grammar)
                    ids = [
                        tokens[k] for k in sorted(tokens, key=lambda k: int(k.rsplit("-", 1)[1]))
                    ]
                    if kind == "grammar":
                        # Free text as long as each grammar answer: the batch shrinks as theirs
                        # did (an answer that ends early leaves fewer sequences per step).
                        lengths = [len(t) for t in ids]
                    if kind not in first_ids:
                        first_ids[kind] = ids
                    elif ids != first_ids[kind]:
                        failures.append(f"c={c} {kind}: round {r}'s tokens differ from round 0's")
                    if kind == "grammar":
                        for rid, f in finish.items():
                            text = tok.decode(tokens[rid])
                            if f == "length":  # cut by max_tokens: a prefix the grammar takes
                                cut += 1
                                try:
                                    grammar_module.Constraint(vocab, grammar).consume(tokens[rid])
                                except grammar_module.GrammarError as e:
                                    failures.append(f"c={c} grammar: cut answer {e}: {text!r}")
                                continue
                            if f != "stop":
                                failures.append(f"c={c} grammar: ended with {f}: {text!r}")
                                continue
                            try:
                                _check(json.loads(text))
                            except (ValueError, AssertionError) as e:
                                failures.append(f"c={c} grammar: {e}: {text!r}")
                    if r == 0:
                        continue
                    rates[kind].append(decode_rate(times, tokens))
                    if kind == "grammar":
                        n = sum(len(v) for v in tokens.values())
                        per_token.append((timer.seconds - before) / n)
                print(
                    f"c={c} round {r}: "
                    + "  ".join(f"{k} {rates[k][-1]:.1f} tok/s" for k in KINDS if r and rates[k])
                )
            if first_ids["host"] != first_ids["device"]:
                failures.append(f"c={c}: the host path's tokens differ from the device's")
            med = {k: statistics.median(v) for k, v in rates.items()}
            results[f"c{c}"] = {
                "decode_tok_s": med,
                "grammar_over_host": med["grammar"] / med["host"],
                "host_over_device": med["host"] / med["device"],
                "grammar_us_per_token": statistics.median(per_token) * 1e6,
                "grammar_answers_cut_by_max_tokens": cut,
                "rounds": {k: v for k, v in rates.items()},
            }
            print(json.dumps({f"c{c}": results[f"c{c}"]}, indent=1))
    finally:
        serving.close()
    out = {
        "plan": str(Path(args.plan)),
        "backend": loaded.plan.machine.backend if hasattr(loaded.plan, "machine") else None,
        "max_tokens": args.max_tokens,
        "results": results,
        "failures": failures,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    if failures:
        raise SystemExit("checks failed:\n" + "\n".join(failures[:10]))


def _check(answer: dict) -> None:
    """The schema's rules on one answer (AssertionError naming the first broken one)."""
    assert set(answer) == {"country", "cities", "capital"}, "keys"
    assert isinstance(answer["country"], str) and len(answer["country"]) <= 24, "country"
    assert isinstance(answer["capital"], bool), "capital"
    assert 1 <= len(answer["cities"]) <= 3, "cities"
    for city in answer["cities"]:
        assert set(city) == {"name", "population", "kind", "score"}, "city keys"
        assert isinstance(city["name"], str) and len(city["name"]) <= 16, "name"
        assert isinstance(city["population"], int) and 0 <= city["population"] <= 1e8, "pop"
        assert city["kind"] in ("village", "town", "city"), "kind"
        assert isinstance(city["score"], int | float) and 0 <= city["score"] <= 10, "score"


if __name__ == "__main__":
    main()
