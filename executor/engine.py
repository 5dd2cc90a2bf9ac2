"""A loaded plan made runnable: tokenizer, weights on their tiers, the model's forward pass.

Requests run on the serving engine over it (``executor.serving``; one request with its figures:
``executor.generate``); :meth:`Engine.logits_for` gives teacher-forced logits for checks.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.common.schemas import ModelDescription
from strata.common.tensors import same_up_to_trailing_ones
from strata.executor.config import RuntimeConfig
from strata.executor.models import model_class
from strata.executor.plan_loader import LoadedPlan
from strata.executor.runner import forward_sequence
from strata.executor.tokenizer import GGUFTokenizer
from strata.executor.weights import WeightStore

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def check_tensors(desc: ModelDescription, expected: dict[str, list[int] | None]) -> None:
    """Refuse a model whose tensors do not match its architecture's hyperparameters.

    ``expected``: name -> GGUF shape, None for an optional tensor (the model class's
    ``expected_shapes``, from the inventory ``strata.common.tensors``). A shape equal up to
    trailing one-element dimensions (``[d, 1]`` for ``[d]``) is the same shape, as llama.cpp's
    loader takes it (``same_up_to_trailing_ones``; the description reads it as ``expected``'s).

    Raises:
        StrataError: a needed tensor is missing or has another shape (names tensor and shapes).
    """
    have = {t.name: t.shape for t in desc.tensors}
    for name, shape in expected.items():
        if name not in have:
            if shape is not None:
                raise StrataError(f"the model has no tensor {name}; the GGUF is incomplete")
        elif shape is not None and not same_up_to_trailing_ones(have[name], shape):
            raise StrataError(
                f"tensor {name} has shape {have[name]} but {desc.architecture.name}'s "
                f"hyperparameters need {shape}; the GGUF is inconsistent"
            )
    unused = sorted(set(have) - set(expected))
    if unused:
        raise StrataError(
            f"the model has tensors the {desc.architecture.name} forward pass does not use "
            f"(e.g. {unused[0]}); this variant of the architecture is not supported yet"
        )


def check_prompt_ids(ids: list[int], vocab_size: int, context: int) -> None:
    """Refuse a prompt a plan can never run (what :meth:`Engine.check_prompt` checks, without an
    engine: ``strata run`` checks its prompt with it before the weights load).

    Args:
        ids: the prompt's token ids.
        vocab_size: the model's vocabulary size (tokens).
        context: the plan's context (``request.context``, tokens per sequence).

    Raises:
        StrataError: empty, ids outside the vocabulary, or no room left in the context.
    """
    if not ids:
        raise StrataError("the prompt is empty; give at least one token")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise StrataError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if len(ids) >= context:
        raise StrataError(
            f"the prompt has {len(ids)} tokens but the plan's context is {context}; "
            "re-plan with a larger --context"
        )


class Engine:
    """A plan made runnable: weights loaded on their tiers, tokenizer and model built.

    Args:
        loaded: a plan whose inputs were checked (``executor.plan_loader.load_plan``).

        expert_cache_mode: override of the expert cache's mode (``executor.experts.CACHE_MODES``:
            ``none``, ``cache``, ``prefetch``); default the plan's (``prefetch`` when it
            prefetches).
        config: the runtime settings (``executor.config``); default
            ``RuntimeConfig.build(plan.runtime)``: the backend's defaults, the plan's kernel
            paths and the environment. Handed to the model, the kernels and the weight streams.
        tokenizer: the tokenizer of ``loaded.gguf``, when the caller already built it (with
            ``GGUFTokenizer.from_gguf(loaded.gguf)``, e.g. to check its prompt before the
            weights load); default: built here from the same file.

    Raises:
        StrataError: unsupported architecture or tensor type, or a plan the executor cannot run.
    """

    def __init__(
        self,
        loaded: LoadedPlan,
        expert_cache_mode: str | None = None,
        config: RuntimeConfig | None = None,
        tokenizer: GGUFTokenizer | None = None,
    ):
        self.loaded = loaded
        arch = loaded.desc.architecture
        model_cls = model_class(arch)
        check_tensors(loaded.desc, model_cls.expected_shapes(arch))
        plan = loaded.plan
        self.dtype = DTYPES[plan.runtime.compute_dtype]
        self.config = config if config is not None else RuntimeConfig.build(plan.runtime)
        here = mx.default_device()
        if plan.runtime.backend != "cpu" and here == mx.cpu:
            print(
                f"warning: this plan was made for a {plan.runtime.backend} machine; running it "
                f"on this CPU in {plan.runtime.compute_dtype} is slow — plan with this "
                "machine's profile",
                file=sys.stderr,
            )
        self.tokenizer = (
            tokenizer if tokenizer is not None else GGUFTokenizer.from_gguf(loaded.gguf)
        )
        self.store = WeightStore(
            loaded.gguf, loaded.desc, plan.tier_of(), self.dtype, self.config.pinned_ram_tier
        )
        self.model = model_cls(arch, self.store, self.dtype, self.config)
        self.store.start_streaming(
            self.model.unit_order(),
            plan.pool.slots,
            plan.prefetch.io_threads or 1,
            stage_direct_reads=self.config.stage_direct_reads,
        )
        ec = plan.expert_cache
        mode = expert_cache_mode or ("prefetch" if ec.prefetch else "cache")
        # Prefetch asked of a plan that chose none: guess a block's top-k, as the planner would.
        prefetch = ec.prefetch or (arch.expert_used_count if mode == "prefetch" else 0)
        self.store.start_expert_cache(
            ec.slots,
            plan.prefetch.io_threads or 1,
            mode,
            prefetch,
            ec.preload,
            loaded.routing,
            stage_direct_reads=self.config.stage_direct_reads,
        )
        self.context = plan.request.context
        self.prefill_chunk = plan.batch.prefill_chunk

    def close(self) -> None:
        """Stop streaming I/O threads (safe to call twice)."""
        self.store.close()

    def logits_for(self, ids: list[int], first: int = 0) -> np.ndarray:
        """Float32 logits after each position ``first..T-1`` of ``ids`` ([T - first, vocab]), for
        teacher-forced checks. Positions before ``first`` go into the KV cache without their rows
        of the output head (Gemma-3's has 262,144 rows: a teacher-forced check of its six
        reference cases took 64 instead of 76 s on the dev CPU), in chunks ending at ``first``.

        Raises:
            StrataError: ``ids`` does not fit the plan's context.
            ValueError: ``first`` is not a position of ``ids``.
        """
        self.check_prompt(ids)
        if not 0 <= first < len(ids):
            raise ValueError(f"logits_for: first {first} is not a position of {len(ids)} ids")
        cache = self.model.make_cache(self.context)
        for start in range(0, first, self.prefill_chunk):
            forward_sequence(self.model, ids[start : min(start + self.prefill_chunk, first)], cache)
        rows = []
        for start in range(first, len(ids), self.prefill_chunk):
            out = forward_sequence(
                self.model, ids[start : start + self.prefill_chunk], cache, all_logits=True
            )
            rows.append(np.array(out))
        return np.concatenate(rows)

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a prompt this plan can never run.

        Raises:
            StrataError: empty, ids outside the vocabulary, or no room left in the context.
        """
        check_prompt_ids(ids, self.loaded.desc.architecture.vocab_size, self.context)
