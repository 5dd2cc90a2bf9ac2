"""Model descriptions and hardware profiles built in code, for planner tests (no GGUF needed)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.schemas import (
    Architecture,
    Figure,
    GPUTier,
    HardwareProfile,
    ModelDescription,
    ModelSource,
    NVMeTier,
    RAMTier,
    TensorInfo,
    UnitInfo,
)

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class U:
    """A synthetic unit: name, role, layer, MLX bytes, access per token, FLOPs per token."""

    name: str
    role: str
    layer: int | None
    bytes: int
    access: float = 1.0
    flops: int = 0


def make_desc(
    units: list[U],
    *,
    width: int = 64,
    ff: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    vocab: int = 256,
    blocks: int | None = None,
    kv_elements_per_token: int | None = None,
    name: str = "synthetic",
) -> ModelDescription:
    """A ModelDescription with one tensor per unit (GGUF bytes = MLX bytes)."""
    blocks = blocks or max([u.layer + 1 for u in units if u.layer is not None], default=1)
    kv = (
        kv_elements_per_token
        if kv_elements_per_token is not None
        else 2 * blocks * kv_heads * head_dim
    )
    tensors, infos, offset = [], [], 0
    for u in units:
        tname = f"{u.name}.weight"
        tensors.append(
            TensorInfo(
                name=tname,
                layer=u.layer,
                role=u.role,
                unit=u.name,
                shape=[u.bytes],
                ggml_type="Q4_0",
                offset=offset,
                bytes_gguf=u.bytes,
                bytes_mlx=u.bytes,
                supported=True,
                access_per_token=u.access,
            )
        )
        offset += u.bytes
        infos.append(
            UnitInfo(
                name=u.name,
                layer=u.layer,
                role=u.role,
                tensors=[tname],
                bytes_gguf=u.bytes,
                bytes_mlx=u.bytes,
                access_per_token=u.access,
                flops_per_token=u.flops,
                supported=True,
            )
        )
    total = sum(u.bytes for u in units)
    return ModelDescription(
        model=ModelSource(
            name=name, path=None, size_bytes=None, sha256=None, header_sha256="0" * 64
        ),
        architecture=Architecture(
            name="llama",
            block_count=blocks,
            context_length=131072,
            embedding_length=width,
            feed_forward_length=ff,
            head_count=heads,
            head_count_kv=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rope_freq_base=10000.0,
            rope_dimension_count=head_dim,
            rms_norm_eps=1e-5,
            tied_embeddings=False,
        ),
        file_type="MOSTLY_Q4_0",
        kv_elements_per_token=kv,
        kv_bytes_per_token=2 * kv,
        bytes_gguf=total,
        bytes_mlx=total,
        units=infos,
        tensors=tensors,
    )


def _fig(v: float) -> Figure:
    return Figure(value=v, source="assumed", how="synthetic test profile")


def make_profile(
    *,
    gpu_bytes: int,
    ram_bytes: int,
    reserve: int = 0,
    unified: bool = True,
    gpu_bw: float = 400e9,
    flops: float = 10e12,
    matvec_flops: float = 1e15,
    op_s: float = 0.0,
    h2d_bw: float = 50e9,
    nvme_bw: float = 5e9,
    dtype: str = "float16",
    name: str = "synthetic-machine",
) -> HardwareProfile:
    """A HardwareProfile with the given capacities (bytes) and rates (bytes/s, FLOP/s, seconds).

    The defaults make decode bandwidth-bound with no per-kernel cost, so tests reason in bytes.
    """
    return HardwareProfile(
        name=name,
        description="a machine made up for tests",
        backend="metal" if unified else "cuda",
        unified_memory=unified,
        compute_dtype=dtype,  # type: ignore[arg-type]
        os_reserve_bytes=_fig(reserve),
        gpu=GPUTier(
            working_set_bytes=_fig(gpu_bytes),
            memory_bandwidth_bytes_s=_fig(gpu_bw),
            compute_flops_s=_fig(flops),
            decode_matvec_flops_s=_fig(matvec_flops),
            op_overhead_s=_fig(op_s),
        ),
        ram=RAMTier(capacity_bytes=_fig(ram_bytes), host_to_device_bytes_s=_fig(h2d_bw)),
        nvme=NVMeTier(read_bytes_s=_fig(nvme_bw), block_bytes=1 << 20, queue_depth=8),
    )


def llama70b_desc() -> ModelDescription:
    """A Llama-3-70B-sized description in Q4 MLX form: 80 blocks, attention 0.2 GiB and FFN 0.4 GiB
    per block, 128k vocabulary (embedding and untied head ~0.55 GiB each): 162 units, ~49 GiB."""
    d, ff, vocab, layers = 8192, 28672, 128256, 80
    emb = int(vocab * d * 0.5625)  # 4.5 bits per weight
    units = [U("token_embd", "embedding", None, emb, access=1 / vocab)]
    for i in range(layers):
        units.append(
            U(f"blk.{i}.attn", "attention", i, int(0.2 * GIB), flops=2 * (2 * d * d + 2 * d * 1024))
        )
        units.append(U(f"blk.{i}.ffn", "ffn", i, int(0.4 * GIB), flops=2 * 3 * d * ff))
    units.append(U("output", "output", None, emb, flops=2 * vocab * d))
    return make_desc(
        units,
        width=d,
        ff=ff,
        heads=64,
        kv_heads=8,
        head_dim=128,
        vocab=vocab,
        blocks=layers,
        name="llama-70b-synthetic",
    )


def m1max32_profile() -> HardwareProfile:
    """An M1 Max with 32 GB unified memory (figures from the mission's published setup)."""
    return make_profile(
        gpu_bytes=int(21.3 * GIB),
        ram_bytes=32 * GIB,
        reserve=4 * GIB,
        unified=True,
        gpu_bw=400e9,
        flops=10.4e12,
        h2d_bw=60e9,
        nvme_bw=5.1e9,
        name="m1-max-32gb",
    )
