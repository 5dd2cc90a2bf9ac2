"""Greedy and seeded sampling (temperature, top-k, top-p, OpenAI's logit bias and presence and
frequency penalties), deterministic for a given seed.

Sampling runs in numpy float64 on the host with a PCG64 generator seeded once per request, so the
same logits and seed give the same token on every backend (CPU, Metal, CUDA). ``Sampler.verify``
accepts or rejects the draft tokens of speculative decoding with the same distribution, so
speculation changes how fast tokens come, never how they are distributed. A request with a grammar
(``executor.grammar.Constraint``: structured outputs, forced tool calls) has every row masked to the
tokens its grammar allows before anything else picks from it, the draft's rows each with the mask
of the state after the draft tokens before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from strata.common.errors import StrataError

if TYPE_CHECKING:
    from strata.executor.grammar import Constraint

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``, the same rule): the limit of
sampling as the temperature goes to 0, where dividing logits by a subnormal temperature
overflows to inf and the probabilities to NaN."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Attributes:
        temperature: 0 for greedy (argmax); otherwise logits are divided by it (below
            ``GREEDY_BELOW``: greedy).
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p (1 = all).
        seed: seed of the request's random generator.
        logit_bias: ``(token id, bias)`` pairs added to those tokens' logits (OpenAI's
            ``logit_bias``, each bias in [-100, 100]).
        presence_penalty: subtracted once from the logit of every token generated so far
            (OpenAI's, in [-2, 2]).
        frequency_penalty: subtracted from a token's logit once per time it was generated so far
            (OpenAI's, in [-2, 2]). The adjusted logit of token t with count c[t] is ``logit[t] +
            bias[t] - c[t] * frequency_penalty - (c[t] > 0) * presence_penalty`` (OpenAI's
            formula, as vLLM applies it), before temperature, top-k and top-p.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise StrataError(
                f"--temperature {self.temperature} must be a number >= 0 (0 = greedy)"
            )
        if self.temperature < GREEDY_BELOW:  # the limit, where dividing by it would overflow
            object.__setattr__(self, "temperature", 0.0)
        if self.seed < 0:
            raise StrataError(f"--seed {self.seed} is negative; give an integer >= 0")
        if self.top_k < 0:
            raise StrataError(f"--top-k {self.top_k} is negative; use 0 to keep all tokens")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise StrataError(f"--top-p {self.top_p} must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:  # also rejects NaN
                raise StrataError(f"{name} {v} must be in [-2, 2]")
        for tok, bias in self.logit_bias:
            if tok < 0 or not -100 <= bias <= 100:
                raise StrataError(
                    f"logit_bias {{{tok}: {bias}}}: give token ids >= 0 and biases in [-100, 100]"
                )

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or a penalty changes the logits before a token is picked."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)


class Sampler:
    """Picks tokens for one request: one at a time (``__call__``) or by verifying draft tokens
    (``verify``, for speculative decoding). Both draw from the same distribution (``probs``).

    Args:
        params: the sampling parameters.
        constraint: the request's grammar state, or None: every pick is then among the tokens
            it allows, and the tokens observed advance it.
    """

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None):
        self.params = params
        self.constraint = constraint
        self._rng: np.random.Generator | None = None
        self.counts: dict[int, int] = {}  # generated token -> times (the penalties' counts)

    @property
    def rng(self) -> np.random.Generator:
        """The request's random generator (PCG64 from ``params.seed``), made on its first draw:
        a greedy request never draws, and seeding from the OS's entropy costs the engine thread
        part of a millisecond per admission (docs/kernels.md#host-costs-around-the-pass)."""
        if self._rng is None:
            self._rng = np.random.Generator(np.random.PCG64(self.params.seed))
        return self._rng

    def observe(self, tokens: list[int]) -> None:
        """Count ``tokens`` as generated (the penalties apply to them from the next pick; without
        penalties nothing needs the counts and nothing is kept) and advance the grammar past
        them.

        Raises:
            executor.grammar.GrammarError: a token the grammar refuses.
        """
        if self.constraint is not None:
            self.constraint.consume(tokens)
        if not (self.params.presence_penalty or self.params.frequency_penalty):
            return
        for t in tokens:
            self.counts[int(t)] = self.counts.get(int(t), 0) + 1

    def adjusted(self, logits: np.ndarray, also: list[int] = ()) -> np.ndarray:
        """``logits`` ([vocab] float) with the logit bias and the penalties applied
        (``SamplingParams``), counting the generated tokens and ``also`` (draft tokens assumed
        accepted before this row); float64. Unchanged (no copy) when nothing adjusts them."""
        p = self.params
        if not p.adjusts_logits:
            return logits
        z = np.array(logits, dtype=np.float64)
        vocab = z.shape[-1]
        for tok, bias in p.logit_bias:
            if tok < vocab:
                z[tok] += bias
        if p.presence_penalty or p.frequency_penalty:
            counts = self.counts
            if len(also):
                counts = dict(counts)
                for t in also:
                    counts[int(t)] = counts.get(int(t), 0) + 1
            if counts:
                ids = np.fromiter(counts, np.int64, len(counts))
                c = np.fromiter(counts.values(), np.float64, len(counts))
                z[ids] -= c * p.frequency_penalty + p.presence_penalty
        return z

    def _filtered(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Temperature, top-k and top-p applied to one row (sampling only, temperature > 0).

        Args:
            logits: [vocab] float logits.

        Returns:
            ([n] token ids, most likely first (ties: lower id first), [n] float64
            probabilities summing to 1).
        """
        p = self.params
        z = logits.astype(np.float64) / p.temperature
        order = np.argsort(-z, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        probs = np.exp(z[order] - z[order[0]])
        probs /= probs.sum()
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return order, probs

    def _allowed(self, logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """``logits`` with every token outside ``mask`` (bool [>= vocab]) at -inf: a copy, or
        ``logits`` itself without a mask."""
        if mask is None:
            return logits
        return np.where(mask[: logits.shape[-1]], logits, -np.inf)  # logits' own dtype

    def _row(self, logits: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """One row as it is picked from: adjusted (``adjusted``), then masked by ``mask``, or
        by the grammar's current mask where the request has a grammar and none is given."""
        if mask is None and self.constraint is not None:
            mask = self.constraint.mask()
        return self._allowed(self.adjusted(logits), mask)

    def probs(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distribution ``__call__`` samples from for ``logits``.

        Args:
            logits: [vocab] float logits.

        Returns:
            ([n] int64 token ids, [n] float64 probabilities summing to 1): the tokens that can be
            picked, most likely first, after temperature, top-k and top-p; greedy (temperature 0):
            ([argmax], [1.0]).
        """
        logits = self._row(logits)
        if self.params.temperature == 0:
            return np.array([np.argmax(logits)], np.int64), np.ones(1)
        order, probs = self._filtered(logits)
        return order.astype(np.int64, copy=False), probs

    def __call__(self, logits: np.ndarray) -> int:
        """Next token id from ``logits`` ([vocab] float); not counted until :meth:`observe`."""
        logits = self._row(logits)
        if self.params.temperature == 0:
            return int(np.argmax(logits))
        order, probs = self._filtered(logits)
        return int(order[self.rng.choice(len(order), p=probs)])

    def verify(
        self, logits: np.ndarray, draft: list[int], masks: list[np.ndarray] | None = None
    ) -> list[int]:
        """Accept a prefix of ``draft`` and add one token, so that the tokens returned are
        distributed exactly as ``__call__`` would have produced them one by one.

        The rule is speculative sampling (Leviathan et al. 2023, "Fast Inference from
        Transformers via Speculative Decoding", Algorithm 1 and Theorem 1; Chen et al. 2023) for
        a deterministic drafter, whose proposal q is a point mass on draft[j]: accept draft[j]
        with probability min(1, p_j(x) / q(x)) = p_j(draft[j]); on rejection sample from
        norm(max(0, p_j - q)), which is p_j with draft[j] removed and renormalized, and stop.
        If every draft token is accepted, the bonus token is sampled from p_K. Greedy
        (temperature 0) is the limit where p_j is a point mass on argmax: accept while draft[j]
        equals the argmax of row j, then append the argmax of the first row not matched (or of
        row K); no random numbers are drawn.

        Args:
            logits: [K+1, vocab] float logits; row j is the distribution after the pending token
                and draft[:j] (row 0: after the pending token alone).
            draft: K >= 0 proposed token ids.
            masks: the grammar's masks along the draft (``Constraint.masks_along``), where the
                caller computed them ahead (``executor.runner``: while the device ran the
                pass); None: computed here.

        Returns:
            1..K+1 token ids: the accepted drafts, then the correction or the bonus token.

        Raises:
            StrataError: ``logits`` is not a [len(draft) + 1, vocab] matrix.
        """
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != len(draft) + 1:
            raise StrataError(
                f"verify got logits of shape {logits.shape} for {len(draft)} draft tokens; "
                f"pass one row per draft token plus one for the bonus ({len(draft) + 1} rows)"
            )
        if self.constraint is None:
            rows = [self.adjusted(logits[j], draft[:j]) for j in range(len(draft) + 1)]
        else:  # rows up to the first draft token the grammar refuses: none later is reached
            if masks is None:
                masks = self.constraint.masks_along(draft)
            rows = [
                self._allowed(self.adjusted(logits[j], draft[:j]), m) for j, m in enumerate(masks)
            ]
        if self.params.temperature == 0:
            return accept_greedy([int(np.argmax(row)) for row in rows], draft)
        out: list[int] = []
        for j, d in enumerate(draft):
            d = int(d)
            ids, probs = self._filtered(rows[j])
            at = np.flatnonzero(ids == d)
            p_d = float(probs[at[0]]) if at.size else 0.0
            # One uniform per draft token examined, drawn even when p_d is 0, so that the random
            # stream consumed depends only on how many drafts were examined.
            if self.rng.random() < p_d:
                out.append(d)
                continue
            if at.size:  # p_d < 1 here, so other tokens remain
                ids, probs = np.delete(ids, at[0]), np.delete(probs, at[0])
                probs /= probs.sum()
            return [*out, int(ids[self.rng.choice(len(ids), p=probs)])]
        order, probs = self._filtered(rows[len(draft)])  # the bonus token, as __call__ picks it
        return [*out, int(order[self.rng.choice(len(order), p=probs)])]


def accept_greedy(targets: list[int], draft: list[int]) -> list[int]:
    """Greedy verification: ``draft[j]`` is accepted while it equals ``targets[j]`` (the
    argmax after the pending token and ``draft[:j]``); then the first target not matched (or
    ``targets[K]``, the bonus) is appended. The outputs are exactly greedy decoding's.

    Args:
        targets: K+1 argmax token ids, one per verified position.
        draft: K draft token ids.

    Returns:
        1..K+1 token ids.
    """
    out: list[int] = []
    for j, d in enumerate(draft):
        if int(targets[j]) != int(d):
            break
        out.append(int(d))
    return [*out, int(targets[len(out)])]
