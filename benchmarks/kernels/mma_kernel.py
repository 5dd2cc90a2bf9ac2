#!/usr/bin/env python3
"""Strata's tensor-core 4-bit matmul (``executor.cuda_mma``) against MLX's quantized matmul, and
its fused forms against the unfused calls, on Llama-3-8B shapes (needs MLX's CUDA backend).

Each figure is the time per call in a chain of calls over distinct weights (1.2 GB of them, so
no call finds its weight in the L2 cache), one evaluation per chain, the median of 7 chains
after 2 unmeasured ones: how the model's forward pass calls them. Before timing, every product
is checked against the float32 product of the dequantized weights (relative error below 1e-3 of
the largest element, 2e-3 for SwiGLU's product of two) and, for ``matmul``, a row's result alone
against the same row in the batch.

- ``matmul``: ``cuda_mma.matmul`` and ``mx.quantized_matmul`` on the [n, k] weights of a block
  (gate/up [14336, 4096], down [4096, 14336], q/o [4096, 4096], k/v [1024, 4096]);
- ``qkv``: one ``cuda_mma.matmul3`` by Q/K/V weights [4096|1024|1024, 4096] against three
  ``cuda_mma.matmul`` calls (the results checked equal bit for bit);
- ``swiglu``: one ``cuda_mma.swiglu`` by gate/up weights [14336, 4096] against two
  ``cuda_mma.matmul`` calls, SiLU and the product.

usage: python benchmarks/kernels/mma_kernel.py [--rows 8,16,24,32,64] [-o FILE.json]
       python benchmarks/kernels/mma_kernel.py --sweep 2048:32,4096:32,2048:64 [--rows 16,24,32]

``--sweep TARGET_WARPS:LOAD_WORDS,...`` instead times a block's four calls (``swiglu`` by
gate/up, ``matmul`` by down with the residual-free form, ``matmul3`` by Q/K/V, ``matmul`` by O)
under each pair of the module's launch constants (each checked against the float32 product by
the down weight first), and their sum per block. These times are wall clock per call in a
chain, MLX's host cost of each call included.

Figures (the launch constants' sweep, the first version's ``matmul`` part against the WMMA
kernel and MLX's) and their result file: ``docs/kernels.md`` (The tensor-core 4-bit matmul).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from strata.executor import cuda_mma

SHAPES = ((14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096))
"""[n, k] weights of a Llama-3-8B block."""

CHAIN_BYTES = 1.2e9
"""Packed weight bytes per chain: many times the H200's 50 MB L2."""

GROUP = 32
DTYPE = mx.float16


def weights(n: int, k: int, count: int) -> list[tuple[mx.array, mx.array, mx.array]]:
    out = [
        mx.quantize(mx.random.normal((n, k), dtype=DTYPE) * 0.05, GROUP, 4) for _ in range(count)
    ]
    mx.eval(out)
    return out


def per_call(fn, ws, reps: int = 7) -> float:
    """Seconds per call of ``fn(w)`` over ``ws``, one evaluation per chain."""
    times = []
    for _ in range(reps + 2):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn(w) for w in ws])
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / len(ws)


def device_per_call(fn, ws, reps: int = 3) -> float | None:
    """Seconds of GPU kernel time per call of ``fn(w)`` over ``ws`` (every kernel a call
    launches, summed; the host's time per call left out), from CUPTI through PyTorch's profiler;
    None where PyTorch is not installed. Chains whose kernels are short against MLX's host time
    per call measure the host in :func:`per_call`; this measures the device alone."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    mx.eval([fn(w) for w in ws])  # built and warm before the record
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            mx.eval([fn(w) for w in ws])
            mx.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    busy = sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")
    return busy / 1e6 / (reps * len(ws))


def check(got: mx.array, ref: mx.array, what: str, tol: float = 1e-3) -> float:
    """The relative error of ``got`` against ``ref`` (largest element); exit past ``tol``."""
    err = (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
    if not err < tol:
        raise SystemExit(f"{what}: relative error {err:.2e} (below {tol:.0e} expected)")
    return err


def dense(w) -> mx.array:
    return mx.dequantize(*w, group_size=GROUP, bits=4).astype(mx.float32)


def fused_part(name: str, widths: tuple[int, ...], rows_list: list[int]) -> dict:
    """The ``qkv`` or ``swiglu`` part: the fused call by weights of rows ``widths`` (by 4096)
    against the unfused calls, checked, then timed."""
    k = 4096
    count = max(8, int(CHAIN_BYTES // (sum(widths) * k // 2)))
    sets = [[weights(n, k, 1)[0] for n in widths] for _ in range(count)]
    out = {}
    for rows in rows_list:
        x = mx.random.normal((rows, k)).astype(DTYPE)
        if name == "qkv":
            for i, (o, w) in enumerate(
                zip(cuda_mma.matmul3(x, sets[0], GROUP), sets[0], strict=True)
            ):
                if not mx.array_equal(o, cuda_mma.matmul(x, *w, GROUP)).item():
                    raise SystemExit(f"qkv part {i}, {rows} rows: differs from matmul")

            def fused(ws, x=x):
                return cuda_mma.matmul3(x, ws, GROUP)

            def unfused(ws, x=x):
                return [cuda_mma.matmul(x, *w, GROUP) for w in ws]
        else:
            g, u = (x.astype(mx.float32) @ dense(w).T for w in sets[0])
            ref = g * mx.sigmoid(g) * u
            check(cuda_mma.swiglu(x, *sets[0], GROUP), ref, f"swiglu {rows}", 2e-3)

            def fused(ws, x=x):
                return cuda_mma.swiglu(x, *ws, GROUP)

            def unfused(ws, x=x):
                g, u = (cuda_mma.matmul(x, *w, GROUP) for w in ws)
                return g * mx.sigmoid(g) * u

        t_fused, t_unfused = per_call(fused, sets), per_call(unfused, sets)
        out[str(rows)] = {"fused_s": t_fused, "unfused_s": t_unfused}
        print(
            f"{name} {rows:2d} rows: fused {t_fused * 1e6:6.1f} us, "
            f"unfused {t_unfused * 1e6:6.1f} us"
        )
    return out


def sweep(settings: list[tuple[int, int]], rows_list: list[int]) -> dict:
    """The ``--sweep`` part: per ``(TARGET_WARPS, LOAD_WORDS)`` and row count, the seconds per
    call of a block's four calls and their sum (``"error"`` where a setting is refused or its
    product is wrong; the sweep goes on with the next)."""
    k, saved = 4096, (cuda_mma.TARGET_WARPS, cuda_mma.LOAD_WORDS)
    gate_up = [[weights(14336, k, 1)[0] for _ in range(2)] for _ in range(20)]
    down, o = weights(4096, 14336, 40), weights(4096, 4096, 80)
    qkv = [[weights(n, k, 1)[0] for n in (4096, 1024, 1024)] for _ in range(60)]
    out: dict[str, dict] = {}
    try:
        for tw, lw in settings:
            cuda_mma.TARGET_WARPS, cuda_mma.LOAD_WORDS = tw, lw
            cuda_mma.warps_per_block.cache_clear()
            cuda_mma._LAUNCHES.clear()
            for rows in rows_list:
                x = mx.random.normal((rows, k)).astype(DTYPE)
                xd = mx.random.normal((rows, 14336)).astype(DTYPE)
                key = f"{tw}:{lw}/{rows}"
                try:
                    got = cuda_mma.matmul(xd, *down[0], GROUP)
                    check(got, xd.astype(mx.float32) @ dense(down[0]).T, f"{key} down")
                    t = {
                        "swiglu_s": per_call(lambda w, x=x: cuda_mma.swiglu(x, *w, GROUP), gate_up),
                        "down_s": per_call(lambda w, x=xd: cuda_mma.matmul(x, *w, GROUP), down),
                        "qkv_s": per_call(lambda w, x=x: cuda_mma.matmul3(x, w, GROUP), qkv),
                        "o_s": per_call(lambda w, x=x: cuda_mma.matmul(x, *w, GROUP), o),
                    }
                except (Exception, SystemExit) as e:  # a refused or wrong setting: the next one
                    out[key] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"{key}: {type(e).__name__}: {e}")
                    continue
                t["block_s"] = sum(t.values())
                out[key] = t
                print(f"{key}: " + ", ".join(f"{n[:-2]} {v * 1e6:6.1f} us" for n, v in t.items()))
    finally:
        cuda_mma.TARGET_WARPS, cuda_mma.LOAD_WORDS = saved
        cuda_mma.warps_per_block.cache_clear()
        cuda_mma._LAUNCHES.clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,16,24,32,64")
    ap.add_argument("--sweep", help="TARGET_WARPS:LOAD_WORDS pairs, comma-separated")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("benchmarks/kernels/mma_kernel.py needs MLX's CUDA backend (mlx[cuda13])")
    rows_list = [int(r) for r in args.rows.split(",")]
    if any(not 1 <= r <= cuda_mma.MAX_ROWS for r in rows_list):
        ap.error(f"--rows: each in 1..{cuda_mma.MAX_ROWS}")
    if args.sweep:
        try:
            settings = [tuple(int(v) for v in p.split(":")) for p in args.sweep.split(",")]
        except ValueError:
            settings = []
        # LOAD_WORDS: a multiple of 16, so that every call issues whole chunks' loads (U >= 1).
        if not settings or any(len(p) != 2 or p[0] < 1 or p[1] % 16 or p[1] < 16 for p in settings):
            ap.error(
                "--sweep: pairs TARGET_WARPS:LOAD_WORDS, TARGET_WARPS >= 1 and LOAD_WORDS a "
                "multiple of 16, e.g. 2048:32"
            )
        res = sweep(settings, rows_list)
        if args.output:
            Path(args.output).write_text(json.dumps(res, indent=1))
        return
    res: dict[str, dict] = {"matmul": {}, "qkv": {}, "swiglu": {}}

    def qmm(x, w):
        return mx.quantized_matmul(x, *w, transpose=True, group_size=GROUP, bits=4)

    for n, k in SHAPES:
        ws = weights(n, k, max(8, int(CHAIN_BYTES // (n * k // 2))))
        for rows in rows_list:
            x = mx.random.normal((rows, k)).astype(DTYPE)
            got = cuda_mma.matmul(x, *ws[0], GROUP)
            check(got, x.astype(mx.float32) @ dense(ws[0]).T, f"[{n}, {k}] {rows} rows")
            if not mx.array_equal(cuda_mma.matmul(x[:1], *ws[0], GROUP)[0], got[0]).item():
                raise SystemExit(f"[{n}, {k}]: a row alone differs from the same row in the batch")
            ours = per_call(lambda w, x=x: cuda_mma.matmul(x, *w, GROUP), ws)
            mlx = per_call(lambda w, x=x: qmm(x, w), ws)
            res["matmul"][f"{n}x{k}/{rows}"] = {"strata_s": ours, "mlx_s": mlx}
            print(
                f"[{n}, {k}] {rows:2d} rows: Strata {ours * 1e6:6.1f} us, MLX {mlx * 1e6:6.1f} us"
            )
        del ws
    for name, widths in (("qkv", (4096, 1024, 1024)), ("swiglu", (14336, 14336))):
        res[name] = fused_part(name, widths, [r for r in rows_list if r <= 32])
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
