#!/usr/bin/env python3
"""A batched quantized matmul kernel of Strata's own for MLX's CUDA backend, against MLX's.

Issue 6 asked, where MLX's 4-bit kernels cap batched decode on NVIDIA, for the kernel path to be
chosen per batch size by measurement: dequantize + matmul (``executor.ops``, the plan's
``runtime.dequant_matmul_min_rows``) or a batched quantized kernel of ours through
``mx.fast.cuda_kernel``. This script holds the kernel that was tried and measures it; it is
not in the executor, because it did not pay where the cap is; the tensor-core kernel that
followed it is (``executor.cuda_mma``).

The kernel (:func:`quantized_matmul`): ``x @ dequantize(w).T`` for ``x`` [M, K] (M a power of
two up to ``MAX_ROWS``) and an MLX affine-quantized ``w`` [N, K] of 4 or 8 bits (the layout of
``executor.quant``: element ``j`` of a uint32 word at bits ``bits * j``; ``w = scale * q +
bias`` per group). One warp computes ``R`` output columns for all M rows: its 32 lanes walk the
K dimension one packed word at a time (coalesced weight loads, each weight read once per call),
dequantize the word in registers and multiply it into every row of ``x`` (read through the
cache), accumulating in float32; a butterfly reduction across the warp finishes each sum. A
row's result does not depend on M or the other rows (batch-invariant by construction).

It beat MLX's kernel only at 2-8 rows, and lost at 1 and at 16 and more, where continuous
batching's steps are: float32 products on CUDA cores and per-row reloads of ``x`` bound it. The
figures: ``docs/kernels.md`` (The tensor-core 4-bit matmul).

usage: python benchmarks/kernels/cuda_qmm.py [--rows 1,2,4,8,16] [-o FILE.json]
(needs MLX's CUDA backend)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

MAX_ROWS = 32
"""Most rows (tokens) one call computes: the float32 accumulators live in registers, M x R per
lane."""

SHAPES = ((14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096))
"""[n, k] weights timed: a Llama-3-8B block's FFN gate/up, down, attention q/o and k/v."""

BITS = (4, 8)
"""Bit widths the kernel unpacks (one word holds 8 or 4 whole elements; 3, 5 and 6 bits cross
words and stay on MLX's kernel)."""

_SOURCE = r"""
    constexpr int EPW = 32 / BITS;             // elements per packed word
    constexpr uint32_t QMASK = (1u << BITS) - 1u;
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int KW = K / EPW;                    // words per weight row
    const int G = K / GS;                      // groups per weight row
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const int n0 = warp * R;
    if (n0 >= N) return;
    float acc[M][R];
    #pragma unroll
    for (int m = 0; m < M; ++m)
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
    #pragma unroll 2
    for (int wi = lane; wi < KW; wi += 32) {
        const int g = (wi * EPW) / GS;
        float wf[R][EPW];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const int n = min(n0 + r, N - 1);
            const uint32_t q = w[(size_t)n * KW + wi];
            const float s = static_cast<float>(scales[(size_t)n * G + g]);
            const float b = static_cast<float>(biases[(size_t)n * G + g]);
            #pragma unroll
            for (int j = 0; j < EPW; ++j)
                wf[r][j] = fmaf(s, static_cast<float>((q >> (BITS * j)) & QMASK), b);
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const T* xp = x + (size_t)m * K + (size_t)wi * EPW;
            float xf[EPW];
            #pragma unroll
            for (int j = 0; j < EPW; ++j) xf[j] = static_cast<float>(__ldg(xp + j));
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                float d = acc[m][r];
                #pragma unroll
                for (int j = 0; j < EPW; ++j) d = fmaf(wf[r][j], xf[j], d);
                acc[m][r] = d;
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < M; ++m)
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0 && n0 + r < N) out[(size_t)m * N + n0 + r] = static_cast<T>(v);
        }
"""


@functools.cache
def _get_kernel():
    """The kernel, built on first use (MLX compiles it per template instantiation)."""
    return mx.fast.cuda_kernel(
        name="strata_qmm",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=_SOURCE,
    )


def _cols_per_warp(rows: int) -> int:
    """Output columns per warp: M x R float32 accumulators per lane stay at most 64."""
    return max(1, min(4, 64 // rows))


def supports(bits: int, group_size: int, k: int) -> bool:
    """Whether the kernel computes a ``bits``-bit weight of groups of ``group_size`` and ``k``
    input features (whole words and groups per row)."""
    return bits in BITS and k % group_size == 0 and group_size % (32 // bits) == 0


def quantized_matmul(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
) -> mx.array:
    """``x @ dequantize(weight).T``: x [M, K] (float16/bfloat16/float32, M a power of two up
    to ``MAX_ROWS``), weight uint32 [N, K * bits / 32], scales/biases [N, K / group_size];
    returns [M, N] in x's dtype.

    Raises:
        ValueError: M is not a power of two up to ``MAX_ROWS``, or the weight is not
            :func:`supports`-ed.
    """
    rows, k = x.shape
    if rows < 1 or rows > MAX_ROWS or rows & (rows - 1):
        raise ValueError(f"cuda_qmm: {rows} rows; give a power of two up to {MAX_ROWS}")
    if not supports(bits, group_size, k):
        raise ValueError(f"cuda_qmm: {bits}-bit weights in groups of {group_size} over {k} inputs")
    n = weight.shape[0]
    r = _cols_per_warp(rows)
    warps = -(-n // r)
    (out,) = _get_kernel()(
        inputs=[x, weight, scales, biases],
        # The scales' dtype is in the template too: MLX names (and caches) a compiled kernel by
        # its template arguments, while the signature follows every input's dtype.
        template=[
            ("T", x.dtype),
            ("S", scales.dtype),
            ("M", rows),
            ("R", r),
            ("BITS", bits),
            ("GS", group_size),
        ],
        grid=(warps * 32, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return out


def _best(fn, repeats: int) -> float:
    """Best wall time of ``fn`` (seconds), after one untimed call (kernel builds)."""
    fn()
    mx.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _time_both(x: mx.array, packed: tuple, repeats: int) -> tuple[float, float]:
    """Best seconds of MLX's quantized matmul and of :func:`quantized_matmul` on ``x`` by the
    4-bit, group-32 weight ``packed`` (weight, scales, biases)."""
    wq, scales, biases = packed
    theirs = _best(
        lambda: mx.eval(
            mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=4)
        ),
        repeats,
    )
    ours = _best(lambda: mx.eval(quantized_matmul(x, wq, scales, biases, 32, 4)), repeats)
    return theirs, ours


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--rows", default="1,2,4,8,16", help="row counts (powers of two up to 32)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("-o", "--out", help="write the figures as JSON")
    args = ap.parse_args()
    if not mx.cuda.is_available():
        print("error: this bench needs MLX's CUDA backend", file=sys.stderr)
        return 2
    rows_list = [int(r) for r in args.rows.split(",")]
    mx.random.seed(0)
    result, ok = {"date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device())}, True
    for n, k in SHAPES:
        wq, scales, biases = mx.quantize(
            mx.random.normal((n, k)).astype(mx.float16), group_size=32, bits=4
        )
        for rows in rows_list:
            x = mx.random.normal((rows, k)).astype(mx.float16)
            ref = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=4)
            got = quantized_matmul(x, wq, scales, biases, 32, 4)
            err = float(mx.max(mx.abs(ref.astype(mx.float32) - got.astype(mx.float32))))
            rel = err / float(mx.max(mx.abs(ref.astype(mx.float32))))
            alone = quantized_matmul(x[:1], wq, scales, biases, 32, 4)
            invariant = bool(mx.array_equal(alone[0], got[0]))
            ok &= rel <= 1e-2 and invariant
            theirs, ours = _time_both(x, (wq, scales, biases), args.repeats)
            result[f"[{n}, {k}] M{rows}"] = {
                "mlx_s": theirs,
                "strata_s": ours,
                "max_rel_error": rel,
                "row_invariant": invariant,
            }
            print(
                f"[{n}, {k}] M{rows}: MLX {theirs * 1e6:.0f} us, Strata {ours * 1e6:.0f} us, "
                f"error {rel:.1e}, row-invariant {invariant}",
                flush=True,
            )
    result["check_passed"] = ok
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if not ok:
        print(
            "error: results differ from MLX's by over 1e-2 or depend on the batch", file=sys.stderr
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
