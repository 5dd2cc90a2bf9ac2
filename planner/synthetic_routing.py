"""Expert routing of synthetic mixture-of-experts models: statistics, and the skewed design's
random structure, fixed targets and calibration (``planner/synthetic.py`` builds the weights).

Statistics (:func:`routing_stats`), from the experts a model chose for T tokens at each of its L
MoE layers (an int array [T, L, k], or T lists of L sets):

* **top-quarter share**: per layer, the fraction of the layer's T·k selections that went to its
  ``n_expert // 4`` (at least 1) most selected experts, averaged over layers. Uniform routing
  gives about ``(n_expert // 4) / n_expert`` (0.25 for 8 experts), more on a finite sample
  since the top quarter is picked after counting: on 396 tokens of English (189 distinct), with
  each distinct token routed uniformly at random once, the share averages 0.32 for 8 experts
  top-2 and 0.42 for 128 top-8.
* **successor lift**: each layer pair (l, l+1) has a designated successor ``succ[l][e]`` of every
  expert e (:func:`successor_permutations`). Pooled over pairs and tokens: P(succ[l][e] chosen at
  l+1 | e chosen at l) / (k / n_expert), i.e. the count of (token, l, e) where e and its
  successor both fired, over the count where e fired, over chance. About 1 for routing that
  ignores the successor structure, on average over seeds.
* **lift over marginal**: the same co-firing count over its expectation if layer l+1 chose
  independently of layer l with its own observed per-expert rates. Unlike the lift over chance,
  it does not count the part of the co-firing that popularity alone explains (a popular expert
  whose successor is popular too).

The skewed design. Experts are arranged in ``n_expert`` *lanes* (:func:`expert_lanes`): lane c
holds one expert per layer (a random expert id per layer, so ids carry no structure), and the
designated successor of lane c's expert at layer l is lane c's expert at layer l+1. Lane c has a
popularity rank c (0 the most popular). Every expert's router logit, in units where the per-token
noise has unit variance, is

    logit[t, l, lane c] = beta[c] + eps[t, l, c],   beta[c] = -B * c / (n_expert - 1),
    eps[t, 0, c] ~ N(0, 1),   eps[t, l+1, c] = rho * eps[t, l, c] + sqrt(1 - rho²) * N(0, 1),

and the top k logits are chosen (the uniform design is the same with B = rho = 0). B sets how much
traffic the popular lanes take, rho how often a token stays on a lane from one layer to the next.
Popularity follows the lanes because it has to: P(e and succ(e) both fire) <= min(P(e),
P(succ(e))), so if the popular experts' successors were ordinary experts the pooled lift could not
reach 3 at a share of 0.6 with 8 experts (a bound near 2.6 on average over permutations). (B, rho)
are set by :func:`calibrate` so that this model meets the fixed targets ``TARGET_SHARE`` and
``TARGET_LIFT``; the logit process is the same at every layer, so one simulated layer pair gives
both statistics. The targets were set in the design's brief before any measurement, as roughly what
trained Mixtral- and Qwen-style models show (a minority of experts takes most of a layer's traffic;
an expert's strongest next-layer partner fires a few times more often than chance), and are not
tuned to measured results.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from strata.common.errors import GGUFError, StrataError

if TYPE_CHECKING:
    from strata.common.gguf_file import GGUFFile

__all__ = [
    "SEED_KEY",
    "TARGET_LIFT",
    "TARGET_SHARE",
    "RoutingCalibration",
    "RoutingStats",
    "calibrate",
    "chosen_array",
    "expert_lanes",
    "file_successors",
    "routing_stats",
    "simulate_pair",
    "successor_permutations",
    "top_quarter",
]

SEED_KEY = "strata.synthetic.seed"
"""Metadata key of a synthetic MoE file's seed, which fixes its lanes and successors."""

TARGET_SHARE = 0.60
"""Fraction of a layer's selections taken by its top quarter of experts (skewed design)."""

TARGET_LIFT = 3.0
"""P(designated successor chosen at l+1 | expert chosen at l) / (k / n_expert) (skewed)."""

_CAL_TOKENS = 16384  # tokens simulated per calibration evaluation
_CAL_SEED = 20240607  # fixed: the calibration is a function of (n_expert, k) only


def top_quarter(n_expert: int) -> int:
    """Experts in a layer's "top quarter": ``n_expert // 4``, at least 1."""
    return max(1, n_expert // 4)


def _rng(seed: int, what: str, layer: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(what.encode()), layer])


def expert_lanes(n_expert: int, layers: int, seed: int) -> np.ndarray:
    """Lane c's expert id at each layer (lane c has popularity rank c, 0 the most popular).

    Args:
        n_expert: experts per layer.
        layers: MoE layers.
        seed: the model's seed (``strata synth --seed``).

    Returns:
        int64 [layers, n_expert]: row l is a permutation seeded by (seed, "lanes", l), so a model
        with more layers, and the uniform and skewed models of one seed, share it.
    """
    out = [_rng(seed, "lanes", i).permutation(n_expert) for i in range(layers)]
    return np.array(out, dtype=np.int64).reshape(-1, n_expert)


def successor_permutations(n_expert: int, layers: int, seed: int) -> np.ndarray:
    """The designated successor of every expert, per layer pair: the next expert of its lane.

    Returns:
        int64 [max(layers - 1, 0), n_expert]: ``succ[l][e]`` is the expert of layer l+1 in
        e's lane (:func:`expert_lanes`).
    """
    lanes = expert_lanes(n_expert, layers, seed)
    succ = np.empty((max(layers - 1, 0), n_expert), dtype=np.int64)
    for i in range(layers - 1):
        succ[i][lanes[i]] = lanes[i + 1]
    return succ


def file_successors(model: str | Path | GGUFFile) -> np.ndarray:
    """The designated successors of a synthetic MoE GGUF written by ``synth.py``, from its
    metadata (expert count, block count and ``strata.synthetic.seed``).

    Args:
        model: the GGUF's path, or the file already open (``open_gguf``).

    Returns:
        int64 [layers - 1, n_expert], as :func:`successor_permutations`.

    Raises:
        GGUFError: the file is missing or not a valid GGUF; a count or seed of the wrong type or
            out of range.
        StrataError: not a GGUF with experts, or without the seed key (not written by synth.py).
    """
    from strata.common.gguf_file import GGUFFile, open_gguf

    g = model if isinstance(model, GGUFFile) else open_gguf(model)
    from strata.common.gguf_values import MAX_BLOCKS, MAX_EXPERT_UNITS, MAX_EXPERTS, read_int

    path, arch = g.path, g.architecture
    n = read_int(g, f"{arch}.expert_count", 0, MAX_EXPERTS, 0)
    layers = read_int(g, f"{arch}.block_count", 1, MAX_BLOCKS, None)
    seed = read_int(g, SEED_KEY, 0, 2**64 - 1, None)
    if not n or layers is None:
        raise StrataError(f"{path}: not a mixture-of-experts model (no {arch}.expert_count)")
    if seed is None:
        raise StrataError(f"{path}: no {SEED_KEY}: not a synthetic model written by strata synth")
    if n * layers > MAX_EXPERT_UNITS:
        raise GGUFError(
            f"{path}: {n} experts x {layers} blocks is above the limit of {MAX_EXPERT_UNITS} "
            "expert units; the file is damaged"
        )
    return successor_permutations(n, layers, seed)


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class RoutingStats:
    """Routing statistics of T tokens through L MoE layers (see the module docstring).

    Attributes:
        tokens: T.
        layers: L.
        n_expert: experts per layer.
        n_used: experts chosen per token and layer (k).
        top_quarter_share: mean over layers of the top quarter's share of selections (0..1).
        successor_lift: pooled P(successor at l+1 | e at l) / (k / n_expert); NaN when L < 2.
        marginal_lift: pooled co-firings of (e, successor) over their expectation under
            independent layers with the observed per-expert rates; NaN when L < 2.
        share_per_layer: the top quarter's share at each layer, L values.
        lift_per_pair: the lift over chance of each pair (l, l+1), L - 1 values.
    """

    tokens: int
    layers: int
    n_expert: int
    n_used: int
    top_quarter_share: float
    successor_lift: float
    marginal_lift: float
    share_per_layer: tuple[float, ...]
    lift_per_pair: tuple[float, ...]

    def summary(self) -> str:
        """One line: share and lifts."""
        return (
            f"{self.tokens} tokens x {self.layers} layers, {self.n_used} of {self.n_expert} "
            f"experts: top-quarter share {self.top_quarter_share:.3f} (uniform "
            f"{top_quarter(self.n_expert) / self.n_expert:.3f}), successor lift "
            f"{self.successor_lift:.2f}x over chance, {self.marginal_lift:.2f}x over marginal"
        )


def chosen_array(chosen: np.ndarray | Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """Chosen experts as an int64 array [T, L, k] (T lists of L sets or sequences accepted).

    Raises:
        StrataError: not [tokens, layers, k], or a token choosing one expert twice in a layer.
    """
    if isinstance(chosen, np.ndarray):
        arr = chosen
    else:
        try:
            arr = np.array([[sorted(s) for s in tok] for tok in chosen])
        except ValueError:
            raise StrataError("chosen experts: every token and layer needs k experts") from None
    if arr.ndim != 3 or arr.shape[2] < 1:
        raise StrataError(f"chosen experts: shape {arr.shape}, expected [tokens, layers, k]")
    arr = arr.astype(np.int64)
    s = np.sort(arr, axis=2)
    if (s[:, :, 1:] == s[:, :, :-1]).any():
        raise StrataError("chosen experts: a token chose the same expert twice in one layer")
    return arr


def routing_stats(
    chosen: np.ndarray | Sequence[Sequence[Sequence[int]]],
    n_expert: int,
    successors: np.ndarray,
) -> RoutingStats:
    """Top-quarter share and successor lifts of a routing record.

    Args:
        chosen: experts chosen per token per layer: int [T, L, k], or T lists of L sets.
        n_expert: experts per layer (ids 0..n_expert-1).
        successors: int [L - 1, n_expert], ``successors[l][e]`` the designated successor of e
            (:func:`successor_permutations` with the model's seed).

    Returns:
        The statistics (see :class:`RoutingStats`).

    Raises:
        StrataError: no tokens or layers, an expert id out of range, or successors of another
            shape.
    """
    arr = chosen_array(chosen)
    t, n_layers, k = arr.shape
    if t == 0 or n_layers == 0:
        raise StrataError("chosen experts: no tokens or no layers")
    if arr.min() < 0 or arr.max() >= n_expert:
        raise StrataError(f"chosen experts: ids outside 0..{n_expert - 1}")
    successors = np.asarray(successors)
    if successors.shape != (n_layers - 1, n_expert):
        raise StrataError(
            f"successors: shape {successors.shape}, expected ({n_layers - 1}, {n_expert})"
        )
    fired = np.zeros((t, n_layers, n_expert), dtype=bool)
    np.put_along_axis(fired, arr, True, axis=2)
    counts = fired.sum(axis=0)  # [L, n]
    q = top_quarter(n_expert)
    share = np.sort(counts, axis=1)[:, ::-1][:, :q].sum(axis=1) / (t * k)
    lifts, hits, fires, expected = [], 0, 0, 0.0
    chance = k / n_expert
    for i in range(n_layers - 1):
        nxt = fired[:, i + 1][:, successors[i]]  # [T, n]: e's successor fired at i+1
        h = int((fired[:, i] & nxt).sum())
        f = int(counts[i].sum())
        hits, fires = hits + h, fires + f
        expected += float((counts[i] * counts[i + 1][successors[i]]).sum()) / t
        lifts.append(h / f / chance)
    nan = float("nan")
    return RoutingStats(
        tokens=t,
        layers=n_layers,
        n_expert=n_expert,
        n_used=k,
        top_quarter_share=float(share.mean()),
        successor_lift=hits / fires / chance if fires else nan,
        marginal_lift=hits / expected if expected else nan,
        share_per_layer=tuple(float(x) for x in share),
        lift_per_pair=tuple(lifts),
    )


# --------------------------------------------------------------------------- calibration


def simulate_pair(
    n_expert: int,
    n_used: int,
    spread: float,
    rho: float,
    *,
    tokens: int = _CAL_TOKENS,
    seed: int = _CAL_SEED,
) -> RoutingStats:
    """Route ``tokens`` through two consecutive layers of the abstract skewed model.

    Experts are numbered by lane (expert c is lane c at both layers, so ``succ`` is the
    identity); the draws are fixed by ``seed``, so the result is a deterministic function of
    (spread, rho), piecewise constant but nearly smooth at this many tokens.

    Args:
        n_expert, n_used: experts per layer and per token.
        spread: B: lane c's popularity bias is ``-B * c / (n_expert - 1)`` (noise std units).
        rho: the lane noise's correlation from one layer to the next, in [0, 1].

    Returns:
        The statistics of the two layers.
    """
    rng = np.random.default_rng([seed, n_expert, n_used])
    beta = -spread * np.arange(n_expert) / max(n_expert - 1, 1)
    e0 = rng.standard_normal((tokens, n_expert))
    e1 = rho * e0 + np.sqrt(max(1.0 - rho * rho, 0.0)) * rng.standard_normal((tokens, n_expert))
    chosen = np.stack(
        [np.argpartition(-(beta + e), n_used - 1, axis=1)[:, :n_used] for e in (e0, e1)], axis=1
    )
    return routing_stats(chosen, n_expert, np.arange(n_expert)[None, :])


@dataclass(frozen=True)
class RoutingCalibration:
    """Parameters of the skewed design for one (n_expert, k), and what the simulation gave.

    Attributes:
        spread: B, popularity bias range in noise std units.
        rho: lane noise correlation between consecutive layers.
        share: the simulated top-quarter share at (B, rho).
        lift: the simulated successor lift at (B, rho).
    """

    spread: float
    rho: float
    share: float
    lift: float


def _bisect(f, lo: float, hi: float, target: float, steps: int = 30) -> float:
    """x in [lo, hi] where the non-decreasing f crosses target (lo/hi if it never does)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


@functools.lru_cache(maxsize=32)
def calibrate(n_expert: int, n_used: int) -> RoutingCalibration:
    """(B, rho) such that the abstract model meets ``TARGET_SHARE`` and ``TARGET_LIFT``.

    The share depends on B alone (every lane's noise is N(0, 1) whatever rho), and the lift
    grows with rho: B is found by bisection on the share, then rho by bisection on the lift
    (deterministic: the simulation's draws are fixed). Well under a second for 8 experts.

    Raises:
        StrataError: fewer than 4 experts, k not below n_expert, or targets out of reach: the
            top quarter cannot take ``TARGET_SHARE`` (it takes at most (n_expert // 4) / k of
            the selections), or popularity alone already exceeds ``TARGET_LIFT``.
    """
    if n_expert < 4 or not 1 <= n_used < n_expert:
        raise StrataError(
            f"skewed routing needs at least 4 experts and fewer used than there are "
            f"(got {n_used} of {n_expert})"
        )
    if top_quarter(n_expert) / n_used < TARGET_SHARE + 0.15:
        raise StrataError(
            f"skewed routing: with {n_used} of {n_expert} experts used per token the top quarter "
            f"({top_quarter(n_expert)} experts) cannot take {TARGET_SHARE:.0%} of the "
            "selections with room to spare; use fewer --experts-used or more --experts"
        )

    def stats(b: float, r: float) -> RoutingStats:
        return simulate_pair(n_expert, n_used, b, r)

    spread = _bisect(lambda b: stats(b, 0.0).share_per_layer[0], 0.0, 20.0, TARGET_SHARE)
    rho = _bisect(lambda r: stats(spread, r).successor_lift, 0.0, 1.0, TARGET_LIFT)
    got = stats(spread, rho)
    if (
        abs(got.share_per_layer[0] - TARGET_SHARE) > 0.01
        or abs(got.successor_lift - TARGET_LIFT) > 0.05
    ):
        raise StrataError(
            f"skewed routing: no popularity spread and lane correlation meet share "
            f"{TARGET_SHARE} and lift {TARGET_LIFT} for {n_used} of {n_expert} experts (best: "
            f"share {got.share_per_layer[0]:.3f}, lift {got.successor_lift:.2f})"
        )
    return RoutingCalibration(spread, rho, got.share_per_layer[0], got.successor_lift)
