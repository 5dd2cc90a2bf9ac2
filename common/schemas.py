"""The three documents of Strata as pydantic v2 schemas: model description, hardware profile, plan.

Every schema forbids unknown keys (a YAML typo is an error naming the key, not a silent default),
bounds its numbers, and documents each field. Sizes are integer bytes, bandwidths bytes/s, times
seconds. ``strata.common.yamlio`` writes them with stable key order so two documents diff cleanly.

Format versions are ``MAJOR.MINOR``: a reader refuses a different major version (the meaning of a
field changed) and accepts any minor version of its own major (fields were only added).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

TIERS: tuple[str, ...] = ("gpu", "ram", "nvme")
"""Storage tiers, fastest first: the device working set, host RAM, NVMe (direct I/O)."""

Tier = Literal["gpu", "ram", "nvme"]
Role = Literal["embedding", "attention", "norm", "ffn", "expert", "router", "output", "other"]

DESCRIPTION_VERSION = "1.2"
PROFILE_VERSION = "1.1"
PLAN_VERSION = "2.2"
CLUSTER_VERSION = "1.0"
ROUTING_VERSION = "1.0"


class Strict(BaseModel):
    """Base: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_major(version: str, expected: str, what: str) -> str:
    """Accept ``version`` if its major is ``expected``'s; else raise ValueError naming the fix."""
    major = version.split(".")[0]
    if major != expected.split(".")[0]:
        raise ValueError(
            f"{what} format_version {version} is not readable by this Strata "
            f"(it reads {expected.split('.')[0]}.x); re-create the {what} with this version"
        )
    return version


# --------------------------------------------------------------------------- model description


class TensorInfo(Strict):
    """One GGUF tensor as the planner sees it."""

    name: str = Field(description="GGUF tensor name, e.g. blk.0.attn_q.weight")
    layer: int | None = Field(ge=0, description="block index, None for non-block tensors")
    role: Role = Field(description="what the tensor does in the forward pass")
    unit: str = Field(description="the placement unit it moves with (a layer's attention, FFN...)")
    shape: list[int] = Field(description="GGUF order (ne0 first: ne0 is the contiguous row length)")
    ggml_type: str = Field(description="GGML quantization type name, e.g. Q4_1")
    offset: int = Field(ge=0, description="absolute byte offset of the tensor data in the file")
    bytes_gguf: int = Field(ge=0, description="bytes on disk")
    bytes_mlx: int = Field(ge=0, description="bytes once repacked into MLX form")
    supported: bool = Field(description="whether the executor can load this GGML type today")
    access_per_token: float = Field(
        ge=0, le=1, description="fraction of the tensor one decoded token reads (1 for dense)"
    )


class UnitInfo(Strict):
    """A placement unit: tensors that always move together between tiers."""

    name: str = Field(description="e.g. blk.3.attn, blk.3.ffn, token_embd, output")
    layer: int | None = Field(ge=0, description="block index, None for non-block units")
    role: Role = Field(description="dominant role of the unit's tensors")
    tensors: list[str] = Field(description="names of the unit's tensors")
    bytes_gguf: int = Field(ge=0, description="sum of the tensors' bytes on disk")
    bytes_mlx: int = Field(ge=0, description="sum of the tensors' bytes in MLX form")
    access_per_token: float = Field(
        ge=0,
        le=1,
        description="fraction of the unit a decoded token reads (1 dense, top-k/n experts)",
    )
    flops_per_token: int = Field(ge=0, description="multiply-adds x 2 of one decoded token")
    supported: bool = Field(description="all tensors of the unit have supported GGML types")
    expert: int | None = Field(
        default=None,
        ge=0,
        description="MoE expert index: the unit is slice ``expert`` of its stacked tensors "
        "(GGUF shape [cols, rows, n_expert]); None for every other unit",
    )


class Architecture(Strict):
    """Hyperparameters from the GGUF metadata (``{arch}.*`` keys)."""

    name: str = Field(description="general.architecture, e.g. llama")
    block_count: int = Field(ge=1)
    context_length: int = Field(ge=1, description="training context, tokens")
    embedding_length: int = Field(ge=1, description="model width d")
    feed_forward_length: int = Field(ge=0, description="FFN hidden width")
    head_count: int = Field(ge=1)
    head_count_kv: int = Field(ge=1)
    head_dim: int = Field(ge=1, description="key/query head dimension")
    vocab_size: int = Field(ge=1)
    rope_freq_base: float = Field(gt=0)
    rope_dimension_count: int = Field(ge=0)
    rms_norm_eps: float = Field(gt=0)
    tied_embeddings: bool = Field(
        description="no separate output.weight: the head reuses token_embd"
    )
    expert_count: int = Field(default=0, ge=0, description="experts per MoE block (0: dense)")
    expert_used_count: int = Field(
        default=0, ge=0, description="experts each token is routed to per block (top-k)"
    )
    expert_feed_forward_length: int = Field(
        default=0, ge=0, description="FFN width of one expert (0: feed_forward_length)"
    )
    expert_shared_feed_forward_length: int = Field(
        default=0, ge=0, description="FFN width of the shared expert (qwen2moe; 0: none given)"
    )
    expert_weights_norm: bool | None = Field(
        default=None,
        description="renormalize the chosen experts' weights to sum to 1 (None: the "
        "architecture's llama.cpp default)",
    )
    expert_gating_func: Literal["softmax", "sigmoid"] | None = Field(
        default=None, description="router gating function (None: the architecture's default)"
    )
    expert_weights_scale: float = Field(
        default=0.0, ge=0, description="factor on the chosen experts' weights (0: none)"
    )
    expert_shared_count: int = Field(
        default=0,
        ge=0,
        description="shared experts of an MoE block, run by every token (glm4moe, deepseek2: "
        "ffn_*_shexp is expert_shared_count expert widths wide, ungated; 0: none or the "
        "architecture's own rule)",
    )
    expert_group_count: int = Field(
        default=0,
        ge=0,
        description="expert groups of the grouped top-k (DeepSeek-V3): the router first keeps "
        "the expert_group_used_count groups of largest top-2 sum, then picks top-k in them "
        "(0 or 1: no grouping)",
    )
    expert_group_used_count: int = Field(
        default=0, ge=0, description="groups kept by the grouped top-k (0: no grouping)"
    )
    leading_dense_block_count: int = Field(
        default=0,
        ge=0,
        description="the first blocks whose FFN is dense (ffn_{gate,up,down}); the others are "
        "MoE (glm4moe, deepseek2)",
    )
    nextn_predict_layers: int = Field(
        default=0,
        ge=0,
        description="multi-token-prediction blocks the GGUF keeps after the block_count blocks "
        "the forward pass runs (GGUF {arch}.block_count = block_count + this); llama.cpp "
        "skips them, and their tensors are left out of the description",
    )
    sliding_window: int = Field(
        default=0, ge=0, description="attention window of the windowed blocks, tokens (0: none)"
    )
    sliding_window_layers: list[int] = Field(
        default_factory=list,
        description="blocks that attend only to the last sliding_window tokens (gemma3: all but "
        "every sliding_window_pattern-th; llama: all, Mistral-style); the others attend globally",
    )
    rope_freq_base_swa: float | None = Field(
        default=None, gt=0, description="RoPE base of the windowed blocks (None: rope_freq_base)"
    )
    rope_scaling_type: str = Field(
        default="none", description="rope.scaling.type (none, linear, yarn, ...)"
    )
    rope_freq_scale: float = Field(
        default=1.0, gt=0, description="RoPE position scale, 1 / rope.scaling.factor"
    )
    rope_scaling_original_context: int = Field(
        default=0,
        ge=0,
        description="YaRN: rope.scaling.original_context_length, tokens (0: context_length, "
        "llama.cpp's fallback)",
    )
    rope_attn_factor: float = Field(
        default=1.0,
        gt=0,
        description="rope.scaling.attn_factor: factor on the RoPE'd dims (llama.cpp reads it "
        "for every architecture; 1: none)",
    )
    rope_yarn_ext_factor: float | None = Field(
        default=None,
        ge=0,
        description="YaRN: rope.scaling.yarn_ext_factor, the extrapolation mix (None: 1 for "
        "yarn, 0 otherwise, llama.cpp's default; the key is read only where llama.cpp reads "
        "it: strata.common.describe.YARN_KEY_ARCHITECTURES)",
    )
    rope_yarn_attn_factor: float = Field(
        default=1.0,
        gt=0,
        description="YaRN: rope.scaling.yarn_attn_factor, magnitude factor where ext_factor is "
        "0 (llama.cpp replaces it otherwise; read as rope_yarn_ext_factor)",
    )
    rope_yarn_beta_fast: float = Field(
        default=32.0, gt=0, description="YaRN: rope.scaling.yarn_beta_fast (llama.cpp's 32)"
    )
    rope_yarn_beta_slow: float = Field(
        default=1.0, gt=0, description="YaRN: rope.scaling.yarn_beta_slow (llama.cpp's 1)"
    )
    final_logit_softcapping: float = Field(
        default=0.0, ge=0, description="logits -> c * tanh(logits / c) when positive (gemma3)"
    )
    q_lora_rank: int = Field(
        default=0,
        ge=0,
        description="multi-head latent attention (deepseek2): width of Q's low-rank "
        "attn_q_a/attn_q_b (0: one attn_q)",
    )
    kv_lora_rank: int = Field(
        default=0,
        ge=0,
        description="multi-head latent attention (deepseek2): width of the compressed latent "
        "the KV cache stores per token and block, beside rope_dimension_count RoPE'd dims "
        "(0: not MLA)",
    )
    key_length_mla: int = Field(
        default=0,
        ge=0,
        description="multi-head latent attention: one head's Q/K width once decompressed "
        "(no-RoPE dims + rope_dimension_count; GGUF attention.key_length_mla, or "
        "attention.key_length in a file with attn_kv_b)",
    )
    value_length_mla: int = Field(
        default=0,
        ge=0,
        description="multi-head latent attention: one head's value width once decompressed "
        "(GGUF attention.value_length_mla, or attention.value_length in a file with attn_kv_b)",
    )
    mla_legacy_kv_b: bool = Field(
        default=False,
        description="multi-head latent attention in the legacy layout: one attn_kv_b per block "
        "(the GGUF has no key_length_mla/value_length_mla) rather than attn_k_b and attn_v_b",
    )
    rope_yarn_log_mul: float = Field(
        default=0.0,
        ge=0,
        description="deepseek2 with YaRN: the attention scale's multiplier mscale = 1 + 0.1 * "
        "this * ln(factor) (rope.scaling.yarn_log_multiplier / 0.1, as llama.cpp reads it)",
    )
    recurrent_layers: list[int] = Field(
        default_factory=list,
        description="hybrid models (qwen3next, qwen35moe): the gated delta-net (linear-attention) "
        "blocks, which keep a fixed per-sequence recurrent state instead of KV cache; llama.cpp: "
        "block i is one unless (i + 1) % full_attention_interval == 0 (default interval 4)",
    )
    ssm_conv_kernel: int = Field(
        default=0, ge=0, description="gated delta-net: causal conv1d kernel width, tokens"
    )
    ssm_state_size: int = Field(
        default=0, ge=0, description="gated delta-net: key (and value) head dimension"
    )
    ssm_group_count: int = Field(default=0, ge=0, description="gated delta-net: key heads")
    ssm_time_step_rank: int = Field(default=0, ge=0, description="gated delta-net: value heads")
    ssm_inner_size: int = Field(
        default=0, ge=0, description="gated delta-net: value width, value heads x head dimension"
    )
    rope_sections: list[int] = Field(
        default_factory=list,
        description="multi-axis RoPE sections of the rotated dimensions (qwen35moe's "
        "rope.dimension_sections; empty: ordinary RoPE)",
    )


class ModelSource(Strict):
    """Which file a description (or plan) is about."""

    name: str | None = Field(description="catalog name (e.g. smollm2-135m) or None for a path")
    path: str | None = Field(description="file path as given, None for a catalog model")
    size_bytes: int | None = Field(ge=0, description="file size; None for --arch descriptions")
    sha256: str | None = Field(
        description="file sha256; None for --arch descriptions (not executable)"
    )
    header_sha256: str = Field(description="sha256 of the metadata and tensor table (the header)")


class ModelDescription(Strict):
    """Everything the planner needs about a model, from the GGUF header alone."""

    format_version: str = DESCRIPTION_VERSION
    model: ModelSource
    architecture: Architecture
    file_type: str = Field(description="GGUF general.file_type, e.g. MOSTLY_Q4_1")
    kv_elements_per_token: int = Field(
        ge=0, description="K and V elements one token adds to the KV cache over all layers"
    )
    kv_bytes_per_token: int = Field(
        ge=0,
        description="KV-cache bytes per token at float16 (llama.cpp's default KV type); plans "
        "count kv_elements_per_token at their compute dtype",
    )
    recurrent_state_elements_per_sequence: int = Field(
        default=0,
        ge=0,
        description="hybrid models: the fixed recurrent state one sequence holds whatever its "
        "length, elements over all gated delta-net blocks (conv state + delta-net state); kept "
        "at float32, as llama.cpp keeps it (0: no recurrent blocks)",
    )
    bytes_gguf: int = Field(ge=0, description="sum of tensor bytes on disk")
    bytes_mlx: int = Field(ge=0, description="sum of tensor bytes in MLX form")
    units: list[UnitInfo]
    tensors: list[TensorInfo]
    routing: RoutingSummary | None = Field(
        default=None,
        description="the routing profile whose measured frequencies replaced uniform expert "
        "access (None: uniform top-k/n)",
    )

    @field_validator("format_version")
    @classmethod
    def _major(cls, v: str) -> str:
        return check_major(v, DESCRIPTION_VERSION, "model description")


class RoutingProfile(Strict):
    """Measured MoE routing of one model (``strata run --save-routing-profile``), which
    ``strata plan --routing-profile`` uses in place of uniform top-k/n access. Arrays are
    nested lists: [layer][expert] and [layer][expert][expert]."""

    format_version: str = ROUTING_VERSION
    model_sha256: str | None = Field(description="sha256 of the GGUF the routing was measured on")
    header_sha256: str = Field(description="its header sha256")
    layers: int = Field(ge=1)
    expert_count: int = Field(ge=1)
    tokens: list[int] = Field(description="tokens routed through each block")
    counts: list[list[int]] = Field(description="[layer][expert]: times the expert was chosen")
    successor: list[list[list[int]]] = Field(
        description="[layer][e][f]: tokens that chose e in block layer and f in block layer + 1"
    )
    coactivation: list[list[list[int]]] = Field(
        default_factory=list,
        description="[layer][e][f]: tokens that chose both e and f in block layer (e != f)",
    )
    predicted: int = Field(default=0, ge=0, description="next-block experts predicted (prefetch)")
    predicted_hits: int = Field(default=0, ge=0, description="predictions the next block chose")

    @field_validator("format_version")
    @classmethod
    def _major(cls, v: str) -> str:
        return check_major(v, ROUTING_VERSION, "routing profile")


class RoutingSummary(Strict):
    """What a description took from a routing profile."""

    sha256: str = Field(description="sha256 of the routing profile's canonical content")
    tokens: int = Field(ge=0, description="tokens measured (the least over blocks)")
    prediction_recall: float = Field(
        ge=0, le=1, description="share of a block's chosen experts the successor counts predicted"
    )


# --------------------------------------------------------------------------- hardware profile

Source = Literal["measured", "spec", "derived", "assumed"]

# Plausibility bounds of a hardware profile's figures (issue 35, as MAX_TOKENS and MAX_COUNT bound
# a plan's): far above any machine Strata can run on, so that only a typo, a unit slip (GB/s for
# B/s) or a hostile file is refused, when it is read, before the cost model or the executor sizes
# anything from it. Each refusal is one line naming the field, the value and the fix.

PROFILE_FIX = "re-run `strata profile` on the machine or edit the value"
"""The fix a refused profile figure names."""

MAX_MEMORY_BYTES = 1 << 50
"""Bound on a memory size (working set, RAM, OS reserve): 1 PiB, over a thousand times the largest
single machine's memory (a few TiB); a larger figure is a unit or digit slip."""

MAX_BANDWIDTH_BYTES_S = 10**14
"""Bound on a bandwidth (device memory, host-to-device copy, disk read): 100 TB/s, over ten times
the fastest HBM (about 8 TB/s); a larger figure is most likely bits or a unit slip."""

MAX_FLOPS_S = 10**18
"""Bound on a compute throughput: 1 EFLOP/s, fifty times one accelerator's 4-bit peak (about
20 PFLOP/s); a profile describes one device, not a cluster."""

MAX_OP_SECONDS = 1.0
"""Bound on the cost of one graph operation: a second is 10^5 times any launch cost measured
(microseconds); a larger figure is milliseconds or microseconds written as seconds."""

MAX_ROWS = 1 << 24
"""Bound on a kernel crossover, in rows (tokens of one forward pass): no pass has more tokens than
a plan's MAX_TOKENS, which is the same number."""

MAX_SAMPLES = 1 << 16
"""Bound on the measurements behind one figure: ``strata profile`` takes a handful."""

MAX_BLOCK_BYTES = 1 << 30
"""Bound on the read size of the disk test: 1 GiB, 256 times the 4 MiB ``strata profile`` uses."""

MAX_QUEUE_DEPTH = 1024
"""Bound on the disk test's reads in flight: a plan's ``prefetch.io_threads`` is this figure and
is bounded at 1024 (a thread each)."""


def _refuse(value: object, problem: str) -> ValueError:
    return ValueError(f"{value} {problem}; {PROFILE_FIX}")


def _within(
    upper: float, bound: str, unit: str, *, positive: bool = False, whole: bool = False
) -> AfterValidator:
    """A check of a :class:`Figure`'s value against a plausibility bound.

    Args:
        upper: the largest plausible value, in ``unit``.
        bound: the bound's name as the error message shows it (its constant's).
        unit: the unit of the value, for the message.
        positive: refuse 0 (a rate the cost model divides by).
        whole: refuse a fraction (a count of rows).
    """

    def check(figure: Figure) -> Figure:
        v = figure.value
        if positive and v <= 0:
            raise _refuse(f"{v:g} {unit}", "must be above 0 (the cost model divides by it)")
        if whole and not float(v).is_integer():
            raise _refuse(f"{v:g} {unit}", "is not a whole number")
        if v > upper:
            raise _refuse(f"{v:g} {unit}", f"is over the plausible bound {bound} = {upper:g}")
        return figure

    return AfterValidator(check)


class Figure(Strict):
    """A number with how it was obtained.

    Raises (on validation):
        ValueError: the value is not finite or is negative, or the sample count is over
            ``MAX_SAMPLES``; the message names the value and the fix (``PROFILE_FIX``).
    """

    value: float = Field(
        strict=True,
        description="the number, finite and >= 0, in the unit its field name states (plain "
        "bytes, bytes/s, FLOP/s, seconds, rows); each field bounds it further (MAX_* above)",
    )
    source: Source = Field(description="measured here, from a spec sheet, derived, or assumed")
    how: str = Field(min_length=1, description="method and date, or the spec's source")
    samples: int | None = Field(
        default=None, description="measurements taken (the value is their median), 1 or more"
    )
    spread: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="(max - min) / median of those measurements: how steady the figure is",
    )

    @field_validator("value", mode="before")
    @classmethod
    def _finite(cls, v: object) -> object:
        # before the float check, so that an integer too large for a float is named too
        if isinstance(v, bool) or not isinstance(v, int | float):
            return v  # the strict float check refuses it
        if isinstance(v, int) and v.bit_length() > 1023:  # at the edge of the float range
            raise _refuse(f"a {v.bit_length()}-bit integer", "is too large")
        if not math.isfinite(v):
            raise _refuse(v, "is not a finite number")
        if v < 0:
            raise _refuse(f"{v:g}", "is negative")
        return v

    @field_validator("samples")
    @classmethod
    def _samples(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_SAMPLES:
            raise _refuse(v, f"samples is outside 1..{MAX_SAMPLES} (MAX_SAMPLES)")
        return v

    @model_serializer(mode="wrap")
    def _without_unmeasured(self, handler):  # stated figures carry no samples: not written
        data = handler(self)
        for key in ("samples", "spread"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


BytesFigure = Annotated[Figure, _within(MAX_MEMORY_BYTES, "MAX_MEMORY_BYTES", "bytes")]
"""A memory size: 0 to ``MAX_MEMORY_BYTES`` bytes."""
RateFigure = Annotated[
    Figure, _within(MAX_BANDWIDTH_BYTES_S, "MAX_BANDWIDTH_BYTES_S", "bytes/s", positive=True)
]
"""A bandwidth: above 0, at most ``MAX_BANDWIDTH_BYTES_S``."""
FlopsFigure = Annotated[Figure, _within(MAX_FLOPS_S, "MAX_FLOPS_S", "FLOP/s", positive=True)]
"""A compute throughput: above 0, at most ``MAX_FLOPS_S``."""
SecondsFigure = Annotated[Figure, _within(MAX_OP_SECONDS, "MAX_OP_SECONDS", "s")]
"""A per-operation time: 0 to ``MAX_OP_SECONDS``."""
RowsFigure = Annotated[Figure, _within(MAX_ROWS, "MAX_ROWS", "rows", whole=True)]
"""A row count: a whole number, 0 to ``MAX_ROWS``."""


class GPUTier(Strict):
    """The device working set: where weights must be to be computed on at full speed.

    Raises (on validation):
        ValueError: a figure outside its bound (``BytesFigure``, ``RateFigure``...), one line
            naming the value and the fix.
    """

    working_set_bytes: BytesFigure = Field(description="bytes the device may keep resident")
    memory_bandwidth_bytes_s: RateFigure = Field(
        description="device memory read bandwidth, bytes/s"
    )
    compute_flops_s: FlopsFigure = Field(
        description="sustained matrix-matrix throughput (prefill, batched decode), FLOP/s"
    )
    decode_matvec_flops_s: FlopsFigure = Field(
        description="quantized matrix-vector throughput (one decoded token), FLOP/s"
    )
    decode_batch_flops_s: FlopsFigure | None = Field(
        default=None,
        description="quantized matrix product throughput for a batch of 16 decoded tokens, "
        "FLOP/s; None where not measured (the cost model then charges batched decode at "
        "compute_flops_s)",
    )
    op_overhead_s: SecondsFigure = Field(
        description="seconds per operation of a lazily built MLX graph (build + dispatch + launch)"
    )
    dequant_matmul_min_rows: RowsFigure | None = Field(
        default=None,
        description="rows (tokens of one forward pass) from which dequantize + matmul beats MLX's "
        "quantized matmul (0: never); None where not measured (the CPU, where the quantized "
        "kernel keeps results batch-invariant)",
    )
    mma_matmul_min_rows: RowsFigure | None = Field(
        default=None,
        description="smallest row count of the range where Strata's own kernels (one row: the "
        "matvec, executor.cuda_qmv; more: the tensor-core 4-bit matmul, executor.cuda_mma) beat "
        "MLX's quantized matmul (0: nowhere); None where not measured (backends other than CUDA)",
    )
    mma_matmul_max_rows: RowsFigure | None = Field(
        default=None,
        description="largest row count of that range (0: nowhere); None where not measured",
    )


class RAMTier(Strict):
    """Host RAM outside the device working set."""

    capacity_bytes: BytesFigure = Field(description="total host RAM, bytes")
    host_to_device_bytes_s: RateFigure = Field(
        description="copy bandwidth from a host buffer into a device (MLX) array, bytes/s"
    )


class NVMeTier(Strict):
    """The disk that holds the model files, read with direct I/O."""

    read_bytes_s: RateFigure = Field(description="direct-I/O sequential read bandwidth, bytes/s")
    block_bytes: int = Field(
        description="read size of the bandwidth test, bytes: 512 to MAX_BLOCK_BYTES"
    )
    queue_depth: int = Field(
        description="reads in flight during the bandwidth test: 1 to MAX_QUEUE_DEPTH"
    )

    @field_validator("block_bytes")
    @classmethod
    def _block(cls, v: int) -> int:
        if not 512 <= v <= MAX_BLOCK_BYTES:
            raise _refuse(f"{v} bytes", f"is outside 512..{MAX_BLOCK_BYTES} (MAX_BLOCK_BYTES)")
        return v

    @field_validator("queue_depth")
    @classmethod
    def _depth(cls, v: int) -> int:
        if not 1 <= v <= MAX_QUEUE_DEPTH:
            raise _refuse(v, f"is outside 1..{MAX_QUEUE_DEPTH} (MAX_QUEUE_DEPTH)")
        return v


class HardwareProfile(Strict):
    """A machine: tier capacities and bandwidths, compute, reserve."""

    format_version: str = PROFILE_VERSION
    name: str = Field(min_length=1, description="short machine name, e.g. m1-max-32gb")
    description: str = Field(description="what the machine is")
    backend: Literal["cpu", "metal", "cuda"] = Field(description="MLX backend the executor uses")
    unified_memory: bool = Field(description="GPU and CPU share one physical memory (Apple, CPU)")
    compute_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        description="activation and KV-cache dtype (float32 on CPU: MLX's CPU float16 is slow)"
    )
    os_reserve_bytes: BytesFigure = Field(description="memory left to the OS and other programs")
    gpu: GPUTier
    ram: RAMTier
    nvme: NVMeTier

    @field_validator("format_version")
    @classmethod
    def _major(cls, v: str) -> str:
        return check_major(v, PROFILE_VERSION, "hardware profile")


# --------------------------------------------------------------------------- plan


class RoutingRef(Strict):
    """The routing profile a MoE plan was made with: its identity and where it was."""

    sha256: str = Field(description="sha256 of the routing profile's canonical content")
    path: str | None = Field(
        default=None,
        description="where it was when planned (absolute): a hint; the executor also looks in "
        "the cache, where strata plan keeps a copy by sha256",
    )


class Provenance(Strict):
    """How a plan was made. Nothing here decides how it runs: the digests let ``strata explain``
    and ``strata run`` tell a plan the solver wrote from one edited since."""

    planner_version: str | None = None
    method: Literal["ilp", "baseline"] = Field(
        default="ilp",
        description="who made the decisions: the ILP, or the baseline rule (first blocks "
        "resident in order, the rest on the next tier: llama.cpp's -ngl/--fit) that "
        "strata plan --baseline writes for comparison",
    )
    solver: str | None = Field(default=None, description="solver name, version and options")
    profile_file: str | None = Field(
        default=None,
        description="name of the profile file the machine figures were read from (for review "
        "only: the figures themselves are in the plan's machine section)",
    )
    routing_profile: RoutingRef | None = Field(
        default=None, description="the routing profile the expert access came from (MoE)"
    )
    request_sha256: str | None = Field(
        default=None, description="canonical sha256 of the request section as planned"
    )
    decisions_sha256: str | None = Field(
        default=None,
        description="canonical sha256 of the decisions as the solver wrote them (runtime, "
        "placement, pool, prefetch, expert cache, batch limits, speculative settings) and of the "
        "machine and costs sections they were judged with; a plan that no longer matches is "
        "shown as edited by hand",
    )


class UnitCosts(Strict):
    """One placement unit as the cost model sees it (from the model description): enough to
    re-score a plan's decisions without the GGUF file."""

    name: str
    role: Role
    layer: int | None = Field(default=None, ge=0)
    expert: int | None = Field(default=None, ge=0)
    bytes: int = Field(ge=0, description="bytes in MLX form")
    access: float = Field(ge=0, le=1, description="fraction one decoded token reads")
    flops: int = Field(ge=0, description="multiply-adds x 2 of one decoded token")


class ModelCosts(Strict):
    """What the cost model needs of the model, embedded so that any view of the plan (explain,
    diff, check, bench) is computed from the plan alone."""

    architecture: Architecture
    kv_elements_per_token: int = Field(ge=0)
    routing: RoutingSummary | None = None
    units: list[UnitCosts]


MAX_TOKENS = 1 << 24
"""Bound on any count of tokens in a plan (context, step budget, prefill chunk): above the
longest training context any GGUF declares (10 M tokens), so that a mistyped or hostile plan is
refused here rather than tried (issue 35: ``context: 10^7`` allocated)."""

MAX_SEQUENCES = 1 << 14
"""Bound on sequences served at once: far above what one machine's KV cache holds."""

MAX_KV_TOKENS = 1 << 28
"""Bound on context x concurrency, the KV cache's tokens: 268 M, more than any machine holds,
and what keeps ``kv_num_blocks`` (16 tokens a block) within ``MAX_COUNT``."""

MAX_COUNT = 1 << 24
"""Bound on a count of slots, blocks or threads in a plan (pool and cache slots, KV blocks,
prefetch depth): 16 M, above any machine's need (``kv_num_blocks: 10^9`` was a MemoryError)."""


class Request(Strict):
    """What the plan was asked to serve."""

    context: int = Field(
        ge=1, le=MAX_TOKENS, description="tokens of context per sequence (prompt + output)"
    )
    concurrency: int = Field(
        default=1, ge=1, le=MAX_SEQUENCES, description="sequences served at once"
    )
    objective: Literal["latency", "throughput"] = "latency"
    gpu_budget_bytes: int | None = Field(default=None, ge=0, description="override of the profile")
    ram_budget_bytes: int | None = Field(default=None, ge=0, description="override of the profile")
    tiers: list[Tier] = Field(
        default=["gpu", "ram", "nvme"],  # pydantic copies mutable defaults per instance
        min_length=1,
        description="tiers the plan may use (e.g. [gpu, ram] for an executor without streaming)",
    )

    prompt_tokens: list[int] = Field(
        min_length=2,
        max_length=2,
        description="[shortest, longest] prompt the plan is for, tokens: the cost model prices "
        "time to first token at both ends (the objective weighs their mean); default "
        "[min(128, context / 4), min(1024, context / 2)]",
    )
    output_tokens: int = Field(
        ge=1,
        description="tokens generated per request: weighs time to first token against decode "
        "in the objective; default min(256, what the context leaves after the longest prompt)",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_prompts(cls, data: object) -> object:
        c = data.get("context") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(c, int) or c < 1:
            return data
        if data.get("prompt_tokens") is None:
            data = {**data, "prompt_tokens": [max(1, min(128, c // 4)), max(1, min(1024, c // 2))]}
        if data.get("output_tokens") is None:
            prompts = data["prompt_tokens"]
            longest = prompts[-1] if isinstance(prompts, list) and prompts else 0
            longest = longest if isinstance(longest, int) else 0
            data = {**data, "output_tokens": max(1, min(256, c - longest))}
        return data

    @field_validator("prompt_tokens")
    @classmethod
    def _prompt_range(cls, v: list[int]) -> list[int]:
        if v[0] < 1 or v[1] < v[0]:
            raise ValueError(f"give [shortest, longest] with 1 <= shortest <= longest (got {v})")
        return v

    @model_validator(mode="after")
    def _prompts_fit(self) -> Request:
        if self.context * self.concurrency > MAX_KV_TOKENS:
            raise ValueError(
                f"context {self.context} x concurrency {self.concurrency} is "
                f"{self.context * self.concurrency} tokens of KV cache, over the {MAX_KV_TOKENS} "
                "a plan may hold; give a shorter context or fewer sequences"
            )
        if self.prompt_tokens[1] >= self.context and self.context > 1:
            raise ValueError(
                f"prompt_tokens {self.prompt_tokens[1]} leaves no room in a context of "
                f"{self.context} tokens; give a longer context or shorter prompts"
            )
        if self.prompt_tokens[1] + self.output_tokens > self.context > 1:
            raise ValueError(
                f"the longest prompt ({self.prompt_tokens[1]} tokens) and output_tokens "
                f"({self.output_tokens}) do not fit a context of {self.context} tokens; give a "
                "longer context, shorter prompts or fewer output tokens"
            )
        return self

    @field_validator("tiers")
    @classmethod
    def _tiers_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"each tier once, e.g. gpu,ram (got {','.join(v)})")
        return v


class Placement(Strict):
    """One unit on one tier (of one host, in a cluster plan)."""

    unit: str
    tier: Tier
    bytes: int = Field(ge=0, description="MLX-form bytes of the unit")
    host: str | None = Field(
        default=None,
        description="cluster plans: the host (``cluster.stages[].host``) that holds the unit; "
        "None on a one-host plan",
    )

    @model_serializer(mode="wrap")
    def _one_host(self, handler):  # a one-host plan's rows stay as they were: no host key
        data = handler(self)
        if data.get("host") is None:
            data.pop("host", None)
        return data


class Pool(Strict):
    """The streaming pool: fixed slots that NVMe reads land in, reused without reallocation."""

    slots: int = Field(ge=0, le=MAX_COUNT)
    slot_bytes: int = Field(ge=0, description="bytes per slot (the largest streamed unit)")


class Prefetch(Strict):
    """How far ahead streamed units are read."""

    depth: int = Field(ge=0, le=MAX_COUNT, description="units read ahead of the one being computed")
    io_threads: int = Field(ge=0, le=1024)


class ExpertCache(Strict):
    """MoE expert cache for experts streamed from NVMe (zero for dense models)."""

    slots: int = Field(
        default=0,
        ge=0,
        le=MAX_COUNT,
        description="device slots holding streamed experts (LFU eviction)",
    )
    slot_bytes: int = Field(default=0, ge=0, description="bytes per slot (the largest expert)")
    prefetch: int = Field(
        default=0, ge=0, description="experts of the next block prefetched per block (0: none)"
    )
    pinned: list[str] = Field(
        default_factory=list,
        description="expert units kept on the gpu tier (the placement's, listed for review)",
    )
    preload: list[str] = Field(
        default_factory=list,
        description="streamed experts read into the cache when the executor starts, hottest "
        "first: the routing profile's hot set the cost model counts as cached (empty without "
        "a profile: the cache then learns it from misses)",
    )


class BatchLimits(Strict):
    """Continuous-batching limits, sized from the memory left for the KV cache."""

    max_num_seqs: int = Field(ge=1, le=MAX_SEQUENCES)
    max_num_batched_tokens: int = Field(ge=1, le=MAX_TOKENS, description="token budget of one step")
    kv_block_size: int = Field(ge=1, le=4096, description="tokens per KV-cache block")
    kv_num_blocks: int = Field(ge=1, le=MAX_COUNT)
    prefill_chunk: int = Field(ge=1, le=MAX_TOKENS, description="tokens of one prefill chunk")


class TierMemory(Strict):
    """Bytes a tier holds under the plan, and its capacity."""

    capacity: int = Field(ge=0)
    weights: int = Field(ge=0)
    kv_cache: int = Field(default=0, ge=0)
    pool: int = Field(default=0, ge=0)
    expert_cache: int = Field(default=0, ge=0)
    activations: int = Field(default=0, ge=0)
    recurrent_state: int = Field(
        default=0,
        ge=0,
        description="hybrid models: the gated delta-net blocks' fixed recurrent state, one per "
        "sequence the batch holds (beside the KV cache of the attention blocks)",
    )


class Prediction(Strict):
    """The cost model's per-token prediction for one decode step at the plan's batch."""

    compute_s: float = Field(ge=0, description="device compute + device-memory reads, seconds")
    host_copy_s: float = Field(ge=0, description="RAM -> device copies, seconds")
    disk_s: float = Field(ge=0, description="NVMe reads, seconds")
    io_stall_s: float = Field(
        default=0.0,
        ge=0,
        description="compute-thread wait for reads that cannot start before a slot frees, seconds",
    )
    expert_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="predicted share of streamed-expert uses served by the expert cache",
    )
    step_s: float = Field(ge=0, description="predicted time of one decode step, seconds")
    bottleneck: Literal["compute", "host_copy", "disk"]
    decode_tok_s: float = Field(ge=0, description="aggregate decode tokens/s at the plan's batch")
    binding: list[str] = Field(default_factory=list, description="constraints at their bound")
    prefill_chunk_s: float | None = Field(
        default=None,
        ge=0,
        description="one prefill chunk of batch.prefill_chunk tokens of one sequence, seconds "
        "(every unit read once per chunk: streamed units are read again for each chunk)",
    )
    ttft_s: list[float] = Field(
        default_factory=list,
        description="time to first token of one sequence at request.prompt_tokens' shortest and "
        "longest prompt, seconds",
    )


class SolverResult(Strict):
    """How the ILP ended (solve time goes to stderr, never into the plan)."""

    name: str
    status: Literal["Optimal"]
    objective: float
    gap: float = Field(ge=0)


class Runtime(Strict):
    """Executor settings that follow from the profile."""

    backend: Literal["cpu", "metal", "cuda"] = "cpu"
    compute_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    dequant_matmul_min_rows: int = Field(
        default=0,
        ge=0,
        description="kernel path of quantized projections: forward passes of at least this many "
        "tokens dequantize each weight and run a dense matmul (0: always the quantized matmul); "
        "the profile's measured crossover",
    )
    mma_matmul_min_rows: int = Field(
        default=0,
        ge=0,
        description="kernel path of quantized projections: forward passes of mma_matmul_min_rows "
        "to mma_matmul_max_rows tokens use Strata's own kernels where they apply (one row: the "
        "matvec; more: the tensor-core 4-bit matmul; 0: never); the profile's measured range",
    )
    mma_matmul_max_rows: int = Field(default=0, ge=0, description="see mma_matmul_min_rows")


SpeculativeMethod = Literal["none", "prompt_lookup", "draft_model", "self"]
"""Where draft tokens come from: nowhere (plain decoding), n-grams of the sequence itself (prompt
lookup), a second, smaller model of the same vocabulary, or the target's own resident layers."""


class DraftModelRef(Strict):
    """The draft model of ``speculative.method: draft_model``: which file, and what it holds.

    The executor refuses a plan whose draft model file changed, as it does for the target. Its
    weights, all on the gpu tier, and its paged KV cache (the target's ``kv_num_blocks`` blocks of
    ``kv_block_size`` tokens) were taken off the gpu budget before the target was placed.
    """

    name: str | None = Field(description="catalog name (e.g. smollm2-135m), None for a path")
    path: str | None = Field(
        description="the GGUF file it was planned with (absolute): a hint, looked for as the "
        "target model is (None for a catalog model)"
    )
    size_bytes: int = Field(ge=0, description="file size")
    sha256: str = Field(description="file sha256")
    header_sha256: str = Field(description="sha256 of the metadata and tensor table (the header)")
    bytes_mlx: int = Field(ge=0, description="bytes of its weights in MLX form, all on gpu")
    kv_cache_bytes: int = Field(
        ge=0, description="bytes of its paged KV cache (the target's batch limits), on gpu"
    )
    activation_bytes: int = Field(
        default=0,
        ge=0,
        description="bytes its largest pass needs beyond the target's activation reserve (the "
        "two models' passes never run at once, so they share it), on gpu",
    )


class Speculative(Strict):
    """Speculative decoding: how many draft tokens each decode step verifies, from which drafter,
    and what the cost model predicts for it (``planner.speculative``).

    Each step verifies, per decoding sequence, the pending token plus up to ``num_draft_tokens``
    drafts in one batched forward pass, and keeps the accepted drafts plus one token (Leviathan et
    al. 2023; Chen et al. 2023): the output distribution is the target's exactly.
    """

    method: SpeculativeMethod = Field(default="none", description="the drafter (none: off)")
    num_draft_tokens: int = Field(
        default=0, ge=0, le=16, description="K: most draft tokens verified per sequence and step"
    )
    draft_layers: int = Field(
        default=0,
        ge=0,
        description="self: the leading blocks the self-drafter runs (skipping those blocks' "
        "units on nvme) before the output head; 0 for the other methods",
    )
    draft_model: DraftModelRef | None = Field(
        default=None, description="the draft model (method draft_model only)"
    )
    activation_bytes: int = Field(
        default=0,
        ge=0,
        description="device bytes a verification pass needs beyond the plan's activation "
        "reserve (a float32 logits row for each of its B (K + 1) tokens), out of the memory the "
        "placement leaves free",
    )
    acceptance_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="a: the probability that a draft token is accepted, the figure the choice of "
        "K used (i.i.d. per token, Leviathan et al. 2023 eq. 1)",
    )
    acceptance_source: Literal["assumed", "measured"] | None = Field(
        default=None, description="where a came from (None when method is none)"
    )
    acceptance_how: str | None = Field(
        default=None, description="the rule behind an assumed a, or where a measured one came from"
    )
    predicted_tokens_per_step: float = Field(
        default=1.0,
        ge=1,
        description="E = (1 - a^(K+1)) / (1 - a): tokens one verification step yields per "
        "sequence (1 without speculation)",
    )
    predicted_verify_s: float | None = Field(
        default=None, ge=0, description="the verification pass of K + 1 tokens per sequence, s"
    )
    predicted_draft_s: float | None = Field(
        default=None, ge=0, description="the K draft passes of one step together, seconds"
    )
    predicted_step_s: float | None = Field(
        default=None, ge=0, description="verification + drafts: one speculative step, seconds"
    )
    predicted_decode_tok_s: float | None = Field(
        default=None,
        ge=0,
        description="aggregate decode tokens/s with speculation, B E / step (prediction."
        "decode_tok_s is the same placement without it)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        m = self.method
        if m == "none" and (self.num_draft_tokens or self.draft_layers or self.draft_model):
            raise ValueError(
                "method none takes no num_draft_tokens, draft_layers or draft_model; set them to "
                "0 / null or choose a method"
            )
        if m != "none" and self.num_draft_tokens < 1:
            raise ValueError(f"method {m} needs num_draft_tokens of 1..16")
        if (m == "draft_model") != (self.draft_model is not None):
            raise ValueError("draft_model is given exactly when method is draft_model")
        if (m == "self") != (self.draft_layers > 0):
            raise ValueError("draft_layers is 1..block_count for method self and 0 otherwise")
        return self


# --------------------------------------------------------------------------- clusters

Backend = Literal["ring", "jaccl", "mpi", "nccl"]
"""MLX's distributed backends (``mlx.core.distributed``): ring over TCP, JACCL (RDMA over
Thunderbolt 5), MPI, NCCL (NVIDIA GPUs)."""

HOST_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class ClusterLink(Strict):
    """A link between two hosts: what one activation transfer over it costs.

    A transfer of ``n`` bytes is priced ``latency_s + n / bandwidth_bytes_s``."""

    hosts: list[str] = Field(min_length=2, max_length=2, description="the two hosts' names")
    bandwidth_bytes_s: RateFigure = Field(description="one direction, bytes/s")
    latency_s: SecondsFigure = Field(description="one message of a few bytes, one way, seconds")

    @field_validator("hosts")
    @classmethod
    def _two(cls, v: list[str]) -> list[str]:
        if v[0] == v[1]:
            raise ValueError(f"a link joins two different hosts (got {v[0]} twice)")
        return v


class ClusterHostSpec(Strict):
    """One host of a cluster description (the input of ``strata plan --cluster``)."""

    name: str = Field(pattern=HOST_NAME_PATTERN, description="short name, unique in the cluster")
    address: str = Field(
        min_length=1,
        description="how the launcher reaches it (host name or IP; 127.0.0.1 for a rank on "
        "this machine)",
    )
    profile: str = Field(
        min_length=1,
        description="its hardware profile (YAML, as strata profile writes it on that host), a "
        "path relative to the cluster file",
    )
    gpu_budget_bytes: int | None = Field(
        default=None, ge=0, description="override of the profile (bytes, or a size like 2GiB)"
    )
    ram_budget_bytes: int | None = Field(
        default=None, ge=0, description="override of the profile (bytes, or a size like 8GiB)"
    )

    @field_validator("gpu_budget_bytes", "ram_budget_bytes", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        if isinstance(v, str):
            from strata.common.errors import StrataError
            from strata.common.sizes import parse_size

            try:
                return parse_size(v)
            except StrataError as e:
                raise ValueError(str(e)) from None
        return v


class ClusterDescription(Strict):
    """Hosts and the links between them (``strata plan --cluster FILE``): the first host is
    rank 0, which holds the token embedding and the output head and serves the API."""

    format_version: str = CLUSTER_VERSION
    name: str = Field(min_length=1)
    backend: Backend = Field(default="ring", description="MLX's distributed backend")
    hosts: list[ClusterHostSpec] = Field(min_length=1, max_length=64)
    links: list[ClusterLink] = Field(default_factory=list)

    @field_validator("format_version")
    @classmethod
    def _major(cls, v: str) -> str:
        return check_major(v, CLUSTER_VERSION, "cluster description")


class StagePlan(Strict):
    """One host's part of a cluster plan: a contiguous run of blocks (a pipeline stage) and
    what a one-host plan decides for it. Stage ``i`` runs on rank ``i``; stage 0 also holds the
    token embedding and the output head (``strata.common.cluster.stage_units``)."""

    host: str = Field(pattern=HOST_NAME_PATTERN)
    address: str = Field(min_length=1)
    first_block: int = Field(ge=0, description="the stage's first block")
    end_block: int = Field(ge=0, description="one past its last block")
    machine: HardwareProfile = Field(description="the host's figures the stage was solved with")
    runtime: Runtime = Field(default_factory=Runtime)
    gpu_budget_bytes: int | None = Field(default=None, ge=0)
    ram_budget_bytes: int | None = Field(default=None, ge=0)
    pool: Pool = Field(default_factory=lambda: Pool(slots=0, slot_bytes=0))
    prefetch: Prefetch = Field(default_factory=lambda: Prefetch(depth=0, io_threads=0))
    expert_cache: ExpertCache = Field(default_factory=ExpertCache)
    memory: dict[Tier, TierMemory] | None = None
    prediction: Prediction | None = Field(
        default=None, description="the stage's own decode step on its host, links excluded"
    )

    @model_validator(mode="after")
    def _range(self) -> StagePlan:
        if self.end_block < self.first_block:
            raise ValueError(
                f"stage {self.host}: end_block {self.end_block} is before first_block "
                f"{self.first_block}"
            )
        return self


class LinkPlan(Strict):
    """One stage boundary of a cluster plan: the residual stream of every pass row crosses it."""

    hosts: list[str] = Field(min_length=2, max_length=2, description="from, to")
    bandwidth_bytes_s: RateFigure
    latency_s: SecondsFigure
    bytes_per_token: int = Field(ge=0, description="activation bytes one token sends over it")
    predicted_s: float = Field(ge=0, description="its transfer time in one decode step, seconds")


class ClusterPrediction(Strict):
    """The pipeline's decode step: stages and link transfers in turn, or ``micro_batches`` of
    the step flowing through them (``planner.pipeline``)."""

    step_s: float = Field(ge=0, description="one decode step at the plan's batch, seconds")
    decode_tok_s: float = Field(ge=0, description="aggregate decode tokens/s")
    binding: str = Field(description="what bounds it: 'host NAME' or 'link A-B'")
    micro_batches: int = Field(default=1, ge=1, description="micro-batches a step is cut into")


class Cluster(Strict):
    """A plan over several hosts: pipeline stages of contiguous blocks, each a one-host plan of
    its own units, joined by links. Rank ``i`` runs ``stages[i]``; the residual stream goes from
    stage to stage and, after the last, back to rank 0 for the output head."""

    name: str = Field(min_length=1)
    backend: Backend = "ring"
    stages: list[StagePlan] = Field(min_length=1, max_length=64)
    links: list[LinkPlan] = Field(
        default_factory=list,
        description="boundary i carries stage i's output to stage i+1, the last back to stage 0",
    )
    prediction: ClusterPrediction | None = None

    @model_validator(mode="after")
    def _stages(self) -> Cluster:
        names = [s.host for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"each host runs one stage (hosts: {', '.join(names)})")
        end = 0
        for s in self.stages:
            if s.first_block != end:
                raise ValueError(
                    f"stage {s.host} starts at block {s.first_block}; the stages must cover the "
                    f"blocks in order without gaps (expected {end})"
                )
            end = s.end_block
        return self


class Plan(Strict):
    """A plan: where every unit lives and how the executor runs, self-contained: the model's
    identity, the machine figures it was solved with and the model's cost inputs are inside it,
    so that it can be judged, diffed and run from any folder or machine. Hand-writable."""

    format_version: str = PLAN_VERSION
    model: ModelSource = Field(
        description="the model's identity (sha256, size, header) and where to find it: catalog "
        "name, and the absolute path it was planned from (a hint)"
    )
    machine: HardwareProfile = Field(
        description="the hardware figures the plan was solved with, each with its provenance"
    )
    request: Request
    runtime: Runtime = Field(default_factory=Runtime)
    placement: list[Placement]
    pool: Pool = Field(default_factory=lambda: Pool(slots=0, slot_bytes=0))
    prefetch: Prefetch = Field(default_factory=lambda: Prefetch(depth=0, io_threads=0))
    expert_cache: ExpertCache = Field(default_factory=ExpertCache)
    batch: BatchLimits
    speculative: Speculative = Field(default_factory=Speculative)
    memory: dict[Tier, TierMemory] | None = None
    prediction: Prediction | None = None
    solver: SolverResult | None = None
    costs: ModelCosts = Field(
        description="the model as the cost model sees it: views of the plan re-score its "
        "decisions from this and the machine figures"
    )
    provenance: Provenance = Field(default_factory=Provenance)
    cluster: Cluster | None = Field(
        default=None,
        description="a plan over several hosts (``strata plan --cluster``): the stages, links "
        "and the pipeline's prediction; the top-level machine, runtime, pool, prefetch, "
        "expert_cache, memory are stage 0's, the prediction the pipeline's",
    )

    @model_serializer(mode="wrap")
    def _one_host(self, handler):  # a one-host plan has no cluster key
        data = handler(self)
        if data.get("cluster") is None:
            data.pop("cluster", None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _version_first(cls, data: object) -> object:
        # A plan of another major version fails on its version, not on the keys it renamed.
        if isinstance(data, dict) and "format_version" in data:
            v = str(data["format_version"])
            if v.split(".")[0] != PLAN_VERSION.split(".")[0]:
                raise ValueError(
                    f"this plan is format {v}; this Strata reads plan format "
                    f"{PLAN_VERSION.split('.')[0]}.x (self-contained plans: the machine figures "
                    "and the model's identity inside the plan); re-run strata plan with the same "
                    "options to write it in the new format"
                )
        return data

    @field_validator("format_version")
    @classmethod
    def _major(cls, v: str) -> str:
        return check_major(v, PLAN_VERSION, "plan")

    def tier_of(self) -> dict[str, str]:
        """Unit name -> tier."""
        return {p.unit: p.tier for p in self.placement}
