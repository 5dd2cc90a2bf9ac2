#!/usr/bin/env python3
"""Strata's CUDA dequantize kernel (``executor.cuda_dequant``) against ``mx.dequantize``, and
the three kernel paths of a quantized projection (``executor.ops.quantized_product``) by rows.

For each weight shape (a Llama-3-8B block's FFN and attention projections, SmolLM2's FFN), 4-bit
in groups of 32, float16: the dequantizing pass of each kernel, then for 1 to 512 rows the
quantized matmul, the dense path (our dequantize + matmul), the matmul alone and, up to 64 rows,
the tensor-core path (``executor.cuda_mma``), each the best of 7 calls timed one at a time
(evaluated and synchronized), as ``strata.executor.profile``'s kernel-path tests time them. First it
checks that the dequantize kernel is exact for 4 and 8 bits, groups of 32 to 128, float16 and
bfloat16, and that the tensor-core kernel is within 1e-3 (float16) of the float32 product, each row
equal alone. Output: JSON ``{"NxK": {"dequant_mlx_us", "dequant_ours_us", "ours_GBps", "rows":
{rows: [quantized us, dense us, matmul-only us, tensor-core us or null]}}}``.

Figures and their result file: ``docs/kernels.md`` (The dequantization kernel).

usage: python benchmarks/kernels/dequant_kernel.py OUT.json   (needs MLX's CUDA backend)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from strata.executor import cuda_dequant, cuda_mma
from strata.executor.ops import QuantLinear, quantized_product
from strata.executor.profile import _best_seconds

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SHAPES = ((14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096), (1536, 576), (576, 1536))


def best(fn, repeats: int = 7) -> float:
    """Best seconds of ``fn`` (which evaluates, so each call waits for the GPU) over ``repeats``
    calls after one untimed call: the profile's timing (``strata.executor.profile``)."""
    return _best_seconds(fn, repeats)


def check_exact() -> bool:
    """The kernel against the float32 dequantization rounded once, for each supported case."""
    ok = True
    for bits, group, dtype in ((4, 32, mx.float16), (8, 32, mx.float16), (4, 64, mx.bfloat16)):
        w = mx.random.normal((512, 1024)).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
        f32 = mx.float32
        ref = mx.dequantize(wq, s.astype(f32), b.astype(f32), group_size=group, bits=bits)
        got = cuda_dequant.dequantize(wq, s, b, group, bits, dtype)
        exact = mx.array_equal(ref.astype(dtype), got).item()
        print(f"{bits}-bit, groups of {group}, {dtype}: exact {exact}", flush=True)
        ok &= exact
    for rows in (1, 5, 16, 33, 64):
        x = mx.random.normal((rows, 4096)).astype(mx.float16)
        wq, s, b = mx.quantize(mx.random.normal((1024, 4096)).astype(mx.float16), 32, 4)
        got = cuda_mma.matmul(x, wq, s, b, 32)
        ref = x.astype(mx.float32) @ mx.dequantize(wq, s, b, 32, 4).astype(mx.float32).T
        err = (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
        alone = mx.array_equal(cuda_mma.matmul(x[:1], wq, s, b, 32)[0], got[0]).item()
        print(f"tensor-core kernel, {rows} rows: error {err:.1e}, row alone equal {alone}")
        ok &= err < 1e-3 and alone
    return ok


def _time_shape(w: QuantLinear) -> tuple[float, float, mx.array, dict[int, list[int]]]:
    """Seconds of MLX's and our dequantize of ``w``, the dense weight, and per row count the
    quantized, dense and matmul-only times (us)."""
    f16 = mx.float16
    theirs = best(
        lambda: mx.eval(mx.dequantize(w.weight, w.scales, w.biases, group_size=32, bits=4))
    )
    ours = best(lambda: mx.eval(cuda_dequant.dequantize(w.weight, w.scales, w.biases, 32, 4, f16)))
    full = cuda_dequant.dequantize(w.weight, w.scales, w.biases, 32, 4, f16)
    mx.eval(full)
    rows = {}
    for r in ROWS:
        x = mx.random.normal((r, w.shape[1])).astype(f16)
        mx.eval(x)
        rows[r] = [
            round(best(lambda x=x: mx.eval(quantized_product(x, w, "quantized"))) * 1e6),
            round(best(lambda x=x: mx.eval(quantized_product(x, w, "dense"))) * 1e6),
            round(best(lambda x=x: mx.eval(x @ full.T)) * 1e6),
            round(best(lambda x=x: mx.eval(quantized_product(x, w, "mma"))) * 1e6)
            if r <= cuda_mma.MAX_ROWS
            else None,
        ]
    return theirs, ours, full, rows


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    if not mx.cuda.is_available():
        print("error: this bench needs MLX's CUDA backend", file=sys.stderr)
        return 2
    ok = check_exact()
    out = {}
    f16 = mx.float16
    for n, k in SHAPES:
        wq, s, b = mx.quantize(mx.random.normal((n, k)).astype(f16), group_size=32, bits=4)
        mx.eval(wq, s, b)
        theirs, ours, full, rows = _time_shape(QuantLinear(wq, s, b, 4, 32))
        moved = wq.nbytes + s.nbytes + b.nbytes + full.nbytes  # read packed, write float16
        out[f"{n}x{k}"] = {
            "dequant_mlx_us": theirs * 1e6,
            "dequant_ours_us": ours * 1e6,
            "ours_GBps": moved / ours / 1e9,
            "rows": rows,
        }
        table = " ".join(f"{r}:{q}/{d}/{m}/{t}" for r, (q, d, m, t) in rows.items())
        print(
            f"[{n}, {k}] dequantize: MLX {theirs * 1e6:.0f} us, ours {ours * 1e6:.0f} us; "
            f"rows quantized/dense/matmul-only/tensor-core us: {table}",
            flush=True,
        )
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
