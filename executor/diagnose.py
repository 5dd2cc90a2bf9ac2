"""Where a model's numbers first go wrong: the first stage of a forward pass whose output holds
NaN or infinity, and the weights of that stage that do.

``strata bench`` runs it when its request fails with non-finite logits (``executor.runner``
ends such a request naming only the step). The prompt goes through the model one stage at a
time, on a fresh engine with the weights on the plan's tiers, each stage evaluated before the
next is built: the token embedding, the RoPE frequency factors (where the model has them), each
block's attention and FFN, and the output head (final norm and projection). The stages are the
model class's own (``LlamaModel.embed_pass``, ``blocks`` one unit at a time, ``head``), so the
numbers are those of the pass that failed. The stage's weights are then read from the GGUF as
the loader repacks them (``executor.pack.unit_host_tensors``, whatever their tier) and those
holding NaN or infinity named: usually the cause.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from strata.common.quant import PackedWeight
from strata.executor.engine import Engine
from strata.executor.models.llama import LlamaModel
from strata.executor.pack import unit_host_tensors
from strata.executor.paged_kv import ForwardBatch, PagedKVCache
from strata.executor.plan_loader import LoadedPlan

NON_FINITE_MARK = "NaN or infinite logits"
"""Words of the error that ends a request whose logits are not finite
(``executor.runner.non_finite_logits``)."""


@dataclass
class NonFiniteStage:
    """The first stage whose output holds NaN or infinity.

    Attributes:
        stage: what it is, e.g. ``block 3 (blk.3): attention output``.
        block: its block's index (None: the embedding, RoPE factors or output head).
        tensors: the stage's weights that hold NaN or infinity, GGUF names in file order (empty:
            its weights are finite, the overflow is in the computation).
    """

    stage: str
    block: int | None
    tensors: list[str]


def first_non_finite(loaded: LoadedPlan, ids: list[int]) -> NonFiniteStage | None:
    """The first stage of ``ids``'s forward pass (the prompt, in the plan's prefill chunks)
    whose output is not finite, or None where every stage's is.

    Loads the plan's weights on a new engine, closed before returning: call it once nothing
    references the engine that failed (closing an engine stops its threads; its arrays go with
    its last reference), or both hold the weights.

    Raises:
        StrataError: the plan cannot be loaded, or ``ids`` does not fit its context.
    """
    engine = Engine(loaded)
    try:
        engine.check_prompt(ids)
        model = engine.model
        cache = model.make_cache(len(ids))
        for start in range(0, len(ids), engine.prefill_chunk):
            chunk = ids[start : start + engine.prefill_chunk]
            batch = ForwardBatch.build([cache.next_input(chunk, "last")])
            for stage, block, units, out in _stages(model, batch, cache.kv):
                if not bool(mx.all(mx.isfinite(out)).item()):
                    return NonFiniteStage(stage, block, non_finite_tensors(loaded, units))
            cache.advance(len(chunk))
        return None
    finally:
        engine.close()


def _stages(
    model: LlamaModel, batch: ForwardBatch, kv: PagedKVCache
) -> Iterator[tuple[str, int | None, list[str], mx.array]]:
    """``(stage, block, units, output)`` of one forward pass, in its order: each output is built
    from the one before once the caller has looked at it, every unit asked of the store in the
    pass's order (a streamed plan's schedule). Outputs are sliced to the batch's tokens (the
    pass's padding rows are not its numbers)."""
    n = batch.num_tokens
    x = model.embed_pass(batch)
    yield "token embedding", None, ["token_embd"], x[:, :n]
    rope = model.rope_factors()
    if rope is not None:
        yield "RoPE frequency factors (rope_freqs.weight)", None, ["globals"], rope
    for i in range(model.arch.block_count):
        units = [f"blk.{i}.attn", f"blk.{i}.ffn"]
        for unit, part in zip(units, ("attention", "FFN"), strict=True):
            skip = frozenset(units) - {unit}
            x = model.blocks(x, batch, kv, rope, i, i + 1, skip)
            yield f"block {i} (blk.{i}): {part} output", i, [f"blk.{i}."], x[:, :n]
    head = ["output"] + (["token_embd"] if model.arch.tied_embeddings else [])
    yield "output head (output_norm, output projection)", None, head, model.head(x, batch)


def non_finite_tensors(loaded: LoadedPlan, units: list[str]) -> list[str]:
    """GGUF names of the tensors of ``units`` that hold NaN or infinity once repacked as the
    loader repacks them (a quantized tensor: its scales and biases), in file order. A unit name
    ending in ``.`` stands for every unit whose tensors start with it (a block's attention, FFN
    and experts)."""
    g = loaded.gguf
    by_name = {t.name: t for t in g.tensor_infos}
    bad: set[str] = set()
    for u in loaded.desc.units:
        if not any(u.name == w or (w.endswith(".") and u.name.startswith(w)) for w in units):
            continue
        for name, host in unit_host_tensors(g, u, by_name):
            parts = [host.scales, host.biases] if isinstance(host, PackedWeight) else [host]
            parts = [p for p in parts if p is not None and p.dtype.kind == "f"]  # mxfp4: uint8
            if name not in bad and not all(np.isfinite(p).all() for p in parts):
                bad.add(name)
    return [t.name for t in g.tensor_infos if t.name in bad]
