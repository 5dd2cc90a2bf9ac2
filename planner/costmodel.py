"""The cost model: time of a decode step and of prefill, and memory of a placement, as pure
functions.

The ILP (``planner.ilp``) builds its linear expressions from the coefficients defined here, and
``score`` evaluates the very same model on pinned variables (a tier per unit and a prefetch depth),
which is how the brute-force test, ``explain``, ``diff`` and calibration judge any plan.

Symbols (per unit u of the model description): ``b_u`` bytes in MLX form, ``a_u`` fraction of the
unit one decoded token reads, ``f_u`` FLOPs of one decoded token, ``k_u`` MLX graph operations the
executor builds for it in one step (``OPS_PER_UNIT`` by role). ``B`` is the decode batch: 1 for the
``latency`` objective, ``request.concurrency`` for ``throughput``. A step reads unit u whenever at
least one of its B sequences needs it; with independent routing (the same assumption as the
description's uniform top-k/n) that happens with probability ``a_u(B) = 1 - (1 - a_u)^B``, which is
``a_u`` at B = 1 and 1 for dense units. Rates come from the hardware profile: ``gpu_bw``
(gpu.memory_bandwidth_bytes_s), ``mv_flops`` (gpu.decode_matvec_flops_s: a 4-bit quantized
matrix-vector product, the kernel of a decoded token), ``bt_flops`` (gpu.decode_batch_flops_s:
the same kernel on 16 decoded tokens; gpu.compute_flops_s, a prefill-sized matrix product, where
the profile lacks it), ``op_s`` (gpu.op_overhead_s), ``h2d_bw``
(ram.host_to_device_bytes_s), ``nvme_bw`` (nvme.read_bytes_s).

Time of one decode step (seconds):

- ``compute_s   = sum_u [max(a_u(B) * b_u / gpu_bw, f_u / mv_flops, B * f_u / bt_flops)
  + k_u * op_s]`` — a roofline per unit: the kernels cannot finish before the weights are read
  from device memory once, nor before one token's matrix-vector products run at the measured
  matvec rate (on MLX's CPU backend that rate, not the bandwidth, binds: dequantizing is the
  work), nor before B tokens' FLOPs run at the measured decode-batch rate (on the CPU backend
  about the matvec rate: its quantized matmul costs in proportion to its rows); plus a
  fixed cost per graph operation (building it in Python, dispatching and launching it), which
  is what bounds small models on fast GPUs. Every unit is read from device memory by the kernels
  wherever it is stored, so compute does not depend on placement. On backends where the executor
  schedules the blocks as they are built (``OVERLAPPED_BACKENDS``: CUDA, where
  ``RuntimeConfig.async_eval_blocks`` is on: every 2 blocks), the host builds the next
  blocks while the device computes the last ones, so a dense model's step compute is
  ``max(sum_u roofline_u, sum_u k_u op_s)`` instead of their sum (``host_overlaps``,
  ``step_compute_s``).
- ``host_copy_s = sum_{u on ram} a_u(B) * b_u / h2d_bw``
  ``          [+ sum_{u on nvme} a_u(B) * b_u / h2d_bw  when memory is not unified]`` — a direct-I/O
  read lands in host memory and must then be copied to the device; on unified memory the pool slot
  is what the GPU reads.
- ``disk_s      = sum_{u on nvme} a_u(B) * b_u / nvme_bw``.
- ``io_stall_s`` (depth 1 only) ``= sum over blocks i whose attention and FFN both stream of
  max(0, read(ffn_i) - compute(attn_i))``. The executor reads ``depth`` streamed units ahead
  into ``depth + 1`` slots, so at depth 1 the read of ``ffn_i`` cannot start until ``ffn_{i-1}``
  frees its slot when ``attn_i`` sits in the other one: it overlaps only ``attn_i``'s compute,
  and the compute thread waits for the rest. At depth >= 2 (or when attention stays resident)
  the read also overlaps the previous FFN's compute, which the bottleneck below covers.
- The executor copies RAM-tier units on the compute thread when they are used (synchronous) while
  I/O threads read NVMe units ``depth`` units ahead, so
  ``step_s = max(compute_s + host_copy_s + io_stall_s, disk_s)`` when depth >= 1 and
  ``step_s = compute_s + host_copy_s + disk_s`` when depth = 0 (reads are synchronous).
- ``decode_tok_s = B / step_s``.

Prefill (``prefill_chunk``, ``ttft``). The executor runs a prompt in chunks of ``c`` tokens (the
plan's ``batch.prefill_chunk``), each chunk a forward pass over every unit, one sequence at a
time. Per chunk of ``r`` tokens, with ``a_u(r) = 1 - (1 - a_u)^r`` (about 1 for every expert once
a chunk has hundreds of tokens) and ``flops`` = gpu.compute_flops_s (a prefill-sized matrix
product, the kernel of a chunk):

- ``compute_r   = sum_u [max(a_u(r) b_u / gpu_bw, r f_u / flops) + k_u op_s]`` (ops weighted by
  ``a_u(r)`` for experts; summed or overlapped as in ``step_compute_s``);
- ``host_copy_r = sum_{u on ram} a_u(r) b_u / h2d_bw [+ nvme units when memory is not unified]``:
  a ram unit is copied again for every chunk;
- ``disk_r      = sum_{dense u on nvme} b_u / nvme_bw``: a streamed unit is read again for every
  chunk, whole however few tokens the chunk has;
- ``miss_r      = sum_{streamed experts not cached} a_u(r) b_u / nvme_bw``: the cache's hot set
  (the same ``hottest_streamed`` count as decode) hits, every other streamed expert is read,
  synchronously: a chunk's router chooses nearly every expert of its block, which a prefetch of
  ``m`` guesses does not cover, so the model counts no overlap for them (their copies join
  ``host_copy_r`` where memory is not unified);
- ``chunk_r = max(compute_r + host_copy_r + miss_r, disk_r + miss_r)`` at depth >= 1 and
  ``compute_r + host_copy_r + disk_r + miss_r`` at depth 0 (``step_terms``, as a decode step).
  The depth-1 I/O stall is left out of prefill: a chunk's compute per unit is hundreds of times
  a decoded token's, so a streamed FFN's read hides behind its attention's compute unless the
  disk binds anyway.

``TTFT(P) = F chunk_c + chunk_l`` with ``F = ceil(P / c) - 1`` full chunks and a last chunk of
``l = P - F c`` tokens (its compute scales with its rows, its dense reads stay whole). The first
token is sampled from the last chunk's logits, so no decode step is added; sampling itself and
the attention over the cached prefix (quadratic in P, small beside the weights below tens of
thousands of tokens) are not modelled. ``Prediction.prefill_chunk_s = chunk_c`` and
``Prediction.ttft_s = [TTFT(shortest), TTFT(longest)]`` of ``request.prompt_tokens``.

Objective (``objective``), seconds per generated token of whole requests of ``N =
request.output_tokens`` tokens: ``(B * TTFT + (N - 1) * step_s) / (B * N)``, with ``TTFT`` the
mean of the TTFT at the shortest and the longest prompt. B prompts are prefilled one after
another (a chunk serves one sequence), then decoded together; the first token of each comes from
its prefill, the other ``N - 1`` from decode steps. At B = 1 (latency) this is a request's time
per token. The mean of the two ends is the expected TTFT of prompts spread evenly over the range
where TTFT is linear in P (it is, up to the chunk staircase), it weighs both ends' chunk counts,
and it is what ``Prediction.ttft_s`` records, so the objective is a function of the prediction
(``explain`` shows exactly what the ILP minimized). Where the chunk costs little beside the
decode steps (short prompts, chat) the objective is about ``step_s / B``, the decode objective;
long prompts shift it toward placements whose per-chunk copies and reads are cheap (ram copies
against nvme reads, weights kept on the gpu tier) — so a plan for long prompts can differ from
one for chat.

Why a bottleneck and not a per-layer overlap formulation: the executor runs the same unit sequence
every step and its I/O threads wrap around into the next step's units, so in steady state the disk
and the compute thread each work for their total time per step and the step lasts as long as the
busier of the two. That is exact for uniform layers (given ``io_stall_s``) and needs one
continuous variable and a few rows, where a per-layer model needs an ordering of units,
start-time variables per unit and per depth (O(units x depth) big-M rows) and a cyclic boundary;
it would also depend on the executor's unit order, which the plan does not fix. The price: apart
from the attention/FFN interleave that ``io_stall_s`` charges, the model is optimistic when
streamed units cluster (a run of NVMe units with little compute between them needs a deep
prefetch to hide), and depth >= 3 buys nothing in it. Calibration against measured steps is
where that shows.

Mixture-of-experts (per expert unit u = one expert of one block, access ``a_u``: uniform
``k/n`` or measured by a routing profile):

- pinned (gpu) and ram experts cost as any unit; an expert's graph operations run only when a
  token chooses it, so its ``k_u * op_s`` is weighted by ``a_u(B)`` too.
- nvme experts go through the expert cache: ``K`` device slots of ``slot_e`` bytes (the largest
  expert), evicting the expert chosen least often (LFU on the executor's routing counts).
  ``k + m`` of them are working slots (a block's top-k being computed and the ``m`` experts
  prefetched for the next block), and the model counts the other ``K - k - m`` as holding the
  streamed experts with the largest ``a_u * b_u`` — the hot set an LFU cache converges to under
  stationary routing. Every other streamed use misses:
  ``M = sum_{u on nvme, not cached} read_u`` seconds of reads.
- prefetch: after block l routes, the executor reads the ``m`` experts of block l + 1 that the
  co-activation counts predict. A share ``alpha`` of the misses was predicted (the routing
  profile's measured recall; ``m / n``, a blind guess, without one), and those reads overlap
  compute; the rest are read synchronously after the router. The guesses are read whether or
  not they are chosen, at about the rate misses occur: ``(m / k) M``. So the compute thread adds
  ``(1 - alpha) M`` and the disk ``(1 - alpha + m / k) M``:
  ``step_s = max(compute + host_copy + io_stall + (1 - alpha) M, disk + (1 - alpha + m / k) M)``
  (depth >= 1 for the dense units; at depth 0 the first term also adds the dense ``disk``).
- the predicted hit rate of streamed-expert uses is ``(A_cached + alpha A_missed) / A_nvme``
  (access summed over the cached, missed and all streamed experts): prefetched experts count
  as hits when used, as the executor counts them.

Memory (bytes), per capacity row (``capacity_rows``):

- gpu: weights on gpu + KV cache + activations + pool <= gpu capacity, where
  ``KV = kv_num_blocks * kv_block_size * kv_elements_per_token * dtype_bytes`` (the paged cache the
  executor allocates: ``concurrency * ceil(context/16)`` blocks of 16 tokens, so context rounded up
  to whole blocks), ``pool = slots * slot_bytes`` (``slots = depth + 1`` when a dense unit streams,
  else 0; ``slot_bytes`` = the largest streamed dense unit), the expert cache ``K * slot_e``,
  activations per ``activation_bytes``, and for hybrid linear-attention models (qwen3next) the
  recurrent state, ``max_num_seqs * recurrent_state_elements_per_sequence * 4`` (fixed per
  sequence, not per token: ``recurrent_state_bytes``; ``kv_elements_per_token`` counts only the
  full-attention blocks).
- ram: weights on ram [+ pool and expert cache when memory is not unified: the host staging
  buffers the direct-I/O reads land in] <= ram capacity (non-unified machines only).
- unified memory: gpu row + weights on ram <= ram capacity (GPU and CPU share one memory, so the
  device working set and the RAM tier come out of the same bytes).
- nvme is unbounded: the model file already lives there.

Capacities: gpu = ``request.gpu_budget_bytes`` or ``profile.gpu.working_set_bytes``; ram =
``request.ram_budget_bytes`` or ``profile.ram.capacity_bytes - profile.os_reserve_bytes``.

Not modelled (yet): the evaluation the executor forces after each streamed unit to free its slot
(tens of microseconds each: a few percent of a tiny model's step on a GPU, nothing on a large
one), KV-cache reads per step (constant in the placement), attention-score buffers of a prefill
chunk (the fused SDPA kernels do not materialize them), temporal locality of expert routing
beyond the static frequencies (the cache may beat the model's count when routing repeats within
a text, and trails it while its counts are still young), and partial reads: an untied
embedding streamed whole still reserves a whole-unit pool slot, and disk reads are counted in
MLX-form bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from strata.common.errors import PlanError
from strata.common.op_counts import OPS_PER_UNIT, OVERLAPPED_BACKENDS
from strata.common.schemas import (
    TIERS,
    BatchLimits,
    ExpertCache,
    Figure,
    HardwareProfile,
    ModelDescription,
    Plan,
    Pool,
    Prediction,
    Request,
    Runtime,
    TierMemory,
    UnitInfo,
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per element of the activation / KV-cache dtype (``profile.compute_dtype``)."""

LOGIT_BYTES = 4
"""Bytes per logit: sampling works on float32 logits whatever the compute dtype."""

KV_BLOCK_SIZE = 16
"""Tokens per paged KV-cache block (vLLM's default)."""

PREFILL_CHUNK = 512
"""Largest prefill chunk, tokens (a fixed choice for now, not an ILP variable)."""

MAX_DEPTH = 8
"""Largest prefetch depth the ILP considers."""

BINDING_TOL = 0.005
"""A constraint binds when its left side is within this fraction of its bound."""

TERM_OVERLAP_COMPUTE = "step = compute + host copy + I/O stall"
TERM_OVERLAP_DISK = "step = disk"
TERM_SERIAL = "step = compute + host copy + disk (no prefetch)"


# --------------------------------------------------------------------------- request-derived sizes


def batch_size(request: Request, batch: BatchLimits | None = None) -> int:
    """Sequences decoded per step: 1 for ``latency``, ``concurrency`` for ``throughput``.

    Args:
        request: the plan's request.
        batch: a plan's batch limits; when given, ``max_num_seqs`` caps the batch (hand-written
            plans may allow fewer sequences than requested).
    """
    b = 1 if request.objective == "latency" else request.concurrency
    return min(b, batch.max_num_seqs) if batch is not None else b


def rate_label(request: Request, batch: BatchLimits | None = None) -> str:
    """What a predicted decode rate counts, for printing after "N tok/s": " aggregate (B
    sequences)" for a batch, " for one sequence (latency objective)" where the plan serves
    several sequences but was optimized for one, else nothing."""
    b = batch_size(request, batch)
    if b > 1:
        return f" aggregate ({b} sequences)"
    return " for one sequence (latency objective)" if request.concurrency > 1 else ""


def batch_limits(request: Request) -> BatchLimits:
    """Continuous-batching limits; fixed choices for now (not ILP variables).

    ``max_num_seqs = concurrency``; ``kv_block_size = 16``; ``kv_num_blocks = concurrency *
    ceil(context / 16)`` (every sequence may reach the full context); ``prefill_chunk = min(512,
    context)``; ``max_num_batched_tokens = max(prefill_chunk, concurrency)`` (one step can carry a
    whole chunk, or one decode token per sequence).
    """
    chunk = min(PREFILL_CHUNK, request.context)
    return BatchLimits(
        max_num_seqs=request.concurrency,
        max_num_batched_tokens=max(chunk, request.concurrency),
        kv_block_size=KV_BLOCK_SIZE,
        kv_num_blocks=request.concurrency * math.ceil(request.context / KV_BLOCK_SIZE),
        prefill_chunk=chunk,
    )


def kv_cache_bytes(desc: ModelDescription, profile: HardwareProfile, batch: BatchLimits) -> int:
    """Bytes of the paged KV cache on the device.

    ``kv_num_blocks * kv_block_size * kv_elements_per_token * dtype_bytes(compute_dtype)``.
    """
    tokens = batch.kv_num_blocks * batch.kv_block_size
    return tokens * desc.kv_elements_per_token * DTYPE_BYTES[profile.compute_dtype]


RECURRENT_STATE_DTYPE_BYTES = 4
"""A hybrid's recurrent state is float32 whatever the compute dtype (llama.cpp's ``type_r`` and
``type_s``; a delta rule accumulated in half precision drifts)."""


def recurrent_state_bytes(desc: ModelDescription, batch: BatchLimits) -> int:
    """Bytes of a hybrid model's recurrent states on the device: one fixed state per sequence
    the batch may hold (``max_num_seqs``), whatever the context —
    ``max_num_seqs * recurrent_state_elements_per_sequence * 4`` (conv state + delta-net state of
    every gated delta-net block: ``strata.common.describe.recurrent_state_elements``). 0 for a
    model without such blocks."""
    elements = batch.max_num_seqs * desc.recurrent_state_elements_per_sequence
    return elements * RECURRENT_STATE_DTYPE_BYTES


def activation_bytes(desc: ModelDescription, profile: HardwareProfile, batch: BatchLimits) -> int:
    """Bytes of the activations of the largest step (device tier).

    ``max_num_batched_tokens * (2 d + (2 n_head + 2 n_kv) * head_dim + 3 ff_e) * dtype_bytes
    + max_num_seqs * vocab * 4``: per token the residual stream and its normed copy (2 d), Q, K,
    V and the attention output ((2 n_head + 2 n_kv) * head_dim), the FFN gate, up and their product
    (3 ff_e, with ``ff_e = expert FFN width * expert_used_count + shared expert width`` for
    MoE, at least ``feed_forward_length`` where leading blocks are dense), summed
    rather than maxed over the attention and FFN phases (a conservative bound; a hybrid's token
    mixer is the wider of its gated attention and its gated delta-net); plus one float32
    vocabulary row of logits per sequence (only a sequence's last token is sampled).
    """
    a = desc.architecture
    ff_e = a.feed_forward_length
    if a.expert_count:  # the chosen experts' widths, and a shared expert's
        ff_e = (a.expert_feed_forward_length or a.feed_forward_length) * a.expert_used_count
        ff_e += a.expert_shared_feed_forward_length
        # DeepSeek-style shared experts (expert_shared_count expert widths); leading dense
        # blocks run a feed_forward_length-wide FFN: the wider of the two phases.
        ff_e += a.expert_shared_count * (a.expert_feed_forward_length or a.feed_forward_length)
        if a.leading_dense_block_count:
            ff_e = max(ff_e, a.feed_forward_length)
    mixer = (2 * a.head_count + 2 * a.head_count_kv) * a.head_dim
    if a.recurrent_layers:
        # Hybrids: the gated query's gate (n_head * head_dim more), or a delta-net block's
        # Q/K/V before and after its convolution (2 (2k + v)), output gate and output (2 v),
        # beta and alpha (2 value heads), whichever is wider.
        k, v = a.ssm_state_size * a.ssm_group_count, a.ssm_inner_size
        mixer = max(mixer + a.head_count * a.head_dim, 4 * k + 4 * v + 2 * a.ssm_time_step_rank)
    width = 2 * a.embedding_length + mixer + 3 * ff_e
    per_step = batch.max_num_batched_tokens * width * DTYPE_BYTES[profile.compute_dtype]
    return per_step + batch.max_num_seqs * a.vocab_size * LOGIT_BYTES


# --------------------------------------------------------------------------- time coefficients


@dataclass(frozen=True)
class UnitCost:
    """One unit's contributions to a decode step at batch B (seconds, bytes)."""

    name: str
    bytes: int
    device_s: float
    """``max(a_u(B) b_u / gpu_bw, f_u / mv_flops, B f_u / bt_flops)``: the device's roofline, the
    same on every tier."""
    ops_s: float
    """``k_u op_s``: the host's building and launching of the unit's operations, which
    ``step_compute_s`` overlaps with the device's work where ``host_overlaps``."""
    copy_s: float
    """``a_u(B) * b_u / h2d_bw``: one host -> device copy of what a step reads."""
    read_s: float
    """``a_u(B) * b_u / nvme_bw``: one direct-I/O read of what a step reads."""

    @property
    def compute_s(self) -> float:
        """``device_s + ops_s``: the unit alone, host and device in series."""
        return self.device_s + self.ops_s

    def host_copy_s(self, tier: str, unified: bool) -> float:
        """Host-copy seconds this unit adds on ``tier`` (ram always; nvme when not unified)."""
        if tier == "ram" or (tier == "nvme" and not unified):
            return self.copy_s
        return 0.0

    def disk_s(self, tier: str) -> float:
        """Disk seconds this unit adds on ``tier`` (nvme only)."""
        return self.read_s if tier == "nvme" else 0.0


def host_overlaps(desc: ModelDescription, profile: HardwareProfile) -> bool:
    """Whether a decode step's host operations overlap its device work (``step_compute_s``): on
    ``OVERLAPPED_BACKENDS``, for dense models. A MoE block brings its router's choice to the
    host (``executor.models.llama.LlamaModel.moe_ffn``), so the host waits for the device in
    every block. Units on ram or nvme are evaluated as they are released, which this does not
    model (it depends on the placement, which the compute term does not): such plans are
    usually bound by their copies or reads."""
    return profile.backend in OVERLAPPED_BACKENDS and all(u.expert is None for u in desc.units)


def step_compute_s(costs: Sequence[UnitCost], overlapped: bool) -> float:
    """The compute term of a decode step over ``costs``' units (seconds): ``sum_u (roofline_u +
    k_u op_s)`` where the host builds the whole pass before the device starts, ``max(sum_u
    roofline_u, sum_u k_u op_s)`` where they ``overlapped`` (``host_overlaps``); the overlapped
    form is the one that matched a measured GPU step
    (docs/kernels.md#scheduling-blocks-as-they-are-built)."""
    device = sum(c.device_s for c in costs)
    host = sum(c.ops_s for c in costs)
    return max(device, host) if overlapped else device + host


def _rate(value: float, what: str) -> float:
    if value <= 0:
        raise PlanError(
            f"hardware profile has {what} = 0; measure it (strata profile) or fix the profile"
        )
    return value


def unit_costs(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    batch: BatchLimits | None = None,
) -> list[UnitCost]:
    """Per-unit time coefficients, in ``desc.units`` order.

    Args:
        desc: the model description (bytes_mlx, access_per_token, flops_per_token, role per unit).
        profile: bandwidths (bytes/s), compute throughputs (FLOP/s), per-op overhead (seconds).
        request: the objective decides the batch B (``batch_size``).
        batch: a plan's batch limits (caps B), or None.

    Raises:
        PlanError: a bandwidth or the compute throughput in the profile is zero.
    """
    mv_flops = _rate(profile.gpu.decode_matvec_flops_s.value, "gpu.decode_matvec_flops_s")
    b = batch_size(request, batch)
    # B tokens' products run at the measured decode-batch rate (on MLX's CPU backend that is the
    # matvec rate: a 16-row 4-bit product costs 16 single rows, docs/kernels.md#kernel-paths).
    measured = profile.gpu.decode_batch_flops_s
    bt_flops = (
        _rate(profile.gpu.compute_flops_s.value, "gpu.compute_flops_s")
        if measured is None
        else _rate(measured.value, "gpu.decode_batch_flops_s")
    )
    return _pass_costs(desc, profile, b, lambda f: max(f / mv_flops, b * f / bt_flops))


def _pass_costs(
    desc: ModelDescription, profile: HardwareProfile, rows: int, flops_s: Callable[[int], float]
) -> list[UnitCost]:
    """Per-unit coefficients of a pass in which ``rows`` tokens read the units (a decode step's
    B sequences, or one prefill chunk): access ``a_u(rows) = 1 - (1 - a_u)^rows`` (P(at least
    one token reads the unit) under independent routing), the device's roofline ``max(a_u(rows)
    b_u / gpu_bw, flops_s(f_u))``, ``k_u op_s`` (weighted by ``a_u(rows)`` for experts, whose
    operations run only when chosen), and the copy and read of what the pass reads.

    Raises:
        PlanError: a bandwidth in the profile is zero.
    """
    gpu_bw = _rate(profile.gpu.memory_bandwidth_bytes_s.value, "gpu.memory_bandwidth_bytes_s")
    op_s = profile.gpu.op_overhead_s.value
    h2d_bw = _rate(profile.ram.host_to_device_bytes_s.value, "ram.host_to_device_bytes_s")
    nvme_bw = _rate(profile.nvme.read_bytes_s.value, "nvme.read_bytes_s")
    out = []
    for u in desc.units:
        access = 1.0 - (1.0 - u.access_per_token) ** rows
        moved = access * u.bytes_mlx
        ops = OPS_PER_UNIT[u.role] * (access if u.role == "expert" else 1.0)
        out.append(
            UnitCost(
                name=u.name,
                bytes=u.bytes_mlx,
                device_s=max(moved / gpu_bw, flops_s(u.flops_per_token)),
                ops_s=ops * op_s,
                copy_s=moved / h2d_bw,
                read_s=moved / nvme_bw,
            )
        )
    return out


# --------------------------------------------------------------------------- capacities


@dataclass(frozen=True)
class CapacityRow:
    """One memory constraint: ``sum of weights on weight_tiers + fixed + [pool] <= capacity``."""

    name: str
    """Stable constraint name, as listed in ``Prediction.binding``."""
    tier_label: str
    """How error messages call the memory, e.g. ``gpu tier``."""
    capacity: int
    weight_tiers: tuple[str, ...]
    fixed: tuple[tuple[str, int], ...]
    """Placement-independent parts held here: (label, bytes), e.g. KV cache, activations."""
    counts_pool: bool
    budget_flag: str
    """The ``plan.py`` option that raises this capacity, for infeasibility messages."""

    def used(self, weights: Mapping[str, int], pool_bytes: int) -> int:
        """Bytes this row holds, given weight bytes per tier and the pool's bytes."""
        return (
            sum(weights.get(t, 0) for t in self.weight_tiers)
            + sum(b for _, b in self.fixed)
            + (pool_bytes if self.counts_pool else 0)
        )


def capacities(profile: HardwareProfile, request: Request) -> dict[str, int]:
    """Capacity in bytes of the gpu and ram tiers (request budgets override the profile).

    gpu = ``gpu_budget_bytes`` or ``gpu.working_set_bytes``; ram = ``ram_budget_bytes`` or
    ``ram.capacity_bytes - os_reserve_bytes`` (never below 0).
    """
    gpu = request.gpu_budget_bytes
    if gpu is None:
        gpu = int(profile.gpu.working_set_bytes.value)
    ram = request.ram_budget_bytes
    if ram is None:
        ram = max(0, int(profile.ram.capacity_bytes.value - profile.os_reserve_bytes.value))
    return {"gpu": gpu, "ram": ram}


def capacity_rows(
    desc: ModelDescription,
    profile: HardwareProfile,
    request: Request,
    batch: BatchLimits | None = None,
) -> list[CapacityRow]:
    """The memory constraints of a request on a machine (see the module docstring).

    Args:
        batch: the plan's batch limits; default ``batch_limits(request)``.
    """
    batch = batch or batch_limits(request)
    cap = capacities(profile, request)
    device: tuple[tuple[str, int], ...] = (
        ("KV cache", kv_cache_bytes(desc, profile, batch)),
        ("activations", activation_bytes(desc, profile, batch)),
    )
    if state := recurrent_state_bytes(desc, batch):
        device += (("recurrent state", state),)
    rows = [
        CapacityRow(
            name="gpu capacity",
            tier_label="gpu tier",
            capacity=cap["gpu"],
            weight_tiers=("gpu",),
            fixed=device,
            counts_pool=True,
            budget_flag="--gpu-budget",
        )
    ]
    if profile.unified_memory:
        rows.append(
            CapacityRow(
                name="unified memory capacity (gpu + ram)",
                tier_label="unified memory (gpu + ram tiers)",
                capacity=cap["ram"],
                weight_tiers=("gpu", "ram"),
                fixed=device,
                counts_pool=True,
                budget_flag="--ram-budget",
            )
        )
    else:
        rows.append(
            CapacityRow(
                name="ram capacity",
                tier_label="ram tier",
                capacity=cap["ram"],
                weight_tiers=("ram",),
                fixed=(),
                counts_pool=True,  # host staging buffers of the direct-I/O reads
                budget_flag="--ram-budget",
            )
        )
    return rows


# --------------------------------------------------------------------------- pinned placements


def _check_tiers(desc: ModelDescription, tiers: Mapping[str, str]) -> None:
    names = {u.name for u in desc.units}
    missing = [u.name for u in desc.units if u.name not in tiers]
    extra = sorted(set(tiers) - names)
    bad = sorted(n for n, t in tiers.items() if t not in TIERS)
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"units without a tier: {', '.join(missing[:5])}")
        if extra:
            parts.append(f"units not in the model: {', '.join(extra[:5])}")
        if bad:
            parts.append(f"unknown tiers for: {', '.join(bad[:5])} (tiers are {', '.join(TIERS)})")
        raise PlanError(
            f"placement does not match the model description ({'; '.join(parts)}); "
            "re-run strata plan for this model"
        )


def pool_for(desc: ModelDescription, tiers: Mapping[str, str], depth: int) -> Pool:
    """The pool a placement needs: ``depth + 1`` slots of the largest streamed dense unit, or
    none (streamed experts use the expert cache instead)."""
    streamed = [u.bytes_mlx for u in desc.units if tiers.get(u.name) == "nvme" and u.expert is None]
    if not streamed:
        return Pool(slots=0, slot_bytes=0)
    return Pool(slots=depth + 1, slot_bytes=max(streamed))


def expert_slot_bytes(desc: ModelDescription) -> int:
    """Bytes of one expert-cache slot: the largest expert unit (0 for a dense model)."""
    return max((u.bytes_mlx for u in desc.units if u.expert is not None), default=0)


def working_slots(desc: ModelDescription, prefetch: int) -> int:
    """Expert-cache slots that hold no cached expert: a block's top-k being computed and the
    ``prefetch`` experts read ahead for the next block."""
    return desc.architecture.expert_used_count + prefetch


def prediction_recall(desc: ModelDescription, prefetch: int) -> float:
    """``alpha``: the share of a block's chosen experts that prefetching ``prefetch`` guesses
    predicts — the routing profile's measured figure, else ``prefetch / n`` (a blind guess of
    ``prefetch`` of the ``n`` experts); 0 without prefetch."""
    if prefetch <= 0 or not desc.architecture.expert_count:
        return 0.0
    if desc.routing is not None:
        return desc.routing.prediction_recall
    return min(1.0, prefetch / desc.architecture.expert_count)


def hottest_streamed(desc: ModelDescription, tiers: Mapping[str, str]) -> list[UnitInfo]:
    """The streamed (nvme) expert units, most read first: access per token times bytes (the
    order of their read seconds), then name. The first ``slots - working_slots`` are the hot
    set the cost model counts as cached."""
    streamed = [u for u in desc.units if u.expert is not None and tiers.get(u.name) == "nvme"]
    return sorted(streamed, key=_heat)


def _heat(u: UnitInfo) -> tuple[float, str]:
    """Sort key of streamed experts, most read first (``hottest_streamed``)."""
    return (-u.access_per_token * u.bytes_mlx, u.name)


def expert_cache_for(
    desc: ModelDescription, tiers: Mapping[str, str], slots: int | None = None, prefetch: int = 0
) -> ExpertCache:
    """The expert cache of a placement: ``slots`` (default the working slots alone) of the
    largest expert when any expert streams, the pinned (gpu) experts listed; empty otherwise.

    With a routing profile (``desc.routing``) the cache's hot set is known before the first
    token: ``preload`` lists it (``hottest_streamed``, as many as the cache holds besides its
    working slots) for the executor to read at start instead of learning it from misses."""
    pinned = [u.name for u in desc.units if u.expert is not None and tiers.get(u.name) == "gpu"]
    if not any(u.expert is not None and tiers.get(u.name) == "nvme" for u in desc.units):
        return ExpertCache(pinned=pinned)
    slots = working_slots(desc, prefetch) if slots is None else slots
    hold = max(0, slots - working_slots(desc, prefetch))
    preload = [u.name for u in hottest_streamed(desc, tiers)[:hold]] if desc.routing else []
    return ExpertCache(
        slots=slots,
        slot_bytes=expert_slot_bytes(desc),
        prefetch=prefetch,
        pinned=pinned,
        preload=preload,
    )


@dataclass(frozen=True)
class ExpertStreaming:
    """Seconds and hit rate of the streamed experts of one decode step (module docstring)."""

    sync_s: float
    """``(1 - alpha) M``: misses read after the router, on the compute thread's path."""
    disk_s: float
    """``(1 - alpha + m / k) M``: expert reads on the I/O threads, prefetches included."""
    copy_s: float
    """Host -> device copies of those reads (memory that is not unified), seconds."""
    hit_rate: float | None
    """Predicted share of streamed-expert uses served by the cache (None: none stream)."""


def expert_streaming(
    desc: ModelDescription,
    costs: list[UnitCost],
    tiers: Mapping[str, str],
    cache: ExpertCache,
    unified: bool,
    batch: int = 1,
) -> ExpertStreaming:
    """The streamed experts' cost under the expert cache ``cache`` (module docstring).

    Args:
        costs: ``unit_costs`` of ``desc`` (same order).
        tiers: unit name -> tier.
        cache: slots, prefetch per block.
        unified: the machine's memory is unified (no host -> device copy of reads).
        batch: sequences per step B (expert access is ``a_u(B)``).
    """
    streamed = [
        (u, c)
        for u, c in zip(desc.units, costs, strict=True)
        if u.expert is not None and tiers[u.name] == "nvme"
    ]
    if not streamed:
        return ExpertStreaming(0.0, 0.0, 0.0, None)
    k = max(1, desc.architecture.expert_used_count)
    m = cache.prefetch
    hold = max(0, cache.slots - working_slots(desc, m))
    streamed.sort(key=lambda uc: _heat(uc[0]))  # hottest first: the cached ones
    missed = streamed[hold:]
    miss_s = sum(c.read_s for _, c in missed)
    copy = 0.0 if unified else sum(c.copy_s for _, c in missed)
    alpha = prediction_recall(desc, m)
    reads = 1.0 - alpha + m / k
    access = [1.0 - (1.0 - u.access_per_token) ** batch for u, _ in streamed]
    a_all, a_miss = sum(access), sum(access[hold:])
    hit = (a_all - a_miss + alpha * a_miss) / a_all if a_all > 0 else 0.0
    return ExpertStreaming((1.0 - alpha) * miss_s, reads * miss_s, reads * copy, hit)


def weights_by_tier(desc: ModelDescription, tiers: Mapping[str, str]) -> dict[str, int]:
    """Bytes of weights on each tier (MLX form)."""
    out = dict.fromkeys(TIERS, 0)
    for u in desc.units:
        out[tiers[u.name]] += u.bytes_mlx
    return out


@dataclass(frozen=True)
class PinnedPlacement:
    """A placement to score or size: every unit's tier, the prefetch depth and, where a plan
    states them (``of``), its own pool, batch limits and expert cache; None means what ``depth``
    and the request imply (``pool_for``, ``batch_limits``, ``expert_cache_for`` with the working
    slots alone). A hand-written plan may state other ones than the planner would."""

    tiers: Mapping[str, str]
    """Unit name -> ``gpu`` / ``ram`` / ``nvme``, for every unit of the model description."""
    depth: int
    """Prefetch depth: units the I/O threads read ahead (0 = synchronous reads)."""
    pool: Pool | None = None
    batch: BatchLimits | None = None
    experts: ExpertCache | None = None

    @classmethod
    def of(cls, plan: Plan) -> PinnedPlacement:
        """The plan's own placement, prefetch depth, pool, batch limits and expert cache."""
        return cls(plan.tier_of(), plan.prefetch.depth, plan.pool, plan.batch, plan.expert_cache)

    def resolve(
        self, desc: ModelDescription, request: Request
    ) -> tuple[Pool, BatchLimits, ExpertCache]:
        """The pool, batch limits and expert cache: the stated ones, else their defaults.

        Raises:
            PlanError: ``tiers`` does not cover exactly the units of ``desc``.
        """
        _check_tiers(desc, self.tiers)
        return (
            self.pool or pool_for(desc, self.tiers, self.depth),
            self.batch or batch_limits(request),
            self.experts if self.experts is not None else expert_cache_for(desc, self.tiers),
        )


def capacity_use(
    desc: ModelDescription, profile: HardwareProfile, request: Request, placement: PinnedPlacement
) -> list[tuple[CapacityRow, int]]:
    """Each capacity row with the bytes a pinned placement puts in it (``used <= capacity`` fits).

    Raises:
        PlanError: the placement's tiers do not cover exactly the units of ``desc``.
    """
    pool, batch, cache = placement.resolve(desc, request)
    weights = weights_by_tier(desc, placement.tiers)
    pool_bytes = pool.slots * pool.slot_bytes + cache.slots * cache.slot_bytes
    return [(r, r.used(weights, pool_bytes)) for r in capacity_rows(desc, profile, request, batch)]


def tier_memory(
    desc: ModelDescription, profile: HardwareProfile, request: Request, placement: PinnedPlacement
) -> dict[str, TierMemory]:
    """Bytes per tier under a pinned placement, for ``Plan.memory``.

    nvme's ``capacity`` is 0, meaning unbounded (the model file already lives there). On non-unified
    machines the pool is counted on gpu (device slots) and on ram (host staging buffers).

    Raises:
        PlanError: the placement's tiers do not cover exactly the units of ``desc``.
    """
    pool, batch, cache = placement.resolve(desc, request)
    pool_bytes = pool.slots * pool.slot_bytes
    cache_bytes = cache.slots * cache.slot_bytes
    weights = weights_by_tier(desc, placement.tiers)
    cap = capacities(profile, request)
    return {
        "gpu": TierMemory(
            capacity=cap["gpu"],
            weights=weights["gpu"],
            kv_cache=kv_cache_bytes(desc, profile, batch),
            pool=pool_bytes,
            expert_cache=cache_bytes,
            activations=activation_bytes(desc, profile, batch),
            recurrent_state=recurrent_state_bytes(desc, batch),
        ),
        "ram": TierMemory(
            capacity=cap["ram"],
            weights=weights["ram"],
            pool=0 if profile.unified_memory else pool_bytes,
            expert_cache=0 if profile.unified_memory else cache_bytes,
        ),
        "nvme": TierMemory(capacity=0, weights=weights["nvme"]),
    }


def step_terms(
    compute_s: float,
    host_copy_s: float,
    disk_s: float,
    depth: int,
    io_stall_s: float = 0.0,
    expert_disk_s: float = 0.0,
) -> list[tuple[str, float]]:
    """The lower bounds on the step time (name, seconds); the step is their maximum.

    ``disk_s`` is the dense units' reads, ``expert_disk_s`` the experts' (always read by I/O
    threads; their synchronous share is in ``io_stall_s``). depth >= 1: ``compute + host copy +
    I/O stall`` and ``disk`` (I/O threads overlap the compute thread); depth = 0: ``compute +
    host copy + dense disk + I/O stall`` (dense reads are synchronous), and ``disk`` when experts
    stream.
    """
    if depth >= 1:
        return [
            (TERM_OVERLAP_COMPUTE, compute_s + host_copy_s + io_stall_s),
            (TERM_OVERLAP_DISK, disk_s + expert_disk_s),
        ]
    terms = [(TERM_SERIAL, compute_s + host_copy_s + disk_s + io_stall_s)]
    if expert_disk_s > 0:
        terms.append((TERM_OVERLAP_DISK, disk_s + expert_disk_s))
    return terms


def _bottleneck(
    compute_s: float,
    host_copy_s: float,
    disk_s: float,
    depth: int,
    io_stall_s: float,
    expert_disk_s: float = 0.0,
) -> str:
    # The disk limits when it outlasts the compute thread, or when waiting for reads (the stall,
    # and at depth 0 the dense reads) is the compute thread's largest share; otherwise the larger
    # share of the compute thread's time (ties resolve in the order compute, host_copy, disk).
    serial = disk_s if depth == 0 else 0.0
    if disk_s + expert_disk_s > compute_s + host_copy_s + io_stall_s + serial:
        return "disk"
    shares = [("compute", compute_s), ("host_copy", host_copy_s), ("disk", serial + io_stall_s)]
    return max(shares, key=lambda kv: kv[1])[0]


def interleaved_blocks(desc: ModelDescription, tiers: Mapping[str, str]) -> list[int]:
    """Blocks whose attention and FFN units both stream from NVMe (see ``io_stall_s``)."""
    on_nvme = {u.name for u in desc.units if tiers.get(u.name) == "nvme"}
    return [
        i
        for i in range(desc.architecture.block_count)
        if f"blk.{i}.attn" in on_nvme and f"blk.{i}.ffn" in on_nvme
    ]


def io_stall(
    desc: ModelDescription, costs: list[UnitCost], tiers: Mapping[str, str], depth: int
) -> float:
    """Seconds per step the compute thread waits for reads that could not start (module docstring).

    Args:
        costs: ``unit_costs`` of ``desc`` (same order).
        tiers: unit name -> tier.
        depth: prefetch depth; the stall exists at depth 1 only.
    """
    if depth != 1:
        return 0.0
    by_name = {c.name: c for c in costs}
    return sum(
        max(0.0, by_name[f"blk.{i}.ffn"].read_s - by_name[f"blk.{i}.attn"].compute_s)
        for i in interleaved_blocks(desc, tiers)
    )


# --------------------------------------------------------------------------- prefill


def prefill_chunks(prompt: int, chunk: int) -> tuple[int, int]:
    """How the executor splits a prompt of ``prompt`` tokens into chunks of ``chunk`` tokens:
    (full chunks before the last one, tokens of the last chunk). ``(0, prompt)`` when the prompt
    fits one chunk; the last chunk holds ``prompt - full * chunk`` in ``1..chunk`` tokens."""
    chunk = max(1, chunk)
    full = (max(1, prompt) - 1) // chunk
    return full, max(1, prompt) - full * chunk


def prefill_costs(desc: ModelDescription, profile: HardwareProfile, rows: int) -> list[UnitCost]:
    """Per-unit coefficients of one prefill chunk of ``rows`` tokens of one sequence.

    As ``unit_costs`` with the chunk's tokens in place of the decode batch: access
    ``a_u(rows) = 1 - (1 - a_u)^rows`` (every expert of a block, near enough, for a chunk of
    hundreds of tokens); ``device_s = max(a_u(rows) b_u / gpu_bw, rows f_u / compute_flops)``
    (a chunk's products are matrix products, priced at gpu.compute_flops_s); ``ops_s = k_u op_s``
    (weighted by ``a_u(rows)`` for experts); ``copy_s`` and ``read_s`` what the chunk reads.

    Raises:
        PlanError: a bandwidth or the compute throughput in the profile is zero.
    """
    flops = _rate(profile.gpu.compute_flops_s.value, "gpu.compute_flops_s")
    return _pass_costs(desc, profile, rows, lambda f: rows * f / flops)


@dataclass(frozen=True)
class ChunkTime:
    """One prefill chunk of a pinned placement (seconds; module docstring, "Prefill")."""

    rows: int
    """Tokens in the chunk."""
    compute_s: float
    host_copy_s: float
    """Copies of ram units (and of nvme units and missed experts where memory is not unified)."""
    disk_s: float
    """Reads of the streamed dense units."""
    expert_s: float
    """Reads of the streamed experts the cache does not hold (synchronous: after the router)."""
    terms: tuple[tuple[str, float], ...]
    """``step_terms`` of the chunk; the chunk lasts as long as the largest."""

    @property
    def chunk_s(self) -> float:
        """The chunk's time: the largest of its terms."""
        return max(v for _, v in self.terms)


def prefill_chunk(
    desc: ModelDescription,
    profile: HardwareProfile,
    tiers: Mapping[str, str],
    depth: int,
    cache: ExpertCache,
    rows: int,
) -> ChunkTime:
    """The time of one prefill chunk of ``rows`` tokens under a pinned placement (module
    docstring, "Prefill"): ``max(compute + host copy + expert misses, disk + expert misses)`` at
    depth >= 1, ``compute + host copy + disk + expert misses`` at depth 0."""
    costs = prefill_costs(desc, profile, rows)
    unified = profile.unified_memory
    compute_s = step_compute_s(costs, host_overlaps(desc, profile))
    copy = disk = 0.0
    for u, c in zip(desc.units, costs, strict=True):
        if u.expert is not None and tiers[u.name] == "nvme":
            continue  # through the expert cache, below
        copy += c.host_copy_s(tiers[u.name], unified)
        disk += c.disk_s(tiers[u.name]) if u.expert is None else 0.0
    hold = max(0, cache.slots - working_slots(desc, cache.prefetch)) if cache.slots else 0
    by_name = {c.name: c for c in costs}
    missed = [by_name[u.name] for u in hottest_streamed(desc, tiers)[hold:]]
    miss_s = sum(c.read_s for c in missed)
    if not unified:
        copy += sum(c.copy_s for c in missed)
    terms = step_terms(compute_s, copy, disk, depth, miss_s, miss_s)
    return ChunkTime(rows, compute_s, copy, disk, miss_s, tuple(terms))


def ttft(
    desc: ModelDescription,
    profile: HardwareProfile,
    tiers: Mapping[str, str],
    depth: int,
    cache: ExpertCache,
    prompt: int,
    chunk: int,
) -> float:
    """Time to first token of a ``prompt``-token prompt, seconds: ``full * chunk_s(chunk) +
    chunk_s(last)`` (``prefill_chunks``); the first token is sampled from the last chunk's
    logits, so no decode step is added."""
    full, last = prefill_chunks(prompt, chunk)
    total = prefill_chunk(desc, profile, tiers, depth, cache, last).chunk_s
    if full:
        total += full * prefill_chunk(desc, profile, tiers, depth, cache, chunk).chunk_s
    return total


def score(
    desc: ModelDescription, profile: HardwareProfile, request: Request, placement: PinnedPlacement
) -> Prediction:
    """Predict one decode step of a pinned placement with the cost model (see module docstring).

    Args:
        desc: the model description.
        profile: the machine.
        request: context, concurrency and objective (which sets the batch B).
        placement: every unit's tier, the prefetch depth, and a plan's own pool, batch limits
            and expert cache (for hand-written plans) or None for their defaults.

    Returns:
        The step time split into compute / host copy / disk / I/O stall (seconds), the bottleneck,
        aggregate
        decode tokens/s ``B / step_s``, and the binding constraints: capacity rows within
        ``BINDING_TOL`` of their capacity and the step-time terms within ``BINDING_TOL`` of the
        step. It does not check that the placement fits (``capacity_use`` does).

    Raises:
        PlanError: the placement's tiers do not cover exactly the units of ``desc``, or the
            profile has a zero bandwidth or compute throughput.
    """
    _, batch, cache = placement.resolve(desc, request)
    use = capacity_use(desc, profile, request, placement)
    tiers, depth = placement.tiers, placement.depth
    costs = unit_costs(desc, profile, request, batch)
    unified = profile.unified_memory
    dense = [c for u, c in zip(desc.units, costs, strict=True) if u.expert is None]
    expert_on = [
        c
        for u, c in zip(desc.units, costs, strict=True)
        if u.expert is not None and tiers[c.name] != "nvme"
    ]
    ex = expert_streaming(desc, costs, tiers, cache, unified, batch_size(request, batch))
    compute_s = step_compute_s(costs, host_overlaps(desc, profile))
    host_copy_s = sum(c.host_copy_s(tiers[c.name], unified) for c in dense + expert_on) + ex.copy_s
    disk_s = sum(c.disk_s(tiers[c.name]) for c in dense)
    stall_s = io_stall(desc, costs, tiers, depth) + ex.sync_s
    terms = step_terms(compute_s, host_copy_s, disk_s, depth, stall_s, ex.disk_s)
    step_s = max(v for _, v in terms)
    binding = [
        r.name for r, used in use if r.capacity > 0 and used >= (1 - BINDING_TOL) * r.capacity
    ]
    binding += [name for name, v in terms if v >= (1 - BINDING_TOL) * step_s]
    b = batch_size(request, batch)
    chunk = max(1, batch.prefill_chunk)
    full = prefill_chunk(desc, profile, tiers, depth, cache, chunk)
    return Prediction(
        compute_s=compute_s,
        host_copy_s=host_copy_s,
        disk_s=disk_s + ex.disk_s,
        io_stall_s=stall_s,
        expert_hit_rate=None if ex.hit_rate is None else round(ex.hit_rate, 6),
        step_s=step_s,
        bottleneck=_bottleneck(  # type: ignore[arg-type]
            compute_s, host_copy_s, disk_s, depth, stall_s, ex.disk_s
        ),
        decode_tok_s=b / step_s if step_s > 0 else 0.0,
        binding=binding,
        prefill_chunk_s=full.chunk_s,
        ttft_s=[ttft(desc, profile, tiers, depth, cache, p, chunk) for p in request.prompt_tokens],
    )


def objective(prediction: Prediction, request: Request, batch: BatchLimits | None = None) -> float:
    """The ILP's objective for a prediction: seconds per generated token of whole requests,
    ``(B * TTFT + (N - 1) * step_s) / (B * N)`` with ``TTFT`` the mean of ``prediction.ttft_s``
    (the shortest and the longest prompt), ``N = request.output_tokens`` and ``B`` the decode
    batch (module docstring, "Objective"). A prediction without TTFT (a plan made before prefill
    was priced) gives ``step_s / B``."""
    b = batch_size(request, batch)
    if not prediction.ttft_s:
        return prediction.step_s / b
    n = request.output_tokens
    first = sum(prediction.ttft_s) / len(prediction.ttft_s)
    return (b * first + (n - 1) * prediction.step_s) / (b * n)


def score_plan(plan: Plan, desc: ModelDescription, profile: HardwareProfile) -> Prediction:
    """Score an existing (possibly hand-written) plan on a machine with the cost model.

    Uses the plan's own placement, prefetch depth, pool and batch limits (``PinnedPlacement.of``).

    Raises:
        PlanError: the plan's placement does not match ``desc``'s units.
    """
    return score(desc, profile, plan.request, PinnedPlacement.of(plan))


def runtime_for(profile: HardwareProfile) -> Runtime:
    """The executor settings a profile implies: its backend and dtype, and the measured kernel
    paths of quantized products (a row-count figure the profile lacks is 0: never)."""

    def rows(figure: Figure | None) -> int:
        return int(figure.value) if figure is not None else 0

    return Runtime(
        backend=profile.backend,
        compute_dtype=profile.compute_dtype,
        dequant_matmul_min_rows=rows(profile.gpu.dequant_matmul_min_rows),
        mma_matmul_min_rows=rows(profile.gpu.mma_matmul_min_rows),
        mma_matmul_max_rows=rows(profile.gpu.mma_matmul_max_rows),
    )
