"""Speculative decoding's acceptance rule (``Sampler.verify``) and the distribution it samples from
(``Sampler.probs``).

The rule must leave the target distribution exactly as it is (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", Theorem 1, with the proposal q a point
mass on the deterministic draft). That is checked statistically on a toy model (a fixed random
Markov chain) whose exact sequence probabilities are known, and on a tiny real model's logits.

Statistical checks: Pearson's chi-square goodness of fit over the cells of the outcome, cells
whose expected count is below 5 pooled into one (the usual validity condition of the chi-square
approximation). The threshold is the chi-square quantile at 1 - ``ALPHA`` by the Wilson-Hilferty
approximation (Wilson & Hilferty 1931), computed with the standard library's normal quantile
since scipy is not installed. It lies above the exact quantile for the degrees of freedom used
here (the exact tail probability at the threshold, by the regularized incomplete gamma function,
is 2.7e-7 for df 2, 8.0e-7 for df 26, 9.4e-7 for df 121), so a correct sampler fails a check
with probability below ``ALPHA`` = 1e-6 (up to the chi-square approximation of the multinomial
itself), and the 7 checks of this file together with probability below 1e-5. The seeds are fixed,
so the outcome is deterministic; the figure is the chance that a fixed seed set is unlucky.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import numpy as np
import pytest
from strata.common.errors import StrataError
from strata.executor.sampling import Sampler, SamplingParams

ALPHA = 1e-6
"""False-failure probability of one chi-square check (see the module docstring)."""


def chi2_threshold(df: int, alpha: float = ALPHA) -> float:
    """Upper ``alpha`` quantile of the chi-square distribution with ``df`` degrees of freedom by
    the Wilson-Hilferty cube-root normal approximation: df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3,
    z the standard normal's 1 - alpha quantile (4.753 for 1e-6). For df = 3 it gives 32.8
    against the exact 30.7; at df 121 the exact tail beyond it is 9.4e-7: conservative."""
    z = NormalDist().inv_cdf(1 - alpha)
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, int]:
    """Pearson's chi-square of observed ``counts`` against the exact cell probabilities.

    Args:
        counts: observed outcomes per cell (any shape, int).
        probs: exact probability of each cell (same shape, sums to 1).

    Returns:
        (statistic, degrees of freedom, number of outcomes in cells of probability 0). Cells
        expected fewer than 5 times are pooled (with the next smallest cells until the pool
        expects at least 5).
    """
    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    n = counts.sum()
    impossible = int(counts[probs == 0].sum())
    live = np.flatnonzero(probs > 0)
    live = live[np.argsort(probs[live], kind="stable")]  # least likely first
    expected = n * probs[live]
    cut = int(np.searchsorted(expected, 5.0))  # cells [0, cut) expect fewer than 5
    if cut:
        while cut < len(live) and expected[:cut].sum() < 5:
            cut += 1
        obs = np.concatenate([[counts[live[:cut]].sum()], counts[live[cut:]]])
        exp = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    else:
        obs, exp = counts[live], expected
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1, impossible


# --- greedy ---------------------------------------------------------------------------------


def _rows(*argmaxes: int, vocab: int = 8) -> np.ndarray:
    """[len(argmaxes), vocab] float32 logits whose row j has its maximum at argmaxes[j]."""
    rows = np.zeros((len(argmaxes), vocab), np.float32)
    rows[np.arange(len(argmaxes)), argmaxes] = 5.0
    return rows


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """Below GREEDY_BELOW (vLLM's rule) sampling is its greedy limit: a subnormal temperature
    would overflow the scaled logits to inf and the probabilities to NaN."""
    logits = np.array([1.0, 30.0, 2.0, 30.0 - 1e-3])
    for t in (5e-324, 1e-310, 1e-6):
        params = SamplingParams(t, seed=1)
        assert params.temperature == 0
        assert Sampler(params).verify(logits[None], []) == [1]
    assert SamplingParams(1e-5).temperature == 1e-5


def test_a_greedy_request_never_seeds_a_generator():
    """The random generator is made on the first draw (seeding it from the OS's entropy costs
    the engine thread at admission); a greedy request draws nothing."""
    s = Sampler(SamplingParams())
    assert s(np.array([0.0, 2.0, 1.0])) == 1 and s.verify(np.zeros((1, 3)), []) == [0]
    assert s._rng is None
    seeded = Sampler(SamplingParams(1.0, seed=5))
    assert seeded.rng is seeded.rng  # made once
    assert seeded.rng.random() == np.random.Generator(np.random.PCG64(5)).random()


def test_greedy_verify_accepts_every_matching_draft_and_adds_the_bonus():
    s = Sampler(SamplingParams())
    assert s.verify(_rows(3, 1, 4, 7), [3, 1, 4]) == [3, 1, 4, 7]


def test_greedy_verify_stops_at_the_first_mismatch():
    s = Sampler(SamplingParams())
    assert s.verify(_rows(3, 1, 4, 7), [2, 1, 4]) == [3]  # the correction, nothing after it
    assert s.verify(_rows(3, 1, 4, 7), [3, 1, 5]) == [3, 1, 4]
    assert s.verify(_rows(3, 1, 4, 7), [3, 0, 4]) == [3, 1]  # a later match does not count


def test_greedy_verify_with_no_draft_is_the_argmax():
    s = Sampler(SamplingParams())
    row = np.array([[0.1, 2.5, -1.0, 2.4]], np.float32)
    assert s.verify(row, []) == [1] == [s(row[0])]


def test_verify_refuses_a_row_count_that_does_not_fit_the_draft():
    s = Sampler(SamplingParams(0.8))
    with pytest.raises(StrataError, match="3 rows"):
        s.verify(_rows(1, 2), [1, 2])
    with pytest.raises(StrataError, match="1 rows"):
        s.verify(np.zeros(8), [])


# --- probs and __call__ ---------------------------------------------------------------------


def _old_call(params: SamplingParams, rng: np.random.Generator, logits: np.ndarray) -> int:
    """``Sampler.__call__`` as it was before ``probs``/``verify`` (the reference it must keep)."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    order = np.argsort(-z, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if params.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


PARAMS = [
    SamplingParams(),
    SamplingParams(0.8),
    SamplingParams(1.3, top_k=5),
    SamplingParams(0.7, top_p=0.9),
    SamplingParams(1.0, top_k=20, top_p=0.5),
]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_call_is_unchanged(params):
    """Same tokens and the same random stream as the original ``__call__``, row after row."""
    logits = np.random.default_rng(1).normal(0, 2, (64, 300)).astype(np.float32)
    logits[:, 7] = logits[:, 9]  # a tie
    for seed in (0, 1, 123456789):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed)
        s, rng = Sampler(p), np.random.Generator(np.random.PCG64(seed))
        assert [s(r) for r in logits] == [_old_call(p, rng, r) for r in logits]
        assert s.rng.random() == rng.random()


def test_probs():
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0], np.float32)
    ids, probs = Sampler(SamplingParams()).probs(logits)
    assert ids.dtype == np.int64 and probs.dtype == np.float64
    assert ids.tolist() == [1] and probs.tolist() == [1.0]
    e = np.exp(logits.astype(np.float64) / 0.5)
    ids, probs = Sampler(SamplingParams(0.5)).probs(logits)
    assert ids.tolist() == [1, 3, 2, 0, 4]  # most likely first, ties by id
    np.testing.assert_allclose(probs, e[ids] / e.sum(), rtol=1e-12)
    ids, probs = Sampler(SamplingParams(0.5, top_k=3)).probs(logits)
    assert ids.tolist() == [1, 3, 2]
    np.testing.assert_allclose(probs, e[ids] / e[ids].sum(), rtol=1e-12)
    # top-p 0.9: tokens 1 and 3 hold 0.93 of the mass at temperature 0.5
    ids, probs = Sampler(SamplingParams(0.5, top_p=0.9)).probs(logits)
    assert ids.tolist() == [1, 3] and probs.tolist() == [0.5, 0.5]


def test_sampled_verify_edge_cases():
    """A draft that is the only possible token is always accepted; one outside the support is
    always rejected (the correction is then a token of the support)."""
    rows = np.log(np.array([[0.6, 0.3, 0.1, 1e-9], [0.2, 0.2, 0.3, 0.3]]))
    for seed in range(50):
        s = Sampler(SamplingParams(1.0, top_k=1, seed=seed))
        assert s.verify(rows, [0]) == [0, 2]
        s = Sampler(SamplingParams(1.0, top_k=3, seed=seed))
        out = s.verify(rows, [3])
        assert len(out) == 1 and out[0] in (0, 1, 2)
    s = Sampler(SamplingParams(0.8, seed=5))
    assert s.verify(rows[:1], []) == [Sampler(SamplingParams(0.8, seed=5))(rows[0])]


# --- the target distribution on a toy model ------------------------------------------------

V = 6  # vocabulary of the toy chain
START = 0  # the pending token generation starts from
LENGTH = 3  # tokens generated
K = 2  # draft tokens per verification step
N = 20000  # runs (seeds 0..N-1) per distribution compared
_chains = np.random.default_rng(2023)
TARGET = _chains.normal(0, 1.5, (V, V))
"""Target chain: TARGET[t] are the logits of the token after t."""
DRAFTER = _chains.normal(0, 1.5, (V, V))
"""The drafter's chain (another one, so that drafts are sometimes right, sometimes wrong)."""

VARIANTS = {
    "temperature": SamplingParams(0.8),
    "top_k": SamplingParams(0.8, top_k=3),
    "top_p": SamplingParams(0.8, top_p=0.9),
}

Rule = Callable[[Sampler, np.ndarray, list[int]], list[int]]


def _always_accept(s: Sampler, rows: np.ndarray, draft: list[int]) -> list[int]:
    """Wrong: every draft token accepted, then the bonus."""
    return [*draft, s(rows[len(draft)])]


def _reject_to_target(s: Sampler, rows: np.ndarray, draft: list[int]) -> list[int]:
    """Wrong, subtly: accept with probability p(d) as it should, but on rejection sample from p
    itself instead of p without d, so d comes out with probability p(d) (2 - p(d))."""
    out = []
    for j, d in enumerate(draft):
        ids, probs = s.probs(rows[j])
        if s.rng.random() < probs[ids == d].sum():
            out.append(d)
            continue
        return [*out, s(rows[j])]
    return [*out, s(rows[len(draft)])]


def _exact(params: SamplingParams) -> np.ndarray:
    """[V, V, V] probability of each 3-token continuation of START (from ``Sampler.probs``)."""
    step = np.zeros((V, V))
    for t in range(V):
        ids, probs = Sampler(params).probs(TARGET[t])
        step[t, ids] = probs
    return step[START][:, None, None] * step[:, :, None] * step[None, :, :]


def _seeded(params: SamplingParams, seed: int) -> Sampler:
    return Sampler(SamplingParams(params.temperature, params.top_k, params.top_p, seed))


def _plain(params: SamplingParams) -> np.ndarray:
    """[V, V, V] counts of the continuations ``__call__`` produces, one token at a time."""
    counts = np.zeros((V, V, V), np.int64)
    for seed in range(N):
        s, seq = _seeded(params, seed), [START]
        for _ in range(LENGTH):
            seq.append(s(TARGET[seq[-1]]))
        counts[tuple(seq[1:])] += 1
    return counts


def _speculative(params: SamplingParams, rule: Rule) -> tuple[np.ndarray, int, int]:
    """Counts of the continuations speculative decoding produces with ``rule``, and the drafts
    accepted and proposed. K is capped so that a step never produces more than is still
    wanted (as the scheduler caps it by max_tokens)."""
    counts = np.zeros((V, V, V), np.int64)
    accepted = proposed = 0
    for seed in range(N):
        s, seq = _seeded(params, seed), [START]
        while len(seq) <= LENGTH:
            draft, last = [], seq[-1]
            for _ in range(min(K, LENGTH - len(seq))):  # LENGTH + 1 - len(seq) still wanted
                last = int(np.argmax(DRAFTER[last]))  # the drafter's greedy chain
                draft.append(last)
            out = rule(s, TARGET[[seq[-1], *draft]], draft)
            accepted += len(out) - 1
            proposed += len(draft)
            seq += out
        counts[tuple(seq[1:])] += 1
    return counts, accepted, proposed


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculative_sampling_keeps_the_target_distribution(variant):
    """Plain sampling and speculative decoding with ``Sampler.verify`` both match the exact
    distribution of 3-token continuations of the chain (chi-square, module docstring), never
    produce an impossible continuation, and the drafts are neither all accepted nor all
    rejected."""
    params = VARIANTS[variant]
    exact = _exact(params)
    stat, df, impossible = chi_square(_plain(params), exact)
    assert impossible == 0 and stat < chi2_threshold(df), (stat, df, impossible)
    counts, accepted, proposed = _speculative(params, Sampler.verify)
    stat, df, impossible = chi_square(counts, exact)
    print(
        f"{variant}: chi2 {stat:.1f}, df {df}, threshold {chi2_threshold(df):.1f}, "
        f"acceptance {accepted}/{proposed}"
    )
    assert impossible == 0 and stat < chi2_threshold(df), (stat, df, impossible)
    assert 0 < accepted < proposed


@pytest.mark.parametrize("rule", [_always_accept, _reject_to_target], ids=lambda r: r.__name__)
def test_the_check_rejects_a_wrong_rule(rule):
    """The same harness catches an acceptance rule that distorts the distribution."""
    params = VARIANTS["temperature"]  # every cell possible: the statistic alone must reject
    counts, _, _ = _speculative(params, rule)
    stat, df, _ = chi_square(counts, _exact(params))
    print(f"{rule.__name__}: chi2 {stat:.1f}, df {df}, threshold {chi2_threshold(df):.1f}")
    assert stat > chi2_threshold(df)


# --- a tiny real model ----------------------------------------------------------------------


def test_verify_first_token_on_a_tiny_model(tmp_path, smollm2_gguf):
    """On the rows of a synthetic llama (random weights, SmolLM2's 49152-token vocabulary), the
    first token verify returns is distributed as ``probs`` of the first row, whether the draft's
    first token is accepted or not (it is the row's second most likely token)."""
    from conftest import make_plan_file
    from gguf_factory import write_arch_model
    from strata.executor.engine import Engine
    from strata.executor.plan_loader import load_plan

    model = write_arch_model(tmp_path / "llama3.gguf", "llama3", smollm2_gguf)
    engine = Engine(load_plan(make_plan_file(str(model), tmp_path / "plan.yaml", context=256)))
    params = SamplingParams(0.8)
    prompt = [1000, 1001, 1002, 1003, 1004]
    ids, probs = Sampler(params).probs(engine.logits_for(prompt)[-1])
    draft = [int(ids[1])]
    draft.append(int(np.argmax(engine.logits_for(prompt + draft)[-1])))
    rows = engine.logits_for(prompt + draft)[-(len(draft) + 1) :]
    engine.close()
    assert probs[1] > 0.05, "the draft must be accepted now and then for the test to mean much"

    n = 600
    first = [_seeded(params, seed).verify(rows, draft)[0] for seed in range(n)]
    counts = np.bincount(first, minlength=rows.shape[1])
    exact = np.zeros(rows.shape[1])
    ids, probs = Sampler(params).probs(rows[0])
    exact[ids] = probs
    stat, df, impossible = chi_square(counts, exact)
    print(
        f"tiny model: chi2 {stat:.1f}, df {df}, threshold {chi2_threshold(df):.1f}, "
        f"draft accepted {counts[draft[0]]}/{n}"
    )
    assert impossible == 0 and stat < chi2_threshold(df), (stat, df)
    assert 0 < counts[draft[0]] < n


def test_logit_bias_and_penalties_follow_openais_formula():
    logits = np.array([1.0, 3.0, 2.0, 0.5], np.float32)
    p = SamplingParams(logit_bias=((0, 5.0),), presence_penalty=0.5, frequency_penalty=0.25)
    s = Sampler(p)
    assert s(logits) == 0  # 1 + 5 beats 3
    s.observe([0, 0, 2])
    # token 0: 1 + 5 - 2 * 0.25 - 0.5 = 5.0; token 2: 2 - 0.25 - 0.5 = 1.25
    np.testing.assert_allclose(s.adjusted(logits), [5.0, 3.0, 1.25, 0.5])
    # a draft token counts for the rows after it
    np.testing.assert_allclose(s.adjusted(logits, [1])[1], 3.0 - 0.75)
    assert Sampler(SamplingParams()).adjusted(logits) is logits  # nothing to adjust: no copy
    with pytest.raises(Exception, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)
    with pytest.raises(Exception, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


def test_greedy_verify_with_penalties_matches_one_token_at_a_time():
    """Verification adjusts each row as if the drafts before it had been generated, so
    speculation never changes what the penalties produce."""
    rows = np.random.default_rng(3).standard_normal((5, 12)).astype(np.float32)
    params = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, logit_bias=((7, 0.8),))
    one = Sampler(params)
    tokens = []
    for row in rows:
        t = one(row)
        one.observe([t])
        tokens.append(t)
    assert Sampler(params).verify(rows, tokens[:4]) == tokens  # every draft kept, then the bonus
    assert Sampler(SamplingParams()).verify(rows, tokens[:4]) != tokens  # the penalties matter
