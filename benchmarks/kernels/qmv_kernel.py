#!/usr/bin/env python3
"""Strata's one-row kernel (``executor.cuda_qmv``, reached through ``executor.cuda_mma`` for a
single row) against MLX's quantized matvec, on the weights of a Llama-3-8B decode step (needs
MLX's CUDA backend).

Each figure is the time per call over distinct weights (at least 1.2 GB of them, so no call finds
its weight in the L2 cache), all of a chain evaluated at once, the median of 7 chains after 2
unmeasured ones: how a forward pass calls them. Before timing, every product is checked against
the float32 product of the dequantized weight (relative error below 1e-3 of the largest
element; SwiGLU 2e-3), and the fused forms against the plain one (Q/K/V bit for bit, the
residual's sum bit for bit).

- ``matmul``: one row by gate/up [14336, 4096], down [4096, 14336], Q/O [4096, 4096], K/V
  [1024, 4096] (4-bit) and the output head [128256, 4096] (8-bit, as the synthetic 8B model's
  Q8_0 head is repacked), ours and ``mx.quantized_matmul``; GB/s of packed weights, scales and
  biases read;
- ``qkv``: one ``matmul3`` by Q/K/V against MLX's three products; ``swiglu``: one call against
  MLX's two products, SiLU and the product; ``down+residual``: ``matmul(..., residual=r)``
  against MLX's product and add.

``--sweep U:WPB:KS,...`` times the block's calls (SwiGLU, down + residual, Q/K/V, O + residual)
and the head on the GPU's clock (CUPTI through PyTorch: kernel time alone) under each triple of
the module's slabs in flight (``MAX_SLABS_IN_FLIGHT``), warps per block (``WARPS_PER_BLOCK``) and
most warps splitting K (``MAX_K_SPLIT``).

usage: python benchmarks/kernels/qmv_kernel.py [-o FILE.json] [--sweep 4:4:1,2:4:2,1:4:4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from strata.benchmarks.kernels.mma_kernel import check, device_per_call, per_call
from strata.executor import cuda_mma, cuda_qmv

GROUP = 32
DTYPE = mx.float16
CHAIN_BYTES = 1.2e9
"""Packed weight bytes per chain: many times the GPU's 50 MB L2."""

SHAPES = ((14336, 4096, 4), (4096, 14336, 4), (4096, 4096, 4), (1024, 4096, 4), (128256, 4096, 8))
"""[n, k, bits] of the weights of a Llama-3-8B decode step."""


def weights(n: int, k: int, bits: int, count: int) -> list[tuple[mx.array, mx.array, mx.array]]:
    out = [
        mx.quantize(mx.random.normal((n, k), dtype=DTYPE) * 0.05, GROUP, bits) for _ in range(count)
    ]
    mx.eval(out)
    return out


def count_for(n: int, k: int, bits: int) -> int:
    return max(8, int(CHAIN_BYTES // (n * k * bits // 8)))


def nbytes(w) -> int:
    return sum(a.nbytes for a in w)


def dense(w, bits: int) -> mx.array:
    return mx.dequantize(*w, group_size=GROUP, bits=bits).astype(mx.float32)


def qmm(x, w, bits: int) -> mx.array:
    return mx.quantized_matmul(x, *w, transpose=True, group_size=GROUP, bits=bits)


def plain_part() -> dict:
    out = {}
    for n, k, bits in SHAPES:
        ws = weights(n, k, bits, count_for(n, k, bits))
        x = mx.random.normal((1, k)).astype(DTYPE)
        err = check(cuda_mma.matmul(x, *ws[0], GROUP), x.astype(mx.float32) @ dense(ws[0], bits).T,
                    f"[{n}, {k}] {bits}-bit")  # fmt: skip
        ours = per_call(lambda w, x=x: cuda_mma.matmul(x, *w, GROUP), ws)
        mlx = per_call(lambda w, x=x, b=bits: qmm(x, w, b), ws)
        gb = nbytes(ws[0]) / 1e9
        out[f"{n}x{k}/{bits}bit"] = {
            "strata_us": round(ours * 1e6, 2),
            "mlx_us": round(mlx * 1e6, 2),
            "strata_gb_s": round(gb / ours, 1),
            "mlx_gb_s": round(gb / mlx, 1),
            "rel_error": err,
        }
        print(f"[{n}, {k}] {bits}-bit: Strata {ours * 1e6:7.1f} us ({gb / ours:6.0f} GB/s), "
              f"MLX {mlx * 1e6:7.1f} us ({gb / mlx:6.0f} GB/s)")  # fmt: skip
        del ws
    return out


def fused_part() -> dict:
    out = {}
    k = 4096
    count = count_for(6144, k, 4)
    sets = [
        [weights(n, k, 4, 1)[0] for n in (4096, 1024, 1024)] for _ in range(count)
    ]  # fmt: skip
    x = mx.random.normal((1, k)).astype(DTYPE)
    for got, w in zip(cuda_mma.matmul3(x, sets[0], GROUP), sets[0], strict=True):
        if not mx.array_equal(got, cuda_mma.matmul(x, *w, GROUP)).item():
            raise SystemExit("qkv: matmul3 differs from matmul")
    ours = per_call(lambda ws: cuda_mma.matmul3(x, ws, GROUP), sets)
    mlx = per_call(lambda ws: [qmm(x, w, 4) for w in ws], sets)
    out["qkv"] = {"strata_us": round(ours * 1e6, 2), "mlx_us": round(mlx * 1e6, 2)}
    print(f"qkv: Strata {ours * 1e6:.1f} us, MLX {mlx * 1e6:.1f} us")
    del sets
    pairs = [weights(14336, k, 4, 2) for _ in range(count_for(28672, k, 4))]
    g, u = pairs[0]
    xf = x.astype(mx.float32)
    ref = (xf @ dense(g, 4).T) * mx.sigmoid(xf @ dense(g, 4).T) * (xf @ dense(u, 4).T)
    check(cuda_mma.swiglu(x, g, u, GROUP), ref, "swiglu", 2e-3)
    ours = per_call(lambda p: cuda_mma.swiglu(x, p[0], p[1], GROUP), pairs)

    def mlx_swiglu(p):
        a = qmm(x, p[0], 4)
        return a * mx.sigmoid(a) * qmm(x, p[1], 4)

    mlx = per_call(mlx_swiglu, pairs)
    out["swiglu"] = {"strata_us": round(ours * 1e6, 2), "mlx_us": round(mlx * 1e6, 2)}
    print(f"swiglu: Strata {ours * 1e6:.1f} us, MLX {mlx * 1e6:.1f} us")
    del pairs
    downs = weights(4096, 14336, 4, count_for(4096, 14336, 4))
    xd = mx.random.normal((1, 14336)).astype(DTYPE)
    r = mx.random.normal((1, 1, 4096)).astype(DTYPE)
    fused = cuda_mma.matmul(xd, *downs[0], GROUP, residual=r)
    if not mx.array_equal(fused, r + cuda_mma.matmul(xd, *downs[0], GROUP)).item():
        raise SystemExit("down+residual: the fused sum differs from the separate add")
    ours = per_call(lambda w: cuda_mma.matmul(xd, *w, GROUP, residual=r), downs)
    mlx = per_call(lambda w: r + qmm(xd, w, 4), downs)
    out["down+residual"] = {"strata_us": round(ours * 1e6, 2), "mlx_us": round(mlx * 1e6, 2)}
    print(f"down+residual: Strata {ours * 1e6:.1f} us, MLX {mlx * 1e6:.1f} us")
    return out


def sweep(settings: list[tuple[int, int, int]]) -> dict:
    """The block's calls and the head, each timed on the GPU's clock (CUPTI: a call's kernel
    time alone, where a chain of short calls measures MLX's host time per call), under each
    (slabs in flight, warps per block, most warps splitting K). Each setting is checked first:
    O and down against the float32 product, Q/K/V in one call against three calls, bit for
    bit."""
    k = 4096
    blocks = 8
    gu = [weights(14336, k, 4, 2) for _ in range(blocks)]
    down = weights(4096, 14336, 4, blocks)
    qkv = [[weights(n, k, 4, 1)[0] for n in (4096, 1024, 1024)] for _ in range(blocks)]
    o = weights(4096, k, 4, blocks)
    head = weights(128256, k, 8, 3)
    x = mx.random.normal((1, k)).astype(DTYPE)
    xd = mx.random.normal((1, 14336)).astype(DTYPE)
    r = mx.random.normal((1, 1, 4096)).astype(DTYPE)
    ref_down = xd.astype(mx.float32) @ dense(down[0], 4).T
    ref_o = x.astype(mx.float32) @ dense(o[0], 4).T
    ref_head = x.astype(mx.float32) @ dense(head[0], 8).T
    calls = {
        "swiglu": (lambda i: cuda_mma.swiglu(x, gu[i][0], gu[i][1], GROUP), range(blocks)),
        "down+res": (lambda i: cuda_mma.matmul(xd, *down[i], GROUP, residual=r), range(blocks)),
        "qkv": (lambda i: cuda_mma.matmul3(x, qkv[i], GROUP), range(blocks)),
        "o+res": (lambda i: cuda_mma.matmul(x, *o[i], GROUP, residual=r), range(blocks)),
        "head": (lambda i: cuda_mma.matmul(x, *head[i], GROUP), range(len(head))),
    }
    out = {}
    for u, wpb, ks in settings:
        cuda_qmv.MAX_SLABS_IN_FLIGHT, cuda_qmv.WARPS_PER_BLOCK = u, wpb
        cuda_qmv.MAX_K_SPLIT = ks
        cuda_mma._LAUNCHES.clear()
        name = f"{u}:{wpb}:{ks}"
        check(cuda_mma.matmul(xd, *down[0], GROUP), ref_down, f"{name} down")
        check(cuda_mma.matmul(x, *o[0], GROUP), ref_o, f"{name} O")
        check(cuda_mma.matmul(x, *head[0], GROUP), ref_head, f"{name} head")
        for got, w in zip(cuda_mma.matmul3(x, qkv[0], GROUP), qkv[0], strict=True):
            if not mx.array_equal(got, cuda_mma.matmul(x, *w, GROUP)).item():
                raise SystemExit(f"{name}: matmul3 differs from matmul")
        row = {}
        for what, (fn, idx) in calls.items():
            t = device_per_call(fn, list(idx))
            if t is None:
                raise SystemExit("--sweep times kernels on the GPU's clock: it needs PyTorch")
            row[what] = round(t * 1e6, 2)
        row["block"] = round(sum(v for kk, v in row.items() if kk != "head"), 2)
        out[name] = row
        print(f"U={u} WPB={wpb} KS={ks} (us on the GPU): {row}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", help="U:WPB:KS triples, comma-separated, e.g. 4:4:1,2:4:2")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("benchmarks/kernels/qmv_kernel.py needs MLX's CUDA backend (mlx[cuda13])")
    if args.sweep:
        try:
            settings = [tuple(int(v) for v in p.split(":")) for p in args.sweep.split(",")]
        except ValueError:
            settings = []
        if not settings or any(len(p) != 3 or min(p) < 1 for p in settings):
            ap.error("--sweep: triples U:WPB:KS of positive integers, e.g. 4:4:1,2:4:2")
        res = {"sweep": sweep(settings)}
    else:
        res = {"matmul": plain_part(), **fused_part()}
    res["device"] = str(mx.device_info().get("device_name", mx.default_device()))
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
