"""Greedy and seeded sampling (temperature, top-k, top-p), deterministic for a given seed.

Sampling runs in numpy float64 on the host with a PCG64 generator seeded once per request, so the
same logits and seed give the same token on every backend (CPU, Metal, CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.errors import StrataError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Attributes:
        temperature: 0 for greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p (1 = all).
        seed: seed of the request's random generator.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise StrataError(
                f"--temperature {self.temperature} must be a number >= 0 (0 = greedy)"
            )
        if self.seed < 0:
            raise StrataError(f"--seed {self.seed} is negative; give an integer >= 0")
        if self.top_k < 0:
            raise StrataError(f"--top-k {self.top_k} is negative; use 0 to keep all tokens")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise StrataError(f"--top-p {self.top_p} must be in (0, 1]")


class Sampler:
    """Picks tokens for one request.

    Args:
        params: the sampling parameters.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def __call__(self, logits: np.ndarray) -> int:
        """Next token id from ``logits`` ([vocab] float)."""
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        order = np.argsort(-z, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        probs = np.exp(z[order] - z[order[0]])
        probs /= probs.sum()
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(len(order), p=probs)])
