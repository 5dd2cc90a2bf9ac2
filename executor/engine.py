"""A loaded plan made runnable: tokenizer, weights on their tiers, the model's forward pass.

Requests run on the serving engine over it (``executor.serving``; one request with its figures:
``executor.generate``); :meth:`Engine.logits_for` gives teacher-forced logits for checks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import numpy as np
from strata.common.cluster import check_cluster_placement, stage_description, stage_view
from strata.common.errors import SchemaError, StrataError
from strata.common.schemas import ModelDescription
from strata.common.tensors import same_up_to_trailing_ones
from strata.executor.config import RuntimeConfig
from strata.executor.models import model_class
from strata.executor.pipeline import Peer, Pipeline, Ring, serve_stage
from strata.executor.plan_loader import LoadedPlan
from strata.executor.ranks import RankSet, plan_identity
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


def cluster_stage(loaded: LoadedPlan, rank: int) -> LoadedPlan:
    """Rank ``rank``'s stage of a cluster plan as a loaded one-host plan of its own units
    (``strata.common.cluster.stage_view``, ``stage_description``), the whole plan checked first.

    Raises:
        StrataError: units on hosts the stages do not say, a rank the plan has no stage for, or
            what cluster plans do not run yet (speculative decoding).
    """
    plan = loaded.plan
    try:
        check_cluster_placement(plan)
        view = stage_view(plan, rank)
    except SchemaError as e:
        raise StrataError(f"{loaded.path}: {e}") from None
    if plan.speculative.method != "none":
        raise StrataError(
            f"{loaded.path}: speculative decoding ({plan.speculative.method}) does not run on "
            "cluster plans yet; re-plan with --speculative none"
        )
    ranges = [(s.first_block, s.end_block) for s in plan.cluster.stages]
    desc = stage_description(loaded.desc, ranges, rank)
    return replace(loaded, plan=view, desc=desc)


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
        rank: on a cluster plan, the rank this process is (``strata.common.cluster``): it loads
            only its stage; rank 0 starts the other ranks (``executor.ranks``) and passes
            through them (``executor.pipeline``), the others serve their stage
            (:meth:`serve_stage`). Ignored on a one-host plan.

    Raises:
        StrataError: unsupported architecture or tensor type, or a plan the executor cannot run;
            on a cluster plan, a rank that did not start or join (names it).
    """

    def __init__(
        self,
        loaded: LoadedPlan,
        expert_cache_mode: str | None = None,
        config: RuntimeConfig | None = None,
        tokenizer: GGUFTokenizer | None = None,
        rank: int = 0,
    ):
        self.loaded = loaded
        arch = loaded.desc.architecture
        model_cls = model_class(arch)
        check_tensors(loaded.desc, model_cls.expected_shapes(arch))
        self.rank, self.ranks, self.pipeline = rank, None, None
        stage = loaded
        if loaded.plan.cluster is not None:
            stage = cluster_stage(loaded, rank)
            if rank == 0:  # the other ranks load their stages while this one loads its own
                self.ranks = RankSet(loaded.path, loaded.gguf.path, loaded.plan.cluster.stages)
                self.ranks.start()
        try:
            self._load(stage, model_cls, expert_cache_mode, config, tokenizer)
            if self.ranks is not None:
                self._join()
        except BaseException:
            self.close()
            raise

    def _load(
        self,
        loaded: LoadedPlan,
        model_cls,
        expert_cache_mode: str | None,
        config: RuntimeConfig | None,
        tokenizer: GGUFTokenizer | None,
    ) -> None:
        """The rest of ``__init__`` for ``loaded``, a one-host plan or this rank's stage."""
        arch = loaded.desc.architecture
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
        if tokenizer is None and self.rank == 0:  # the other ranks see no text
            tokenizer = GGUFTokenizer.from_gguf(loaded.gguf)
        self.tokenizer = tokenizer
        self.store = WeightStore(
            loaded.gguf,
            loaded.desc,
            plan.tier_of(),
            self.dtype,
            self.config.pinned_ram_tier,
            pack_desc=self.loaded.desc,
        )
        self.model = model_cls(arch, self.store, self.dtype, self.config)
        if self.loaded.plan.cluster is not None:
            s = self.loaded.plan.cluster.stages[self.rank]
            self.model.stage = (s.first_block, s.end_block)
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

    def _join(self) -> None:
        """Rank 0 of a cluster plan: wait for the other ranks to join the ring, then pass
        through them (``executor.pipeline``), watched (a child that dies breaks the pipeline
        at once, so that the server says so even between requests)."""
        ranks = self.ranks
        group = ranks.join(plan_identity(self.loaded.plan))
        stages = self.loaded.plan.cluster.stages

        def fail(message: str) -> None:  # the ring is broken: no rank can go on
            ranks.kill()

        ring = self._ring(group)
        dtypes = [DTYPES[s.runtime.compute_dtype] for s in stages]
        planned = self.loaded.plan.cluster.prediction
        micro = self.config.decode_micro_batches or (planned.micro_batches if planned else 1)
        self.pipeline = Pipeline(
            ring,
            dtypes,
            fail,
            ranks.explain,
            ranks.ring,
            flow=self.config.pipeline_flow,
            micro_batches=micro,
        )
        self.model.pipeline = self.pipeline

        def dead(message: str) -> None:  # seen between passes: said in the server's log too
            print(f"error: the cluster stopped: {message}", file=sys.stderr, flush=True)
            self.pipeline.fail(f"the cluster stopped: {message}")

        ranks.watch(dead)

    def _ring(self, group) -> Ring:
        """The sends and receives of ``group``, each rank named by its stage's host."""
        stages = self.loaded.plan.cluster.stages
        return Ring(group, lambda r: Peer(r, stages[r].host, stages[r].address))

    def serve_stage(self, group, wait: Callable[[], bool] = lambda: True) -> None:
        """A rank past 0 of a cluster plan: run its blocks of every pass rank 0 sends until it
        says stop (``executor.pipeline.serve_stage``; ``wait``: its doorbell), on a KV cache of
        its own layers.

        Raises:
            ClusterError: a neighbouring rank stopped.
        """
        stages = self.loaded.plan.cluster.stages
        ring = self._ring(group)
        b = self.loaded.plan.batch
        kv = self.model.make_paged_cache(b.kv_num_blocks, b.kv_block_size)
        kv.keep_layers(*self.model.stage)
        sender = DTYPES[stages[ring.prev].runtime.compute_dtype]
        serve_stage(self.model, kv, ring, sender, wait)

    def close(self) -> None:
        """Stop the other ranks (rank 0 of a cluster plan) and the streaming I/O threads (safe
        to call twice)."""
        if self.ranks is not None:
            self.ranks.quiet()
        if self.pipeline is not None:
            self.pipeline.stop()
        if self.ranks is not None:
            self.ranks.stop()
        if hasattr(self, "store"):
            self.store.close()

    def logits_for(self, ids: list[int], first: int = 0) -> np.ndarray:
        """Float32 logits after each position ``first..T-1`` of ``ids`` ([T - first, vocab]), for
        teacher-forced checks. Positions before ``first`` go into the KV cache without their rows
        of the output head (Gemma-3's has 262,144 rows: a teacher-forced check of its six
        reference cases took 64 instead of 76 s on the dev CPU), in chunks ending at ``first``.

        Raises:
            StrataError: ``ids`` does not fit the plan's context; a cluster plan (its other
                ranks' KV caches are the serving engine's).
            ValueError: ``first`` is not a position of ``ids``.
        """
        if self.pipeline is not None:
            raise StrataError(
                "teacher-forced logits run on one-host plans only; give a plan made with "
                "strata plan --profile"
            )
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
