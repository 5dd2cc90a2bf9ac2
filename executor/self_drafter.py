"""The self-drafter: draft tokens from the target model's own resident layers.

A model whose deep layers stream from disk pays for each decode step with a read of those layers;
speculative decoding spreads one read over several tokens if something cheap guesses them. The
self-drafter is the target itself cut short, with no extra weights: it runs the first
``draft_layers`` blocks, leaving out every unit the plan streams from NVMe (layer skip: their
residual passes through), then the model's own output norm and head (early exit), and takes the
argmax. This is the draft-and-verify scheme of Zhang et al. 2023 ("Draft & Verify: Lossless Large
Language Model Acceleration via Self-Speculative Decoding", which skips layers) and of LayerSkip
(Elhoushi et al. 2024, which exits early), here with the layers chosen by what is already in
memory (the plan's ``speculative.draft_layers``), so drafting reads nothing from disk.

KV cache: the drafter's passes share the target's paged KV cache. Draft token j is computed at
position ``start + j`` and writes its keys/values into that sequence's own slots, in the blocks the
scheduler reserved for the verification chunk, for the blocks the drafter runs; the verification
pass then recomputes every position of the chunk through every block and overwrites those slots,
so what the drafter wrote never reaches the target's outputs. Nothing to roll back, nothing to
release.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SeqInput
from strata.executor.runner import forward


def tier_or_none(store, unit: str) -> str | None:
    """The tier of ``unit`` in ``store``, or None when the model has no such unit."""
    try:
        return store.tier(unit)
    except KeyError:
        return None


def streamed_units(store, layers: int, experts: int = 0) -> frozenset[str]:
    """The block units of the first ``layers`` blocks that would read NVMe: what the
    self-drafter skips. A MoE block's FFN unit counts as streamed when any of its ``experts``
    streams (running the router would read the chosen experts through the expert cache)."""
    skip = set()
    for i in range(layers):
        if tier_or_none(store, f"blk.{i}.attn") == "nvme":
            skip.add(f"blk.{i}.attn")
        ffn = f"blk.{i}.ffn"
        if tier_or_none(store, ffn) == "nvme" or any(
            tier_or_none(store, f"blk.{i}.expert.{e}") == "nvme" for e in range(experts)
        ):
            skip.add(ffn)
    return frozenset(skip)


class SelfDrafter:
    """Greedy drafts from the target's first blocks, skipping streamed units (module docstring).

    Args:
        model: the target model (``executor.models.llama.LlamaModel``).
        kv: a callable giving the target's paged KV cache (made on the engine thread).
        layers: blocks the drafter runs (``1..block_count``).
        skip: units inside those blocks it leaves out (those the plan streams from NVMe).

    Raises:
        StrataError: ``layers`` outside ``1..block_count``, or the embedding or the output head
            streamed from NVMe (the drafter would read them from disk every draft token).
    """

    name = "self"

    def __init__(self, model, kv, layers: int, skip: frozenset[str] = frozenset()):
        n = model.arch.block_count
        if not 1 <= layers <= n:
            raise StrataError(
                f"the self-drafter's draft_layers is {layers}; it must be 1..{n} (the model's "
                "blocks): fix the plan's speculative section"
            )
        for unit in ("token_embd", "output"):
            if tier_or_none(model.store, unit) == "nvme":
                raise StrataError(
                    f"the self-drafter needs {unit} in memory but the plan streams it from NVMe; "
                    "re-plan with --speculative prompt_lookup or a larger device budget"
                )
        self.model, self._kv, self.layers, self.skip = model, kv, layers, frozenset(skip)

    def propose(self, inputs) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens per input (``executor.drafters.DraftInput`` with its
        ``start`` and ``slots``), one batched early-exit pass per draft position."""
        kv: PagedKVCache = self._kv()
        out: list[list[int]] = [[] for _ in inputs]
        cur = [inp.tokens[-1] for inp in inputs]  # each sequence's pending token
        active = [i for i, inp in enumerate(inputs) if inp.k > 0]
        j = 0
        while active:
            seqs = [
                SeqInput([cur[i]], inputs[i].start + j, inputs[i].slots, "last") for i in active
            ]
            logits = forward(
                self.model, ForwardBatch.build(seqs), kv, layers=self.layers, skip=self.skip
            )
            picks = np.array(mx.argmax(logits, axis=-1)).tolist()
            for i, tok in zip(active, picks, strict=True):
                out[i].append(int(tok))
                cur[i] = int(tok)
            j += 1
            active = [i for i in active if len(out[i]) < inputs[i].k]
        return out

    def accepted(self, request_id: str, num_valid: int) -> None:
        """Nothing to roll back: the verification pass overwrote what the drafter wrote."""

    def release(self, request_id: str) -> None:
        """Nothing held per sequence."""

    def close(self) -> None:
        """Nothing of its own: it drafts in the target's KV cache, which the runner drops."""
