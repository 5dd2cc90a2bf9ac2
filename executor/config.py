"""The executor's runtime settings: one frozen object, built once per engine.

:meth:`RuntimeConfig.build` makes it from the plan's ``runtime`` section (the kernel paths the
profile measured), the environment (``strata.common.envs``) and the backend MLX runs on (several
defaults differ on MLX's CUDA backend). ``executor.engine.Engine`` builds one and hands it down:
to the model (``LlamaModel.config``: pass padding, fused products and RoPE, async evaluation),
through it to the attention backend (``executor.attention``) and the kernels (``executor.ops``:
the kernel path of each product), to the weight streams (``stage_direct_reads``), and to the
serving engine, its model runner (compiled passes, staged inputs, warm-up) and its scheduler
(``lend_partial_blocks``). Nothing else carries a runtime setting: a test or bench that wants
another one builds a config (``RuntimeConfig.build(runtime, fused_rope=False)`` or
``config.replace(...)``) and gives it to ``Engine(..., config=...)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
from strata.common import envs
from strata.common.errors import StrataError
from strata.common.schemas import Runtime


@dataclass(frozen=True)
class RuntimeConfig:
    """The executor's runtime settings (module docstring). Build it with :meth:`build`, which
    computes the backend's defaults; every field below says what its default is there."""

    # ---------------------------------------------------------------- kernels (executor.ops)

    pad_rows: bool
    """Pad a product's row count up to ``ops.bucket_rows`` (``ops.linear``). MLX's CUDA backend
    prepares its matmul kernels per distinct shape, and a new shape's first call can take up to a
    minute (docs/kernels.md#row-buckets). A serving step's
    row count is its batch's token count, which changes with every mix of decodes and prefill
    chunks; bucketed, the shapes are a few dozen. The padded zero rows cost compute only, and a
    decode step's products are bound by reading the weights, not by rows. Default: on MLX's CUDA
    backend, off elsewhere."""

    mma_rows: tuple[int, int]
    """Products of ``mma_rows[0]`` to ``mma_rows[1]`` rows take Strata's own kernels
    (``executor.cuda_mma``: tensor cores, 4 bits; one row ``executor.cuda_qmv``'s matvec, 4 or 8
    bits) where they apply; ``(0, 0)``: never. Default: the plan's
    ``runtime.mma_matmul_min_rows`` and ``mma_matmul_max_rows``, the range the profile measured
    faster than MLX's quantized matmul."""

    dequant_min_rows: int
    """Products of at least this many rows dequantize the weight for the call and multiply
    densely; 0: always a quantized kernel. Default: the plan's
    ``runtime.dequant_matmul_min_rows``, the profile's measured crossover."""

    # ----------------------------------------------------------------- the model's pass

    pad_pass_rows: bool
    """Pad a dense model's forward pass to its row bucket once, at the embedding
    (``LlamaModel.pass_rows``), where ``pad_rows`` pads products: padding per product costs two
    host operations per product (docs/kernels.md#row-buckets). Default: on MLX's CUDA backend
    (set on its own: ``pad_rows=False`` leaves it as it is)."""

    pad_expert_rows: bool
    """Pad each expert's row count to a power of two (``models.llama._padded_rows``, copies of
    its first row; the extra results are sliced off). MLX's CUDA backend prepares kernels per
    distinct matmul shape: unpadded, a prefill has one shape per distinct number of tokens
    choosing an expert; padded, a prefill of T tokens has at most log2(T) + 1
    (docs/kernels.md#row-buckets). Default: on MLX's CUDA
    backend; elsewhere the extra rows would only cost compute, so the CPU and Metal compute
    exactly the rows that chose the expert."""

    async_eval_blocks: int
    """Schedule the residual stream (``mx.async_eval``) after every this many blocks (0: never),
    as soon as it is built, so that the GPU computes those blocks while Python builds the next
    ones (``mx.eval`` at the end otherwise starts the GPU only once the whole pass is built).
    ``planner.costmodel`` assumes this overlap. Each ``mx.async_eval`` encodes the operations
    built since the last and commits them (``mlx/backend/cuda/device.cpp``,
    ``CommandEncoder::commit``), so a call per block costs more than it gains; every 2 blocks was
    the fastest measured (docs/kernels.md#scheduling-blocks-as-they-are-built). Default: 2 on
    MLX's CUDA backend; 0 elsewhere (on the CPU it changed nothing; Metal was not measured)."""

    fused_projections: bool
    """A block's Q/K/V and its FFN's gate/up take one fused tensor-core call each
    (``ops.fused_qkv``, ``ops.fused_swiglu``) where it applies (rows of the tensor-core path, MLX's
    CUDA backend); False: the model makes each projection's own call (for measuring the
    difference: ``benchmarks/prefix_inprocess.py``'s ``unfused``). The fused SwiGLU rounds once
    where the unfused form rounds each product. Default: on."""

    fused_rope: bool
    """RoPE Q and K in the fused Q/K/V product's store (``executor.cuda_mma.Rope``) where it
    applies (``LlamaModel._fused_rope``): two operations of the graph and one reshape fewer per
    block. The arithmetic is ``mx.fast.rope``'s on the same rounded products. Default: on (it
    applies only where the fused product does: MLX's CUDA backend)."""

    explicit_attention_max_queries: int
    """Chunks of 2 to this many queries that ``executor.cuda_attention`` does not take attend
    with plain operations (``attention._explicit_attention``), not cuDNN, whose plan MLX
    builds per exact (query length, key length) shape: a verification chunk or a suffix after a
    prefix-cache hit meets a new one nearly every time, and each build takes tens of ms. Slower
    per call, but with no build (docs/kernels.md#attention). Default:
    32 on MLX's CUDA backend, 0 elsewhere (the CPU has no per-shape cost)."""

    # ------------------------------------------------------- compiled passes (pass_graph)

    compiled_passes: bool
    """Replay compiled graphs for the passes ``executor.pass_graph`` takes (False: every pass
    eager); which passes: those of at most ``max_sequences`` sequences, in segments of
    ``segment_blocks`` blocks. Default: ``STRATA_COMPILED_PASSES`` (``strata.common.envs``), on
    unless set off.

    With them the warm request after a prefix-cache hit gains a few ms at the client
    (docs/kernels.md#compiled-passes). ``/metrics``
    counts the target model's traces and replays (``strata_compiled_pass_traces_total``,
    ``strata_compiled_pass_replays_total``)."""

    lone_decode_kernel: bool
    """A lone decode (one sequence, one token) attends with Strata's paged kernel
    (``executor.cuda_attention``), as every other pass on MLX's CUDA backend does, rather than
    MLX's SDPA over a gather of its keys and values; its pass is then one the compiled passes
    take (``executor.pass_graph``), replayed from C++ instead of built op by op in Python.
    Default: on (``STRATA_LONE_DECODE_KERNEL``): with the split paged-attention kernel, on an
    H100, a served lone decode of the Llama-3-8B shape took 5.4 ms a step against SDPA's 7.4 ms,
    whose step waited on the host building it
    (docs/kernels.md#where-a-lone-decode-steps-time-goes)."""

    max_sequences: int
    """Passes of at most this many sequences are compiled (0: any number). With one: a prompt's
    chunk of up to ``pass_graph.MAX_ROWS`` rows (after a prefix-cache hit, or a short prompt), a
    speculative verification pass of a lone sequence, a draft model's catch-up chunk of one; not
    a lone decode where it takes the paged kernel (``lone_decode_kernel``). Default: 1.

    Why not more: with passes of several sequences compiled, the server's 16-sequence decode
    steps stalled 60-85 ms between steps, a thread-scheduling interaction not yet explained
    (docs/kernels.md#compiled-passes)."""

    segment_blocks: int
    """Blocks per compiled segment (0: the whole pass in one graph). With N > 0 a pass is traced
    and replayed as consecutive segments of N blocks (the last also runs the output head), each
    handed to ``mx.async_eval`` as soon as it is replayed, so that the GPU can compute segment i
    while the host replays and encodes segment i + 1. Default: 4, the fastest measured
    (docs/kernels.md#compiled-passes)."""

    # --------------------------------------------------------------------------- serving

    warm_up_row_buckets: bool
    """Before serving, run one forward pass per row bucket of the weight products
    (``ops.bucket_rows``: 1, 2, 4, ... up to the plan's ``max_num_batched_tokens``;
    ``ServingEngine.start``). On MLX's CUDA backend the first product of a new row bucket builds
    its kernels, and with MLX's quantized matmul that took up to a minute, during which the
    engine thread serves nobody (docs/kernels.md#warm-up). Built at start, the cost is paid
    before the server accepts requests (MLX keeps what it compiles on disk,
    ``MLX_PTX_CACHE_DIR``, so later starts on one machine pay less).
    Default: on MLX's CUDA backend; off elsewhere (the CPU builds nothing per shape)."""

    stage_inputs: bool
    """Write each serving pass's integer inputs (token ids, KV slots, positions, attention
    tables) into the engine thread's kept buffers (``executor.host_inputs``) rather than new
    arrays. On MLX's CUDA backend new arrays cost managed-memory allocations, at times a
    synchronous copy, and page faults when GPU outputs later take their buffers
    (docs/kernels.md#input-staging). Default: on."""

    mapped_inputs: bool
    """Keep the staged inputs' buffers (``stage_inputs``) in host memory, mapped into the GPU's
    page tables (``executor.cuda_driver.keep_on_host``: managed memory advised to prefer the
    host and to be accessed by the GPU), so the GPU reads a pass's few inputs over PCIe where it
    otherwise faulted their pages over each pass, about 0.2 ms of a decode step on an H100
    (docs/kernels.md#where-a-lone-decode-steps-time-goes). Default: off (measured against)."""

    lent_copy_yield_s: float
    """Seconds the engine thread sleeps before copying lent KV slots (``ServingEngine.step``), so
    that the server's event loop can send the step's tokens first. Default: 0.0003, about the
    event loop's wake-up and one send on the dev CPU (0.2-0.4 ms, ``executor.server``'s path
    from a token event to its first byte on the socket)."""

    pipelined_steps: bool
    """Build and launch each serving step while the device computes the one before it, where
    every request of the engine samples greedily (log-probabilities are read from the kept
    logits one step later) and nothing needs the step's tokens on the host first (no drafter, no
    unit streamed from NVMe, the embedding table on the device tier): the next step's inputs
    take the sampled ids as device arrays and the host reads them one step later
    (``executor.serving``, "Pipelined steps"). MLX's ``generate_step`` does the same with
    ``mx.async_eval``. Default: ``STRATA_PIPELINED_STEPS`` (on unless set off)."""

    pipeline_flow: bool
    """A cluster plan's passes whose output nobody reads (a long prompt's chunks before its last)
    flow through the stages without coming back to rank 0, which builds the next chunk while the
    other ranks compute this one (``executor.pipeline``, "Flowing passes"); off, every pass is
    lock-step (each comes back before the next is built). Default: ``STRATA_PIPELINE_FLOW`` (on
    unless set off)."""

    decode_micro_batches: int
    """A cluster plan's decode steps of several sequences are cut into up to this many
    micro-batches, each sent on through the ranks before the one before comes back
    (``executor.pipeline``, "Micro-batched decode steps"); 1: every step whole (lock-step); 0:
    the plan's choice (``ClusterPrediction.micro_batches``, ``planner.pipeline``). Default:
    ``STRATA_DECODE_MICRO_BATCHES``, else 0."""

    lend_partial_blocks: bool
    """Lend a cached child block that agrees with at least half a block of a prompt's next
    tokens (``executor.scheduler``: partial-block prefix hits); batch-invariant scheduling keeps
    whole blocks whatever this says. Default: on."""

    # ----------------------------------------------------------------- weight streaming

    pinned_ram_tier: bool
    """RAM-tier units are page-locked and mapped for the device once at load, and each use is
    copied by a kernel reading them over PCIe (``executor.pinned``), rather than made into a
    managed-memory array per use, which the GPU faults over page by page. Default: on MLX's CUDA
    backend (the only one where it applies)."""

    stage_direct_reads: bool
    """Direct-I/O reads of streamed units land in a host buffer and are copied into the slot
    (``executor.streaming.SlotArena``), rather than being read straight into it. A DMA from the
    disk into the memory behind an MLX CUDA array is not coherent with what the GPU then reads
    (greedy tokens changed from run to run), while bytes that come in through the CPU are. The
    copy costs a memcpy of the streamed bytes (docs/tier-streaming.md#the-nvme-tier-at-run-time).
    Default: on MLX's CUDA
    backend; on unified-memory Apple silicon and the CPU the reads land in place."""

    def __post_init__(self) -> None:
        """Refuse settings no code path can honour (a test's or bench's typo, not a plan's: the
        plan's schema bounds its own).

        Raises:
            StrataError: a count or duration below 0, or a tensor-core row range that is not
                ``(0, 0)`` or ``lo <= hi`` with ``lo >= 1``.
        """
        counts = {
            "dequant_min_rows": self.dequant_min_rows,
            "async_eval_blocks": self.async_eval_blocks,
            "explicit_attention_max_queries": self.explicit_attention_max_queries,
            "max_sequences": self.max_sequences,
            "segment_blocks": self.segment_blocks,
            "lent_copy_yield_s": self.lent_copy_yield_s,
            "decode_micro_batches": self.decode_micro_batches,
        }
        for name, value in counts.items():
            if value < 0:
                raise StrataError(f"RuntimeConfig.{name} is {value}; give 0 or more")
        lo, hi = self.mma_rows
        if (lo, hi) != (0, 0) and not 1 <= lo <= hi:
            raise StrataError(
                f"RuntimeConfig.mma_rows is {self.mma_rows}; give (min, max) rows with "
                "1 <= min <= max, or (0, 0) for never"
            )

    @classmethod
    def build(cls, runtime: Runtime | None = None, **overrides) -> RuntimeConfig:
        """The settings for this process: the backend's defaults, the plan's ``runtime`` section
        (None: a plan's defaults, no measured kernel paths) and ``STRATA_*`` variables, then
        ``overrides`` (field name -> value, for tests and benches).

        Raises:
            StrataError: an override names no field (the message lists them), or a
                ``STRATA_*`` variable does not parse.
        """
        runtime = runtime or Runtime()
        cuda = mx.cuda.is_available()
        lo, hi = runtime.mma_matmul_min_rows, runtime.mma_matmul_max_rows
        config = cls(
            pad_rows=cuda,
            # A range no row count falls in (a minimum of 0: off, or above the maximum) is never.
            mma_rows=(lo, hi) if 1 <= lo <= hi else (0, 0),
            dequant_min_rows=runtime.dequant_matmul_min_rows,
            pad_pass_rows=cuda,
            pad_expert_rows=cuda,
            async_eval_blocks=2 if cuda else 0,
            fused_projections=True,
            fused_rope=True,
            explicit_attention_max_queries=32 if cuda else 0,
            compiled_passes=envs.get("STRATA_COMPILED_PASSES"),
            lone_decode_kernel=envs.get("STRATA_LONE_DECODE_KERNEL"),
            max_sequences=1,
            segment_blocks=4,
            warm_up_row_buckets=cuda,
            stage_inputs=True,
            mapped_inputs=False,
            lent_copy_yield_s=0.0003,
            pipelined_steps=envs.get("STRATA_PIPELINED_STEPS"),
            pipeline_flow=envs.get("STRATA_PIPELINE_FLOW"),
            decode_micro_batches=envs.get("STRATA_DECODE_MICRO_BATCHES") or 0,
            lend_partial_blocks=True,
            pinned_ram_tier=cuda,
            stage_direct_reads=cuda,
        )
        return config.replace(**overrides) if overrides else config

    def replace(self, **changes) -> RuntimeConfig:
        """A copy with ``changes`` (field name -> value): ``dataclasses.replace`` with a clear
        error for a misspelled field.

        Raises:
            StrataError: a change names no field (the message lists them).
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise StrataError(
                f"RuntimeConfig has no setting {unknown[0]!r}; the settings are "
                f"{', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **changes)
