"""MoE experts on NVMe: an expert cache in device slots, a routing tracker, co-activation prefetch.

A token reads only the top-k of a block's n experts. The forward pass computes the router first
and hands the chosen expert ids to the weight store (router interception), so only those experts
are loaded, and only after they are known:

- **Expert cache** (:class:`ExpertCache`): ``slots`` fixed device buffers (the plan's
  ``expert_cache.slots``; :class:`executor.streaming.SlotArena`) hold streamed experts. A use
  of a cached expert is a hit; any other use is a miss, read from the packed store with direct
  I/O into a victim slot. Policy (never a slot being computed on or read into): an empty slot,
  else the expert chosen least often so far (the routing tracker's counts: LFU), the least
  recently used among equals. Not plain LRU: a decode step visits every block in turn, so an
  LRU cache smaller than one step's experts evicts each expert just before its block comes
  round again and never hits (docs/moe.md#the-expert-cache); counts keep the experts that are
  hot across tokens, the static hot set the planner's cost model assumes.
  In ``prefetch`` mode the last ``prefetch`` slots are a
  prefetch area that only guesses are read into (least recently used first, a guess for a
  block still ahead kept until that block runs), so a guess never evicts the hot set (an
  earlier prefetch that could take any slot read far more experts than the cache alone:
  docs/moe.md#the-expert-cache); these are the plan's prefetch working slots.
  Modes: ``none`` (every use reads: slots are emptied after each group, the baseline),
  ``cache`` (the cache alone) and ``prefetch`` (the cache plus co-activation prefetch).
- **Routing tracker** (:class:`RoutingTracker`): per block, how often each expert is chosen and
  which experts are chosen together; across blocks, how often expert e' in block l+1 follows
  expert e in block l for the same token (the successor counts). It predicts block l+1's
  experts once block l's are known: the ``prefetch`` experts with the largest summed successor
  counts from the experts just chosen (ties to the more often chosen expert, then the lower
  index). In ``prefetch`` mode the ``prefetch`` most likely ones the cache does not hold yet
  are read while block l computes, so block l+1 finds them cached.
- **Routing profile**: the tracker's counts, saved as JSON (``RoutingProfile``), let
  ``strata plan --routing-profile FILE`` replace uniform top-k/n access with measured
  frequencies and the measured prediction recall. A plan made with one names it, and the
  executor seeds the tracker with it (``PRIOR_TOKENS`` tokens' worth) and reads the plan's
  ``expert_cache.preload`` (the profile's hot streamed experts) into the cache at start.

Counters are per use and honest: ``hits + misses`` = streamed-expert uses; a prefetched expert is
``used`` when a later use hits it, ``wasted`` when it is evicted unused, ``pending`` while it sits
unused in the cache; ``bytes_read`` are the bytes the OS returned, prefetches included.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.common.schemas import Architecture, RoutingProfile
from strata.executor.ops import QuantLinear
from strata.executor.pack import PackStore
from strata.executor.streaming import SlotArena

CACHE_MODES = ("none", "cache", "prefetch")
"""Expert-cache modes: no reuse, the cache alone, the cache with co-activation prefetch."""

EXPERT_KEYS = {
    "ffn_gate_exps": "gate",
    "ffn_up_exps": "up",
    "ffn_down_exps": "down",
    "ffn_gate_up_exps": "gate_up",
}
"""Stacked GGUF expert tensors (llama.cpp ``LLM_TENSOR_FFN_*_EXPS``) -> the key the forward pass
uses."""


def expert_key(tensor: str) -> str:
    """``blk.3.ffn_up_exps.weight`` -> ``up``, ``blk.3.ffn_up_exps.bias`` -> ``up_bias`` (see
    ``EXPERT_KEYS``; the expert biases are gpt-oss's).

    Raises:
        StrataError: a stacked expert tensor the executor does not know.
    """
    parts = tensor.split(".")
    base = parts[2] if len(parts) >= 4 else tensor
    key = EXPERT_KEYS.get(base)
    if key is None:
        raise StrataError(
            f"tensor {tensor} is a stacked expert tensor the executor does not know "
            f"(known: {', '.join(EXPERT_KEYS)})"
        )
    return key + "_bias" if parts[-1] == "bias" else key


def split_gate_up(ws: dict) -> dict:
    """A fused ``gate_up`` expert matrix [2 ff, d] split into ``gate`` (the first ff rows, as
    llama.cpp's ``build_moe_ffn`` views it) and ``up``; other keys unchanged."""
    if "gate_up" not in ws:
        return ws
    w = ws.pop("gate_up")
    if isinstance(w, QuantLinear):
        half = w.weight.shape[0] // 2
        b = w.biases  # None: mxfp4
        ws["gate"] = QuantLinear(
            w.weight[:half], w.scales[:half], None if b is None else b[:half], w.bits, w.group_size
        )
        ws["up"] = QuantLinear(
            w.weight[half:], w.scales[half:], None if b is None else b[half:], w.bits, w.group_size
        )
    else:
        half = w.shape[0] // 2
        ws["gate"], ws["up"] = w[:half], w[half:]
    return ws


PRIOR_TOKENS = 16
"""Weight of a routing profile in the routing tracker, in tokens: the profile's frequencies count
as this many tokens of routing (a Dirichlet prior's concentration). Small on purpose: a profile
of other text than the one running cost time when it outweighed the run's own counts
(docs/moe.md#routing-profiles-planning-from-measured-routing), while a few tokens' worth still
orders the preloaded cache and the first predictions."""


class RoutingTracker:
    """Which experts fire, together and in succession, per block (see the module docstring).

    Args:
        arch: the model's hyperparameters (``block_count``, ``expert_count``).

    A prior (``seed``: the routing profile the plan was made with) adds the profile's counts and
    successor counts, scaled to ``PRIOR_TOKENS`` tokens' worth, to this run's for ranking (LFU
    eviction) and prediction: the cache and the prefetch start from what the profile measured
    instead of from nothing, and this run's own routing takes over after a few dozen tokens when
    the text routes differently. The run's own counts (``counts``, ``profile``) stay separate.

    Attributes:
        counts: int64 [layers, n_expert], selections of each expert in this run.
        rank: float64 [layers, n_expert], ``counts`` plus the scaled prior's: how often each
            expert is known to be chosen (the expert cache's LFU order).
        tokens: int64 [layers], tokens routed through each block.
        successor: int64 [layers - 1, n_expert, n_expert]; ``[l, e, f]`` counts tokens that
            chose e in block l and f in block l + 1.
        coactivation: int64 [layers, n_expert, n_expert]; ``[l, e, f]`` counts tokens that
            chose both e and f in block l (e != f).
        predicted, predicted_hits: predictions made and how many of them the next block chose
            (their ratio is the prediction's precision; with ``prefetch`` = top-k it is also
            the share of a block's choices that were predicted, the recall).
    """

    def __init__(self, arch: Architecture):
        layers, n = arch.block_count, max(arch.expert_count, 1)
        self.layers, self.n = layers, n
        self.counts = np.zeros((layers, n), np.int64)
        self.tokens = np.zeros(layers, np.int64)
        self.successor = np.zeros((max(layers - 1, 0), n, n), np.int64)
        self.rank = np.zeros((layers, n), np.float64)
        self._prior_successor = np.zeros(self.successor.shape, np.float64)
        self.coactivation = np.zeros((layers, n, n), np.int64)
        self.predicted = 0
        self.predicted_hits = 0
        self._prev: tuple[int, np.ndarray] | None = None
        self._pending: dict[int, np.ndarray] = {}

    def seed(self, prior: RoutingProfile) -> None:
        """Add ``prior``'s counts and successor counts, scaled to ``PRIOR_TOKENS`` tokens'
        worth, to the ranking and the prediction (class docstring).

        Raises:
            StrataError: a prior with another block or expert count.
        """
        if (prior.layers, prior.expert_count) != (self.layers, self.n):
            raise StrataError(
                f"the routing profile has {prior.layers} blocks of {prior.expert_count} "
                f"experts but the model has {self.layers} of {self.n}; re-plan with a profile "
                "of this model"
            )
        scale = PRIOR_TOKENS / np.maximum(np.asarray(prior.tokens, np.float64), 1.0)
        self.rank += np.asarray(prior.counts, np.float64) * scale[:, None]
        if self.layers > 1:
            succ = np.asarray(prior.successor, np.float64)
            self._prior_successor += succ * scale[:-1, None, None]

    def observe(self, layer: int, chosen: np.ndarray) -> None:
        """Record block ``layer``'s choice: ``chosen`` int [T, k], each token's experts."""
        t, k = chosen.shape
        chosen_count = np.bincount(chosen.ravel(), minlength=self.n)
        self.counts[layer] += chosen_count
        self.rank[layer] += chosen_count
        self.tokens[layer] += t
        rows = np.repeat(chosen, k, axis=1).ravel()
        cols = np.tile(chosen, (1, k)).ravel()
        keep = rows != cols
        np.add.at(self.coactivation[layer], (rows[keep], cols[keep]), 1)
        if self._prev is not None and self._prev[0] == layer - 1 and len(self._prev[1]) == t:
            prev = self._prev[1]
            kp = prev.shape[1]
            np.add.at(
                self.successor[layer - 1],
                (np.repeat(prev, k, axis=1).ravel(), np.tile(chosen, (1, kp)).ravel()),
                1,
            )
        guess = self._pending.pop(layer, None)
        if guess is not None:
            self.predicted += len(guess)
            self.predicted_hits += int(np.isin(guess, chosen).sum())
        self._prev = (layer, chosen)

    def predict(self, layer: int, chosen: np.ndarray, m: int) -> list[int]:
        """Block ``layer``'s experts, most likely first to follow ``chosen`` (block
        ``layer - 1``'s choice, int [T, k]); [] past the last block or for m = 0. The first
        ``m`` are the prediction whose precision the tracker measures; the cache reads the
        first ``m`` it does not already hold."""
        if m <= 0 or not 0 < layer < self.layers:
            return []
        rows = chosen.ravel()
        score = self.successor[layer - 1][rows].sum(axis=0).astype(np.float64)
        score += self._prior_successor[layer - 1][rows].sum(axis=0)
        # Ties (and a tracker with no history yet): the more often chosen expert, then the lower.
        score += self.rank[layer] / (1.0 + self.rank[layer].max())
        order = np.lexsort((np.arange(self.n), -score))
        if len(chosen) == 1:  # precision is measured on decode steps (one token)
            self._pending[layer] = order[:m]
        return [int(e) for e in order]

    def profile(self, model_sha256: str | None, header_sha256: str) -> RoutingProfile:
        """The counts so far as a routing profile document."""
        return RoutingProfile(
            model_sha256=model_sha256,
            header_sha256=header_sha256,
            layers=self.layers,
            expert_count=self.n,
            tokens=[int(x) for x in self.tokens],
            counts=self.counts.tolist(),
            successor=self.successor.tolist(),
            coactivation=self.coactivation.tolist(),
            predicted=self.predicted,
            predicted_hits=self.predicted_hits,
        )


class ExpertCache:
    """Streamed experts in ``slots`` device slots, optionally prefetched (module docstring).

    Args:
        store: the packed store (expert units are packed one per expert).
        units: the streamed expert units (``blk.L.expert.E``) it may hold.
        slots: cache slots (at least the largest group the forward pass loads at once).
        io_threads: threads reading one expert's chunks in parallel.
        dtype: compute dtype.
        mode: one of ``CACHE_MODES``.
        prefetch: experts prefetched per block in ``prefetch`` mode.
        frequency: float64 [layers, n_expert], how often each expert is known to be chosen
            (the routing tracker's live ``rank``), for eviction.
        stage_direct_reads: as ``executor.streaming.SlotArena``'s (the runtime config's).

    Raises:
        StrataError: no slots, or an unknown mode.
    """

    def __init__(
        self,
        store: PackStore,
        units: list[str],
        slots: int,
        io_threads: int,
        dtype: mx.Dtype,
        mode: str = "prefetch",
        prefetch: int = 0,
        frequency: np.ndarray | None = None,
        *,
        stage_direct_reads: bool,
    ):
        if mode not in CACHE_MODES:
            raise StrataError(f"expert cache mode {mode!r}: use one of {', '.join(CACHE_MODES)}")
        if slots < 1:
            raise StrataError(
                f"the plan's expert cache has {slots} slots but experts stream from NVMe; "
                "re-plan (strata plan) or give the cache slots"
            )
        self.store, self.mode = store, mode
        self._streamed = set(units)
        # At least one slot stays for the cache (misses); the rest may be the prefetch area.
        self.prefetch = min(prefetch, max(0, slots - 1)) if mode == "prefetch" else 0
        slot_bytes = max(store.units[u].nbytes for u in units)
        self.arena = SlotArena(
            store, slots, slot_bytes, io_threads, dtype, stage_direct_reads=stage_direct_reads
        )
        self._readers = ThreadPoolExecutor(max(2, slots), thread_name_prefix="strata-expert")
        self._lock = threading.Lock()
        self._frequency = frequency
        self._unit_of: list[str | None] = [None] * slots
        self._key: list[tuple[int, int]] = [(0, 0)] * slots  # (layer, expert) each slot holds
        self._layer = 0  # the block being computed
        self._slot_of: dict[str, int] = {}
        self._reading: dict[int, Future] = {}
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(slots))
        self._pinned: set[int] = set()
        self._prefetched: set[int] = set()
        self._next: tuple[int, list[int]] | None = None
        self.hits = self.misses = 0
        self.prefetch_issued = self.prefetch_used = self.prefetch_wasted = 0
        self.bytes_read = 0
        self.preloaded = 0
        self.io_wait_s = 0.0

    @property
    def slots(self) -> int:
        """Cache slots."""
        return len(self.arena)

    @property
    def direct(self) -> bool:
        """Whether reads bypass the page cache now (``SlotArena.direct``)."""
        return self.arena.direct

    @property
    def method(self) -> str:
        """How the packed store is read now (``SlotArena.method``)."""
        return self.arena.method

    # ------------------------------------------------------------------ reads

    def _read(self, slot: int, unit: str) -> int:
        got = self.arena.read(slot, self.store.units[unit])
        with self._lock:
            self.bytes_read += got
        return got

    def _victim(self, wait: bool, for_prefetch: bool = False) -> int | None:
        """The slot to reuse, or None when every slot is being computed on or read into.

        The last ``prefetch`` slots are the prefetch area, the others the cache. A miss takes,
        in the cache, an empty slot, else the expert chosen least often (LFU; the least
        recently used among equals); with ``wait``, if every cache slot is busy, it waits for
        a read in flight, and only then takes a prefetch slot. A prefetch takes, in the prefetch
        area, an empty slot, else the least recently used one, but never a guess for a block
        still ahead. So guesses never evict the hot set the cache holds.
        """
        area = range(self.slots - self.prefetch, self.slots)
        while True:
            for slot, fut in list(self._reading.items()):
                if fut.done():  # a finished read (a guess nobody used yet): the slot is free
                    self._finish(slot, fut)
            best, best_key, spare = None, None, None
            for order, s in enumerate(self._lru):  # least recently used first
                if s in self._pinned or s in self._reading:
                    continue
                in_area = s in area
                if for_prefetch != in_area:
                    ahead = s in self._prefetched and self._key[s][0] > self._layer
                    if in_area and spare is None and not ahead:
                        spare = s  # a prefetch slot a miss may take as a last resort
                    continue
                if self._unit_of[s] is None:
                    return s
                layer, e = self._key[s]
                if for_prefetch:
                    if s in self._prefetched and layer > self._layer:
                        continue  # a guess for a block still ahead: keep it until it runs
                    return s
                count = 0 if self._frequency is None else float(self._frequency[layer, e])
                if best_key is None or (count, order) < best_key:
                    best, best_key = s, (count, order)
            if best is not None or for_prefetch:
                return best
            if wait and self._reading:
                slot, fut = next(iter(self._reading.items()))
                self._finish(slot, fut)
                continue
            return spare

    def _finish(self, slot: int, fut: Future) -> None:
        try:
            fut.result()
        except StrataError:
            raise
        except BaseException as e:
            raise StrataError(
                f"reading {self._unit_of[slot]} from the packed store failed: {e}"
            ) from e
        finally:
            self._reading.pop(slot, None)

    def _load(self, slot: int, unit: str) -> None:
        old = self._unit_of[slot]
        if old is not None:
            del self._slot_of[old]
            if slot in self._prefetched:
                self.prefetch_wasted += 1
                self._prefetched.discard(slot)
        self._unit_of[slot] = unit
        self._slot_of[unit] = slot
        parts = unit.split(".")
        self._key[slot] = (int(parts[1]), int(parts[3]))
        self._lru.move_to_end(slot)
        self._reading[slot] = self._readers.submit(self._read, slot, unit)

    # ------------------------------------------------------------------ compute thread

    def plan_prefetch(self, layer: int, experts: list[int]) -> None:
        """Prefetch ``experts`` of block ``layer`` after the next ``acquire`` has issued its own
        reads (so a block's misses are read before guesses about the next block)."""
        self._layer = layer - 1  # the block being routed, for the prefetch area's "ahead" test
        self._next = (layer, experts) if self.prefetch and experts else None

    def issue_prefetch(self) -> None:
        """Read the guesses ``plan_prefetch`` queued: the first ``prefetch`` streamed experts of
        the queue that are neither cached nor in flight, each into a prefetch-area slot. Called
        by ``acquire`` after the block's own misses, or by the weight store directly when the
        block chose no streamed expert (no ``acquire`` follows; the guesses must still go out)."""
        if self._next is None:
            return
        nl, guess = self._next
        self._next = None
        issued = 0
        for e in guess:
            if issued == self.prefetch:
                break
            unit = f"blk.{nl}.expert.{e}"
            if unit in self._slot_of or unit not in self._streamed:
                continue  # cached or in flight already, or not streamed (pinned, ram)
            slot = self._victim(wait=False, for_prefetch=True)
            if slot is None:
                continue
            self._load(slot, unit)
            self._prefetched.add(slot)
            self.prefetch_issued += 1
            issued += 1

    def preload(self, units: list[str]) -> int:
        """Read ``units`` (streamed experts, hottest first: the plan's ``expert_cache.preload``)
        into cache slots before the first token, as many as the cache holds besides its
        prefetch area; nothing in mode ``none``. Their reads count in ``bytes_read`` and
        ``preloaded``, not as misses (no token used them yet).

        Returns:
            The experts read.

        Raises:
            StrataError: a unit the cache does not stream, or a failed read.
        """
        if self.mode == "none":
            return 0
        room = self.slots - self.prefetch
        todo = [u for u in units if u not in self._slot_of][:room]
        for unit in todo:
            if unit not in self._streamed:
                raise StrataError(f"preload: {unit} is not an expert the cache streams")
            slot = self._victim(wait=True)
            assert slot is not None  # an empty cache slot: at most ``room`` are taken
            self._load(slot, unit)
        for slot, fut in list(self._reading.items()):
            self._finish(slot, fut)
        self.preloaded += len(todo)
        return len(todo)

    def acquire(self, layer: int, experts: list[int]) -> dict[int, dict]:
        """The tensors of ``experts`` of block ``layer`` as views of their slots, pinned until
        ``release``; hits and misses counted once per expert.

        Returns:
            expert -> {``gate``|``up``|``down``|``gate_up``: QuantLinear | mx.array}.

        Raises:
            StrataError: more experts than slots, or a failed read.
        """
        self._layer = layer
        if len(experts) > self.slots:
            raise StrataError(
                f"{len(experts)} experts at once need more than the expert cache's "
                f"{self.slots} slots; this is a bug in grouping"
            )
        slots = []
        for e in experts:
            unit = f"blk.{layer}.expert.{e}"
            slot = self._slot_of.get(unit)
            if slot is None:
                self.misses += 1
                slot = self._victim(wait=True)
                if slot is None:
                    raise StrataError("no free expert-cache slot; this is a bug in grouping")
                self._load(slot, unit)
            else:
                self.hits += 1
                if slot in self._prefetched:
                    self.prefetch_used += 1
                    self._prefetched.discard(slot)
                self._lru.move_to_end(slot)
            self._pinned.add(slot)
            slots.append(slot)
        self.issue_prefetch()
        t0 = time.perf_counter()
        for slot in slots:
            fut = self._reading.get(slot)
            if fut is not None:
                self._finish(slot, fut)
        self.io_wait_s += time.perf_counter() - t0
        out = {}
        for e, slot in zip(experts, slots, strict=True):
            unit = self.store.units[f"blk.{layer}.expert.{e}"]
            out[e] = {expert_key(k): w for k, w in self.arena.arrays(slot, unit).items()}
        return out

    def release(self) -> None:
        """Unpin the acquired experts (their computation was evaluated); in mode ``none`` the
        slots are emptied so that nothing is reused."""
        self._pinned.clear()
        if self.mode == "none":
            for s, unit in enumerate(self._unit_of):
                if unit is not None and s not in self._reading:
                    del self._slot_of[unit]
                    self._unit_of[s] = None

    def counters(self) -> dict[str, float]:
        """Hits, misses, hit rate, prefetches issued/used/wasted/pending and accuracy, bytes
        read (bytes the OS returned), I/O wait seconds."""
        uses = self.hits + self.misses
        pending = len(self._prefetched)
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / uses if uses else 0.0,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_used": self.prefetch_used,
            "prefetch_wasted": self.prefetch_wasted,
            "prefetch_pending": pending,
            "prefetch_accuracy": (
                self.prefetch_used / (self.prefetch_used + self.prefetch_wasted)
                if self.prefetch_used + self.prefetch_wasted
                else 0.0
            ),
            "bytes_read": self.bytes_read,
            "preloaded": self.preloaded,
            "io_wait_s": self.io_wait_s,
        }

    def close(self) -> None:
        """Wait for reads in flight, stop the reader threads, close the file (idempotent)."""
        if self._readers is None:
            return
        self._readers.shutdown(wait=True)
        self._readers = None  # type: ignore[assignment]
        self.arena.close()
