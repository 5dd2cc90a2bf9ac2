"""The few compute helpers the model code uses, so tier placement never changes numerics.

Every weight, wherever it lives, goes through :func:`to_mlx` and is used only through
:func:`linear`, :func:`embedding` and the fused products :func:`fused_qkv` / :func:`fused_swiglu`
(which take a tier's arrays as they are, for the same row counts on every tier); a layer
computes the same numbers whichever tier (memory, device) the planner puts it on.

Compute dtype is float32 on CPU: MLX's CPU backend is about 30x slower in float16 here.

Scales (measured on MLX 0.32.4, CPU): ``strata.common.quant.repack`` stores scales/biases as
float16 where that is exact. ``mx.quantized_matmul`` with float32 activations accepts them
(it inserts a cast of scales/biases to the activation dtype on every call; the result is
bit-identical to passing float32 scales), costing ~5-8 % at batch 1 on CPU. So
:func:`to_mlx` keeps the stored dtype by default (least memory) and, given
``dtype=mx.float32``, widens scales/biases once at load time (exact) to skip the per-call
cast. ``mx.dequantize`` with float16 scales computes in float16 even when asked for a
float32 result, so :func:`embedding` widens the gathered rows' scales before
dequantizing. Note: bfloat16 activations with float16 scales promote to a float32 result.

Kernel paths: which kernel computes a quantized product, and whether its rows are padded to a
bucket, is the runtime config's (``executor.config.RuntimeConfig``: ``pad_rows``, ``mma_rows``,
``dequant_min_rows``), handed to every product by the model that calls it.

Row tiles (batch-invariant serving, ``set_row_tile``): MLX's CUDA kernels round a row of a matmul
differently with the call's row count M (a row's result depends on M, not on the other rows'
contents: docs/kernels.md#batch-invariance), so a token's projections would depend on what else is
in the batch. With a row tile T, :func:`linear` computes every product in calls of exactly T rows,
so a row's result is the same whatever the batch. The setting is per thread: the serving engine's
thread turns it on for itself, and any other thread (``Engine.logits_for``) is unaffected.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from strata.common.quant import PackedWeight
from strata.executor import cuda_dequant, cuda_mma
from strata.executor.config import RuntimeConfig

__all__ = [
    "KERNEL_PATHS",
    "QuantLinear",
    "bucket_rows",
    "embedding",
    "fused_qkv",
    "fused_swiglu",
    "kernel_path",
    "linear",
    "linear_add",
    "quantized_product",
    "set_row_tile",
    "to_mlx",
]


def bucket_rows(rows: int) -> int:
    """The padded row count of a product of ``rows`` rows: the next power of two up to 16, 24
    for 17 to 24 rows, the next power of two up to 256, then the next multiple of 256 (at most
    2x the rows, at most 256 extra rows).

    24 is a bucket because the tensor-core kernel (``executor.cuda_mma``, the plans' path for
    2-32 rows on NVIDIA GPUs) computes whole 8-row column tiles, padding or not, so padding 24
    rows to 32 costs a quarter more of its work. Not 40, 48 or 56: those rows take MLX's
    quantized matmul there, whose first call at a new row count builds kernels for up to a
    minute (``RuntimeConfig.warm_up_row_buckets``). Figures: docs/kernels.md#row-buckets."""
    if 16 < rows <= 24:
        return 24
    if rows <= 256:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 256) * 256


_tiling = threading.local()
"""``rows``: this thread's row tile of :func:`linear` (absent or 0: off)."""


def set_row_tile(rows: int) -> None:
    """Compute every :func:`linear` of the calling thread in calls of exactly ``rows`` rows
    (zero rows pad the last tile; 0, the default, turns tiling off). Per thread, so that only
    the thread that asks for it (the batch-invariant serving engine's) is affected.

    Raises:
        ValueError: ``rows`` is negative.
    """
    if rows < 0:
        raise ValueError(f"set_row_tile: rows is {rows}; give a tile of >= 1 rows, or 0 for off")
    _tiling.rows = int(rows)


def row_tile() -> int:
    """The calling thread's row tile (0: off)."""
    return getattr(_tiling, "rows", 0)


@dataclass(frozen=True)
class QuantLinear:
    """An MLX affine-quantized ``[rows, cols]`` matrix (``out_features, in_features``).

    Attributes:
        weight: uint32 ``[rows, cols * bits // 32]``.
        scales: float ``[rows, cols // group_size]``.
        biases: same dtype and shape as ``scales``; ``w = scales * q + biases``.
        bits: bits per element (4, 5 or 8 for the GGUF types ``strata.common.quant`` repacks).
        group_size: elements per scale/bias group (32, or 128 for Q3_K).

    MXFP4 (``strata.common.quant``) is MLX's ``mode="mxfp4"`` instead: ``biases`` None, uint8
    E8M0 ``scales``, 4 bits in groups of 32 (:attr:`mode`); it takes MLX's own kernels only
    (``mx.quantized_matmul``/``mx.dequantize``), never Strata's CUDA ones (affine only).
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    bits: int
    group_size: int

    @property
    def mode(self) -> str:
        """MLX's quantization mode: ``"affine"``, or ``"mxfp4"`` where there are no biases."""
        return "affine" if self.biases is not None else "mxfp4"

    @functools.cached_property  # asked by every product (reading an array's shape is not free)
    def shape(self) -> tuple[int, int]:
        """Logical ``(rows, cols)`` = ``(out_features, in_features)``."""
        return int(self.weight.shape[0]), int(self.weight.shape[1]) * 32 // self.bits

    @functools.cached_property
    def scales_dtype(self) -> mx.Dtype:
        """The dtype of ``scales`` (and ``biases``)."""
        return self.scales.dtype

    @functools.cached_property
    def parts(self) -> tuple[mx.array, mx.array, mx.array]:
        """``(weight, scales, biases)``, as ``executor.cuda_mma`` takes a 4-bit weight."""
        return self.weight, self.scales, self.biases

    @functools.cached_property
    def signature(self) -> tuple:
        """The arrays' shapes and dtypes, the bits and the group size: what a kernel's launch
        depends on, read once (each read of an MLX array's shape or dtype costs the host a
        fraction of a us, and a pass asks for them hundreds of times)."""
        arrays = [a for a in (self.weight, self.scales, self.biases) if a is not None]
        return (*((a.shape, a.dtype) for a in arrays), self.bits, self.group_size)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of weight + scales + biases."""
        biases = 0 if self.biases is None else self.biases.nbytes
        return int(self.weight.nbytes + self.scales.nbytes + biases)


def _np_dtype(dtype: mx.Dtype) -> np.dtype | None:
    """The numpy dtype matching an MLX float dtype, or None (bfloat16 has none)."""
    return {mx.float32: np.dtype(np.float32), mx.float16: np.dtype(np.float16)}.get(dtype)


def _convert_exact(a: np.ndarray, dtype: mx.Dtype | None, what: str) -> mx.array:
    """``a`` as an mx array of ``dtype`` (None: as is), refusing any conversion that rounds."""
    if dtype is None:
        return mx.array(a)
    np_dtype = _np_dtype(dtype)
    if np_dtype is not None:
        with np.errstate(over="ignore"):
            converted = a.astype(np_dtype)
        same = converted.astype(np.float64) == a.astype(np.float64)
        if not np.all(same | (np.isnan(a) & np.isnan(converted))):
            raise ValueError(f"converting {what} from {a.dtype} to {dtype} would change values")
        return mx.array(converted)
    out = mx.array(a).astype(dtype)  # bfloat16: check on the MLX side
    back = np.array(out.astype(mx.float32)).astype(np.float64)
    if not np.all((back == a.astype(np.float64)) | (np.isnan(back) & np.isnan(a))):
        raise ValueError(f"converting {what} from {a.dtype} to {dtype} would change values")
    return out


def to_mlx(w: PackedWeight | np.ndarray, dtype: mx.Dtype | None = None) -> QuantLinear | mx.array:
    """Move a repacked weight (host numpy) into MLX arrays.

    Args:
        w: a :class:`strata.common.quant.PackedWeight` or a plain float numpy array, as
            returned by :func:`strata.common.quant.repack`.
        dtype: None keeps the stored dtypes (least memory). Otherwise the compute dtype:
            scales/biases of a quantized weight, or a plain float array, are converted to
            it once here (e.g. ``mx.float32`` on CPU, saving a cast per call). Only exact
            conversions are allowed.

    Returns:
        :class:`QuantLinear` for a PackedWeight, else an ``mx.array`` of ``w``'s shape.

    Raises:
        ValueError: the conversion to ``dtype`` would round or overflow some value.
        TypeError: ``w`` is neither a PackedWeight nor a numpy array.
    """
    if isinstance(w, PackedWeight) and w.biases is None:  # mxfp4: uint8 scales as they are
        return QuantLinear(mx.array(w.weight), mx.array(w.scales), None, w.bits, w.group_size)
    if isinstance(w, PackedWeight):
        return QuantLinear(
            weight=mx.array(w.weight),
            scales=_convert_exact(w.scales, dtype, "scales"),
            biases=_convert_exact(w.biases, dtype, "biases"),
            bits=w.bits,
            group_size=w.group_size,
        )
    if isinstance(w, np.ndarray):
        return _convert_exact(w, dtype, "weight")
    raise TypeError(f"to_mlx expects a PackedWeight or numpy array, got {type(w).__name__}")


def _fusable(x: mx.array, ws: list[QuantLinear], config: RuntimeConfig) -> bool:
    """Whether one fused tensor-core call (``executor.cuda_mma``) may take the products of ``x``
    ``[..., in]`` by ``ws``: no row tile (batch-invariant serving keeps every product on
    :func:`linear`'s tiles), each weight on the tensor-core path for the (bucketed) row count,
    one group size, and one K split (``cuda_mma.fusable``: then each product equals its own
    :func:`linear`'s bit for bit). Answered once per shape, dtype, weights' signatures and the
    config's kernel-path settings (the row count is bucketed where ``pad_rows``)."""
    if row_tile():
        return False
    key = (
        config.pad_rows,
        config.mma_rows,
        config.dequant_min_rows,
        x.shape,
        x.dtype,
        *(w.signature for w in ws),
    )
    ok = _FUSABLE.get(key)
    if ok is None:
        ok = _FUSABLE[key] = _fusable_shapes(x, ws, config)
    return ok


_FUSABLE: dict[tuple, bool] = {}
""":func:`_fusable`'s answers, keyed by everything they depend on (so never stale)."""


def _fusable_shapes(x: mx.array, ws: list[QuantLinear], config: RuntimeConfig) -> bool:
    if len({w.group_size for w in ws}) != 1:
        return False
    k = x.shape[-1] if x.ndim else 0
    rows = x.size // k if k else 0
    padded = bucket_rows(rows) if config.pad_rows and rows else rows
    if not rows or any(kernel_path(padded, w, x.dtype, config) != "mma" for w in ws):
        return False
    return cuda_mma.fusable([w.parts for w in ws], k, padded)


def fused_qkv(
    x: mx.array,
    ws: list[QuantLinear],
    config: RuntimeConfig,
    shapes: list[tuple[int, ...]] | None = None,
    rope: cuda_mma.Rope | None = None,
) -> list[mx.array] | None:
    """Q, K and V of ``x`` ``[..., in]`` by their three weights in one tensor-core call
    (``executor.cuda_mma.matmul3``), each ``[..., n_i]`` (or ``shapes``, the same elements
    viewed so) and equal to its :func:`linear` bit for bit; None where that call does not apply
    (see ``_fusable``): project each through :func:`linear` then. With ``rope``, Q and K come
    RoPE'd as ``mx.fast.rope`` would rotate those products (``cuda_mma.Rope``). On MLX's CUDA
    backend each call costs the host several us beside its work, and a block of a few dozen rows
    made seven projection calls (docs/kernels.md#the-tensor-core-4-bit-matmul)."""
    if not _fusable(x, ws, config):
        return None
    signature = (ws[0].signature, ws[1].signature, ws[2].signature)
    parts = [w.parts for w in ws]
    return cuda_mma.matmul3(x, parts, ws[0].group_size, shapes, signature, rope)


def fused_swiglu(
    x: mx.array, gate: QuantLinear, up: QuantLinear, config: RuntimeConfig
) -> mx.array | None:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``x`` ``[..., in]`` in one tensor-core call
    (``executor.cuda_mma.swiglu``), ``[..., ffn]``; None where it does not apply (see
    ``_fusable``; gate and up of one shape). Its rounding differs from the unfused form's
    (each product rounded, then SiLU, then their product) but not with the weights' tier: every
    tier's weights take it for the same row counts."""
    if gate.shape != up.shape or not _fusable(x, [gate, up], config):
        return None
    signature = (gate.signature, up.signature)
    return cuda_mma.swiglu(x, gate.parts, up.parts, gate.group_size, signature)


def linear(x: mx.array, w: QuantLinear | mx.array, config: RuntimeConfig) -> mx.array:
    """``x @ w.T``: ``x`` ``[..., in]`` times ``w`` ``[out, in]`` gives ``[..., out]``.

    Quantized weights go through the kernel path :func:`kernel_path` picks for the row count:
    ``mx.quantized_matmul(..., transpose=True)`` (no dequantized copy); Strata's tensor-core
    kernel for the row counts of ``config.mma_rows`` on MLX's CUDA backend; or, for at least
    ``config.dequant_min_rows`` rows, a dequantized copy made for this call and a dense matmul. The
    result dtype is MLX's promotion of ``x`` and the weight's
    (scales') dtype: float32 activations give float32.

    With a row tile T (:func:`set_row_tile`, this thread): ``x`` is flattened to ``[R, in]``, R
    padded with zero rows to a multiple of T, each T-row tile computed by its own call (the
    kernel path chosen for T rows), and the padding dropped; R == T is one call. Every weight
    product of the models goes through here under a row tile, attention and FFN projections,
    routers, experts (each expert's rows are tiled like any other rows) and the output head, so
    tiling covers them all; there is no fused gather path (``mx.gather_qmm``) that would escape
    it, and the fused products (:func:`fused_qkv`, :func:`fused_swiglu`) decline while a tile is
    set. Without a
    tile, where ``config.pad_rows`` (MLX's CUDA backend) R is padded to ``bucket_rows(R)`` and
    computed in one call.

    Raises:
        ValueError: ``x.shape[-1]`` differs from the weight's in_features.
    """
    tile = row_tile()
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    if not rows:
        return _linear(x, w, config)
    if not tile:
        pad = bucket_rows(rows) - rows if config.pad_rows else 0
        if not pad:
            return _linear(x, w, config)
        tile = rows + pad  # one call of the bucket's rows
    flat = x.reshape(rows, x.shape[-1])
    pad = -rows % tile
    if pad:
        flat = mx.concatenate([flat, mx.zeros((pad, flat.shape[1]), dtype=flat.dtype)])
    parts = [_linear(flat[i : i + tile], w, config) for i in range(0, rows + pad, tile)]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def linear_add(
    x: mx.array, w: QuantLinear | mx.array, residual: mx.array, config: RuntimeConfig
) -> mx.array:
    """``residual + linear(x, w)``, bit for bit and in the same shape, with the sum in the
    product's own kernel call where the tensor-core path takes ``x``'s rows as they are (no row
    tile, a bucket's rows, ``residual`` of ``x``'s dtype and of the broadcast's shape): a block's
    output projection added to the residual stream ``[1, R, d]``, one operation of the graph
    fewer.

    Returns:
        the broadcast of ``residual`` and the product ``[..., out]``.

    Raises:
        ValueError: as :func:`linear`, or shapes ``+`` cannot broadcast.
    """
    if isinstance(w, QuantLinear) and not row_tile() and x.ndim and residual.dtype == x.dtype:
        n, cols = w.shape
        rows = x.size // cols if x.shape[-1] == cols else 0
        if (
            rows
            and (not config.pad_rows or bucket_rows(rows) == rows)
            and residual.ndim >= x.ndim
            and _unbatched(residual.shape) == _unbatched((*x.shape[:-1], n))
            and kernel_path(rows, w, x.dtype, config) == "mma"
        ):
            return cuda_mma.matmul(x, *w.parts, w.group_size, residual, w.signature)
    return residual + linear(x, w, config)


def _unbatched(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` without its leading 1s: two shapes equal so broadcast to the longer one."""
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


def _linear(x: mx.array, w: QuantLinear | mx.array, config: RuntimeConfig) -> mx.array:
    """:func:`linear` as one call, whatever the row count."""
    if isinstance(w, QuantLinear):
        cols = w.shape[1]
        if x.shape[-1] != cols:
            raise ValueError(
                f"linear: input has {x.shape[-1]} features, weight {w.shape} expects {cols}"
            )
        return quantized_product(x, w, kernel_path(x.size // cols, w, x.dtype, config))
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features, weight {tuple(w.shape)} is not [out, in]"
        )
    return x @ w.T


KERNEL_PATHS = ("quantized", "mma", "dense")
"""Kernel paths of a quantized projection (:func:`quantized_product`)."""


def kernel_path(rows: int, w: QuantLinear, dtype: mx.Dtype, config: RuntimeConfig) -> str:
    """The kernel path ``config`` takes for a product of ``rows`` rows of ``dtype`` by ``w``:
    ``dense`` from ``config.dequant_min_rows`` (the plan's ``dequant_matmul_min_rows``); ``mma``
    (Strata's own kernels: one row by ``executor.cuda_qmv``'s matvec, 4 or 8 bits; more by the
    tensor-core kernel, 4 bits) for ``config.mma_rows`` (the plan's ``mma_matmul_min_rows`` to
    ``mma_matmul_max_rows``) where :func:`executor.cuda_mma.supported` (16-bit activations and
    scales of that dtype, MLX's CUDA backend); else ``quantized``."""
    mma_rows, dense_from = config.mma_rows, config.dequant_min_rows
    key = (rows, w.shape, w.bits, w.group_size, w.scales_dtype, dtype, mma_rows, dense_from)
    path = _PATHS.get(key)
    if path is None:
        path = _PATHS[key] = _kernel_path(rows, w, dtype, mma_rows, dense_from)
    return path


_PATHS: dict[tuple, str] = {}
""":func:`kernel_path`'s answers by (rows, weight shape, bits, group size, scales' and
activations' dtypes, the config's row ranges): asked by every product of a pass."""


def _kernel_path(
    rows: int, w: QuantLinear, dtype: mx.Dtype, mma_rows: tuple[int, int], dense_from: int
) -> str:
    if dense_from and rows >= dense_from:
        return "dense"
    if (
        w.biases is not None  # Strata's tensor-core kernel is affine only
        and mma_rows[0]
        and mma_rows[0] <= rows <= mma_rows[1]
        and w.scales_dtype == dtype
        and cuda_mma.supported(rows, w.shape[0], w.shape[1], w.bits, w.group_size, dtype)
    ):
        return "mma"
    return "quantized"


def quantized_product(x: mx.array, w: QuantLinear, path: str) -> mx.array:
    """``x @ w.T`` for a quantized ``w`` by one of the kernel paths (:func:`kernel_path` picks
    one per call; ``executor.profile`` times exactly this function):

    - ``quantized``: ``mx.quantized_matmul``;
    - ``mma``: Strata's own kernels (``executor.cuda_mma``: the tensor-core kernel, or for one
      row ``executor.cuda_qmv``'s matvec), MLX's CUDA backend;
    - ``dense``: dequantize the whole weight for this call (``executor.cuda_dequant`` on MLX's
      CUDA backend, else ``mx.dequantize``) and multiply densely.

    Args:
        x: ``[..., in]`` activations of the compute dtype.
        w: the quantized ``[out, in]`` weight.
        path: one of ``KERNEL_PATHS``.

    Returns:
        ``[..., out]``, MLX's promotion of ``x``'s and the scales' dtypes.

    Raises:
        ValueError: an unknown path, or ``mma`` where ``executor.cuda_mma`` does not apply.
    """
    if path == "dense":
        if w.biases is None:  # mxfp4: MLX's own dequantization
            full = mx.dequantize(
                w.weight, w.scales, None, w.group_size, w.bits, mode=w.mode, dtype=x.dtype
            )
        elif cuda_dequant.supported(w.bits, w.group_size, x.dtype):
            full = cuda_dequant.dequantize(
                w.weight, w.scales, w.biases, w.group_size, w.bits, x.dtype
            )
        else:
            full = mx.dequantize(
                w.weight, w.scales, w.biases, group_size=w.group_size, bits=w.bits, dtype=x.dtype
            )
        return x @ full.T
    if path == "mma":  # any rank: the kernel writes [..., out] itself
        return cuda_mma.matmul(x, *w.parts, w.group_size, signature=w.signature)
    if path != "quantized":
        raise ValueError(f"quantized_product: unknown kernel path {path!r}; use {KERNEL_PATHS}")
    return mx.quantized_matmul(
        x,
        w.weight,
        w.scales,
        w.biases,
        transpose=True,
        group_size=w.group_size,
        bits=w.bits,
        mode=w.mode,
    )


def embedding(
    ids: mx.array, table: QuantLinear | mx.array, dtype: mx.Dtype = mx.float32
) -> mx.array:
    """Look up rows ``ids`` of ``table`` ``[vocab, d]``, giving ``[*ids.shape, d]`` in ``dtype``.

    Only the requested rows are gathered, and only they are dequantized, so a lookup never
    dequantizes the whole table. For a quantized table the gathered scales/biases are
    widened to ``dtype`` first (MLX dequantizes in the scales' dtype), which for float32
    reproduces ``gguf.quants.dequantize`` of those rows bit for bit.

    Args:
        ids: integer token ids of any shape, each in ``[0, vocab)``; not range-checked
            (that would force a device sync), out-of-range ids give undefined rows.
        table: the embedding matrix, quantized or plain.
        dtype: result dtype (float32 on CPU).

    Raises:
        TypeError: ``ids`` is not an integer array.
    """
    if not mx.issubdtype(ids.dtype, mx.integer):
        raise TypeError(f"embedding: ids must be integers, got {ids.dtype}")
    if not isinstance(table, QuantLinear):
        return mx.take(table, ids, axis=0).astype(dtype)
    flat = ids.reshape(-1)  # mx.dequantize wants a 2-D [n, words] input
    rows = mx.take(table.weight, flat, axis=0)
    if table.biases is None:  # mxfp4: uint8 E8M0 scales, dequantized exactly in any dtype
        scales = mx.take(table.scales, flat, axis=0)
        out = mx.dequantize(
            rows, scales, None, table.group_size, table.bits, mode=table.mode, dtype=dtype
        )
        return out.reshape(*ids.shape, table.shape[1])
    scales = mx.take(table.scales, flat, axis=0).astype(dtype)
    biases = mx.take(table.biases, flat, axis=0).astype(dtype)
    out = mx.dequantize(
        rows, scales, biases, group_size=table.group_size, bits=table.bits, dtype=dtype
    )
    return out.reshape(*ids.shape, table.shape[1])
