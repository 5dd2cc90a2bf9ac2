"""The correctness rule of DEVELOPERS.md, against llama.cpp's stored outputs (shared by the tests
that compare with llama.cpp: tests/test_reference.py on SmolLM2, tests/test_architectures.py on the
synthetic model of each architecture).

- prompt token ids match llama.cpp's exactly (``prompt_ids``);
- teacher-forced on llama.cpp's own greedy prefix, our argmax equals its greedy token at every
  step where its top-2 logit gap is at least ``gap`` (``check_case``);
- after the prompt, our logits for its top-10 tokens are within a tolerance of its values.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from executor.chat import messages_to_ids
from executor.sampling import SamplingParams


def references_by_model(path: Path) -> dict[str, list[dict]]:
    """llama.cpp's stored outputs (a tests/make_arch_references.py file), by model name."""
    out: dict[str, list[dict]] = {}
    for ref in json.loads(path.read_text()):
        out.setdefault(ref["model"], []).append(ref)
    return out


def regenerated_models(
    names: list[str], refs: dict[str, list[dict]], folder: Path, tokenizer: Path, remake: str
) -> dict[str, Path]:
    """Each named synthetic model written anew (``gguf_factory.write_arch_model``), checked to be
    the very file llama.cpp's references were made on (``remake``: the command that re-makes
    them when the factory's bytes change)."""
    from gguf_factory import write_arch_model

    paths = {}
    for name in names:
        path = write_arch_model(folder / f"strata-synthetic-{name}.gguf", name, tokenizer)
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        want = {r["model_sha256"] for r in refs.get(name, [])}
        if want != {got}:
            pytest.fail(
                f"the regenerated {name} GGUF has sha256 {got}, but llama.cpp's references were "
                f"made on {sorted(want) or 'no file'}: the factory (or gguf-py/numpy) now writes "
                f"other bytes. Re-make them with llama.cpp: {remake}"
            )
        paths[name] = path
    return paths


def resident_engine(name: str, gguf: Path, tmp_path_factory, context: int):
    """Yield (name, all-resident plan path, engine) of a model, closing the engine after."""
    from conftest import make_plan_file

    from executor.engine import Engine
    from executor.plan_loader import load_plan

    plan = tmp_path_factory.mktemp(f"plan-{name}") / "resident.yaml"
    make_plan_file(str(gguf), plan, context=context)
    engine = Engine(load_plan(plan))
    yield name, plan, engine
    engine.close()


def prompt_ids(engine, case: dict) -> list[int]:
    """Our token ids for a case: chat messages through the GGUF's template, or a plain prompt."""
    if "messages" in case:
        return messages_to_ids(engine.tokenizer, case["messages"])
    return engine.tokenizer.encode(case["prompt"])


@dataclass
class RuleResult:
    """What ``check_case`` measured, summed over the cases given to ``add``.

    Attributes:
        steps: teacher-forced steps compared.
        checked: steps where llama.cpp's top-2 gap is at least the threshold (argmax must match).
        top10_diff: largest |ours - llama.cpp| over its top-10 logits after each prompt.
        failures: (case, step, ours, llama.cpp's, gap) where the argmax differs at a checked step.
        near_ties: the same where it differs below the threshold (allowed, reported).
    """

    steps: int = 0
    checked: int = 0
    top10_diff: float = 0.0
    failures: list[tuple[str, int, int, int, float]] = field(default_factory=list)
    near_ties: list[tuple[str, int, int, int, float]] = field(default_factory=list)

    def summary(self) -> str:
        """One line: the figures of the rule."""
        ties = ", ".join(f"{c} step {s} (gap {g:.2f})" for c, s, _, _, g in self.near_ties)
        return (
            f"{self.checked}/{self.steps} teacher-forced steps checked, "
            f"{len(self.failures)} argmax mismatches; max |top-10 logit diff| = "
            f"{self.top10_diff:.4f}; near-tie mismatches: {ties or 'none'}"
        )


def check_case(engine, ref: dict, gap: float, result: RuleResult | None = None) -> RuleResult:
    """Run one llama.cpp reference entry teacher-forced and add its figures to ``result``.

    Args:
        engine: an ``executor.engine.Engine`` on the reference's model.
        ref: an entry of a llama.cpp reference file (shared/models.md's format).
        gap: llama.cpp's top-2 gap from which our argmax must equal its greedy token.
    """
    result = RuleResult() if result is None else result
    ids = ref["prompt_ids"] + ref["greedy_ids"][:-1]
    n = len(ref["prompt_ids"])
    logits = engine.logits_for(ids, first=n - 1)  # row i: after position n - 1 + i
    for tok, value in ref["top10_after_prompt"]:
        result.top10_diff = max(result.top10_diff, abs(float(logits[0, tok]) - value))
    for step, (want, top5) in enumerate(
        zip(ref["greedy_ids"], ref["greedy_step_top5"], strict=True)
    ):
        top2_gap = top5[0][1] - top5[1][1]
        got = int(np.argmax(logits[step]))
        result.steps += 1
        if top2_gap >= gap:
            result.checked += 1
        if got != want:
            where = result.failures if top2_gap >= gap else result.near_ties
            where.append((ref["case"], step, got, want, top2_gap))
    return result


def greedy_divergence(engine, ref: dict, gap: float) -> str | None:
    """Free-running greedy decode (the KV-cache path) against llama.cpp's greedy tokens: None if
    it follows them until the end or until a step where llama.cpp's top-2 gap is below ``gap``,
    else a message naming the step where it diverged."""
    gen = engine.generate(ref["prompt_ids"], SamplingParams(), len(ref["greedy_ids"]))
    for step, (got, want) in enumerate(zip(gen.output_ids, ref["greedy_ids"], strict=False)):
        if got != want:
            top5 = ref["greedy_step_top5"][step]
            if top5[0][1] - top5[1][1] < gap:
                return None
            return f"{ref['case']} diverged at step {step}: {got} != {want}"
    return None


def assert_correctness_rule(
    name: str, engine, refs: list[dict], gap: float, tol: float, record_property
) -> None:
    """The correctness rule on every reference of one model: teacher-forced argmax where
    llama.cpp's top-2 gap >= ``gap``, top-10 logits after the prompt within ``tol``, and at least
    50 steps checked (figures recorded as test properties)."""
    result = RuleResult()
    for ref in refs:
        check_case(engine, ref, gap, result)
    record_property(f"{name}_max_top10_logit_diff", result.top10_diff)
    record_property(f"{name}_checked_steps", result.checked)
    print(f"{name}: {result.summary()}")
    assert not result.failures, f"{name}: argmax differs where llama.cpp is sure: {result.failures}"
    assert result.top10_diff <= tol, f"{name}: top-10 logits differ by {result.top10_diff:.3f}"
    assert result.checked >= 50, f"{name}: only {result.checked} steps had a gap >= {gap}"
