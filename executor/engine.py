"""Running a loaded plan: tokenizer, weights on their tiers, the forward pass, generation, stats.

The generation loop is short on purpose: chunked prefill of the prompt, then one decode step per
token until an end-of-generation token (kept in the output) or ``max_tokens``.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from strata.common.errors import StrataError
from strata.common.schemas import ModelDescription
from strata.executor.models import model_class
from strata.executor.ops import set_dequant_min_rows, set_mma_rows
from strata.executor.plan_loader import LoadedPlan
from strata.executor.sampling import Sampler, SamplingParams
from strata.executor.tokenizer import GGUFTokenizer, StreamDecoder
from strata.executor.weights import WeightStore

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, bytes.

    On Linux ``VmHWM`` (/proc/self/status), the high-water mark of this program's own memory:
    ``ru_maxrss`` carries over the RSS of the process that started it (exec keeps the larger of
    the two), so a run started from a big process, such as a test runner, would report that
    process's size. Elsewhere ``ru_maxrss`` (bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def check_tensors(desc: ModelDescription, expected: dict[str, list[int] | None]) -> None:
    """Refuse a model whose tensors do not match its architecture's hyperparameters.

    ``expected``: name -> GGUF shape, None for an optional tensor (the model class's
    ``expected_shapes``, from the inventory ``strata.common.tensors``).

    Raises:
        StrataError: a needed tensor is missing or has another shape (names tensor and shapes).
    """
    have = {t.name: t.shape for t in desc.tensors}
    for name, shape in expected.items():
        if name not in have:
            if shape is not None:
                raise StrataError(f"the model has no tensor {name}; the GGUF is incomplete")
        elif shape is not None and have[name] != shape:
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


def expert_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Expert counters between two ``WeightStore.expert_counters`` readings, rates recomputed
    (hit rate over this span's uses, prefetch accuracy over its used + wasted prefetches)."""
    d = {
        k: after[k] - before.get(k, 0) for k in after if k not in ("hit_rate", "prefetch_accuracy")
    }
    if "hits" in d:
        uses = d["hits"] + d["misses"]
        d["hit_rate"] = round(d["hits"] / uses, 6) if uses else 0.0
        done = d["prefetch_used"] + d["prefetch_wasted"]
        d["prefetch_accuracy"] = round(d["prefetch_used"] / done, 6) if done else 0.0
        d["prefetch_pending"] = after["prefetch_pending"]
        d["io_wait_s"] = round(d["io_wait_s"], 6)
    rates = ("hit_rate", "prefetch_accuracy", "io_wait_s")
    return {k: v if k in rates else int(v) for k, v in d.items()}


@dataclass
class Generation:
    """The result of one request.

    Attributes:
        prompt_ids: the prompt's token ids.
        output_ids: generated ids, including a final end-of-generation token if one was produced.
        text: the generated text (special tokens dropped, as llama.cpp does).
        stats: ``prefill_tok_s``, ``decode_tok_s``, ``peak_rss_bytes``, ``peak_mlx_bytes``,
            ``bytes_read`` ({tier: bytes}), ``host_copy_s``, token counts, ``finish_reason``.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    stats: dict = field(default_factory=dict)


class Engine:
    """A plan made runnable: weights loaded on their tiers, tokenizer and model built.

    Args:
        loaded: a plan whose inputs were checked (``executor.plan_loader.load_plan``).

        expert_cache_mode: override of the expert cache's mode (``executor.experts.CACHE_MODES``:
            ``none``, ``cache``, ``prefetch``); default the plan's (``prefetch`` when it
            prefetches).

    Raises:
        StrataError: unsupported architecture or tensor type, or a plan the executor cannot run.
    """

    def __init__(self, loaded: LoadedPlan, expert_cache_mode: str | None = None):
        self.loaded = loaded
        arch = loaded.desc.architecture
        model_cls = model_class(arch)
        check_tensors(loaded.desc, model_cls.expected_shapes(arch))
        plan = loaded.plan
        self.dtype = DTYPES[plan.runtime.compute_dtype]
        set_dequant_min_rows(plan.runtime.dequant_matmul_min_rows)
        set_mma_rows(plan.runtime.mma_matmul_min_rows, plan.runtime.mma_matmul_max_rows)
        here = mx.default_device()
        if plan.runtime.backend != "cpu" and here == mx.cpu:
            print(
                f"warning: this plan was made for a {plan.runtime.backend} machine; running it "
                f"on this CPU in {plan.runtime.compute_dtype} is slow — plan with this "
                "machine's profile",
                file=sys.stderr,
            )
        self.tokenizer = GGUFTokenizer.from_reader(loaded.gguf.reader)
        self.store = WeightStore(loaded.gguf, loaded.desc, plan.tier_of(), self.dtype)
        self.model = model_cls(arch, self.store, self.dtype)
        self.store.start_streaming(
            self.model.unit_order(), plan.pool.slots, plan.prefetch.io_threads or 1
        )
        ec = plan.expert_cache
        mode = expert_cache_mode or ("prefetch" if ec.prefetch else "cache")
        # Prefetch asked of a plan that chose none: guess a block's top-k, as the planner would.
        prefetch = ec.prefetch or (arch.expert_used_count if mode == "prefetch" else 0)
        self.store.start_expert_cache(
            ec.slots, plan.prefetch.io_threads or 1, mode, prefetch, ec.preload, loaded.routing
        )
        self.context = plan.request.context
        self.prefill_chunk = plan.batch.prefill_chunk

    def close(self) -> None:
        """Stop streaming I/O threads (safe to call twice)."""
        self.store.close()

    def prefill(self, ids: list[int], cache) -> mx.array:
        """Run the prompt in chunks of ``prefill_chunk`` tokens; returns the last logits [1, V]."""
        logits = None
        for start in range(0, len(ids), self.prefill_chunk):
            logits = self.model.forward(ids[start : start + self.prefill_chunk], cache)
            mx.eval(logits)
        return logits

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
            self.model.forward(ids[start : min(start + self.prefill_chunk, first)], cache)
        rows = []
        for start in range(first, len(ids), self.prefill_chunk):
            out = self.model.forward(
                ids[start : start + self.prefill_chunk], cache, all_logits=True
            )
            rows.append(np.array(out))
        return np.concatenate(rows)

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a prompt this plan can never run.

        Raises:
            StrataError: empty, ids outside the vocabulary, or no room left in the context.
        """
        if not ids:
            raise StrataError("the prompt is empty; give at least one token")
        vocab = self.loaded.desc.architecture.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise StrataError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(ids) >= self.context:
            raise StrataError(
                f"the prompt has {len(ids)} tokens but the plan's context is {self.context}; "
                "re-plan with a larger --context"
            )

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int = 256,
        on_text: Callable[[str], None] | None = None,
        stop_at_eog: bool = True,
    ) -> Generation:
        """Generate up to ``max_tokens`` tokens after ``prompt_ids``.

        Generation stops at the GGUF's end-of-generation tokens (kept in ``output_ids``), at
        ``max_tokens``, or at the plan's context (``finish_reason`` says which).

        Args:
            prompt_ids: token ids of the prompt.
            params: sampling parameters (temperature 0 = greedy).
            max_tokens: most tokens to generate.
            on_text: called with each new piece of text as it is decoded (never a split UTF-8
                character).
            stop_at_eog: stop at an end-of-generation token (benchmarks run a fixed length).

        Raises:
            StrataError: empty prompt, ids outside the vocabulary, prompt longer than the context.
        """
        if max_tokens < 0:
            raise StrataError(f"--max-tokens {max_tokens} is negative")
        self.check_prompt(prompt_ids)
        sampler = Sampler(params)
        stream = StreamDecoder(self.tokenizer)
        eog = self.tokenizer.eog_ids
        read0 = self.store.counters()
        experts0 = self.store.expert_counters()
        copy0 = self.store.copy_seconds
        mx.reset_peak_memory()
        cache = self.model.make_cache(self.context)

        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids, cache)
        t_prefill = time.perf_counter() - t0
        read_p, copy_p = self.store.counters(), self.store.copy_seconds
        experts_p = self.store.expert_counters()
        out: list[int] = []
        finish = "length"
        t1 = time.perf_counter()
        decode_steps = 0
        while len(out) < max_tokens:
            tok = sampler(np.array(logits[0]))
            sampler.observe([tok])
            out.append(tok)
            if on_text is not None:
                piece = stream.push(tok)
                if piece:
                    on_text(piece)
            if stop_at_eog and tok in eog:
                finish = "stop"
                break
            if len(out) >= max_tokens:
                break
            if cache.offset + 1 > self.context:
                finish = "context"
                break
            logits = self.model.forward([tok], cache)
            mx.eval(logits)
            decode_steps += 1
        t_decode = time.perf_counter() - t1
        if on_text is not None:
            tail = stream.flush()
            if tail:
                on_text(tail)
        read1 = self.store.counters()
        stats = {
            "prompt_tokens": len(prompt_ids),
            "output_tokens": len(out),
            "finish_reason": finish,
            "prefill_s": round(t_prefill, 6),
            "prefill_tok_s": round(len(prompt_ids) / t_prefill, 3) if t_prefill > 0 else 0.0,
            "decode_s": round(t_decode, 6),
            "decode_tok_s": round(decode_steps / t_decode, 3) if decode_steps else 0.0,
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_mlx_bytes": int(mx.get_peak_memory()),
            "decode_steps": decode_steps,
            "bytes_read": {t: int(read1[t] - read0[t]) for t in ("gpu", "ram", "nvme")},
            "decode_bytes_read": {t: int(read1[t] - read_p[t]) for t in ("gpu", "ram", "nvme")},
            "io_wait_s": round(read1["io_wait_s"] - read0["io_wait_s"], 6),
            "decode_io_wait_s": round(read1["io_wait_s"] - read_p["io_wait_s"], 6),
            "host_copy_s": round(self.store.copy_seconds - copy0, 6),
            "decode_host_copy_s": round(self.store.copy_seconds - copy_p, 6),
        }
        if self.loaded.desc.architecture.expert_count:
            experts1 = self.store.expert_counters()
            stats["experts"] = expert_delta(experts0, experts1)
            stats["decode_experts"] = expert_delta(experts_p, experts1)
        return Generation(prompt_ids, out, self.tokenizer.decode(out), stats)
