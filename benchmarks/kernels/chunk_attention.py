#!/usr/bin/env python3
"""Strata's paged attention kernel for short chunks (``executor.cuda_attention``) against MLX's
SDPA (cuDNN) over gathered keys, on MLX's CUDA backend.

For the heads of SmolLM2-135M (9 query heads, 3 key/value heads, head size 64) and Llama-3-8B
(32, 8, 128), float16, keys scattered over a 32,768-slot pool: chunks of 24 queries by 1,016 keys
(a prompt's suffix after a prefix-cache hit), 5 by 1,016 (a speculative verification), 64 by
2,000 and 2 by 300. Each is timed as a chain of 100 dependent calls evaluated once (per call:
what a forward pass's chain of blocks pays), after two untimed chains, best of 5; then the first
call at a shape not met before (cuDNN builds its plan there). First it checks the kernel against
the float32 softmax attention of the same inputs (within 1e-2, float16). Output: JSON ``{"heads
case": {"TxL": {"kernel_us", "cudnn_us", "kernel_first_ms", "cudnn_first_ms"}}}``.

Figures and their result file: ``docs/kernels.md`` (Attention).

usage: python benchmarks/kernels/chunk_attention.py OUT.json   (needs MLX's CUDA backend)
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from strata.executor import cuda_attention

HEADS = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
CASES = ((24, 1016), (5, 1016), (64, 2000), (2, 300))
SLOTS, CHAIN, DTYPE = 32768, 100, mx.float16


def inputs(heads: int, kv_heads: int, d: int, t: int, length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    pool_k = (mx.random.normal((SLOTS, kv_heads, d), key=mx.random.key(seed)) * 0.5).astype(DTYPE)
    pool_v = (mx.random.normal((SLOTS, kv_heads, d), key=mx.random.key(seed + 1)) * 0.5).astype(
        DTYPE
    )
    table = mx.array(rng.permutation(SLOTS)[:length].astype(np.int32))
    q = (mx.random.normal((heads, t, d), key=mx.random.key(seed + 2)) * 0.5).astype(DTYPE)
    mx.eval(pool_k, pool_v, table, q)
    return q, pool_k, pool_v, table


def cudnn(q, pool_k, pool_v, table, scale):
    """MLX's SDPA as the model would call it without the kernel: gathered keys, causal."""
    k = pool_k[table[None]].transpose(0, 2, 1, 3)
    v = pool_v[table[None]].transpose(0, 2, 1, 3)
    o = mx.fast.scaled_dot_product_attention(q[None], k, v, scale=scale, mask="causal")
    return o[0].transpose(1, 0, 2)


@functools.cache
def chunk_rows(t: int, length: int) -> mx.array:
    """The kernel's rows for one chunk: query i of T at position L - T + i of table row 0."""
    pos = np.arange(length - t, length, dtype=np.int32)
    return mx.array(np.stack([np.zeros_like(pos), pos], axis=1))


@functools.cache
def chunk_groups(t: int, length: int) -> cuda_attention.QueryGroups:
    """The chunk's query groups, as ``Chunk.kernel_groups`` makes them."""
    pos = np.arange(length - t, length)
    return cuda_attention.query_groups(np.zeros_like(pos), pos)


def kernel(q, pool_k, pool_v, table, scale):
    t, length = q.shape[1], table.shape[0]
    return cuda_attention.attention(
        q.transpose(1, 0, 2),
        pool_k,
        pool_v,
        table[None],
        chunk_rows(t, length),
        scale,
        groups=chunk_groups(t, length),
    )


def chain_us(fn, q, *args) -> float:
    """Per-call microseconds of ``CHAIN`` dependent calls (each call's output is the next
    call's queries)."""

    def run():
        y = q
        for _ in range(CHAIN):
            y = fn(y, *args).transpose(1, 0, 2)
        mx.eval(y)

    run()
    run()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best / CHAIN * 1e6


def first_ms(fn, *args) -> float:
    t0 = time.perf_counter()
    mx.eval(fn(*args))
    return (time.perf_counter() - t0) * 1e3


def check() -> bool:
    ok = True
    for heads, kv_heads, d in HEADS.values():
        q, pk, pv, table = inputs(heads, kv_heads, d, 24, 1016, seed=7)
        got = np.array(kernel(q, pk, pv, table, d**-0.5).astype(mx.float32))
        f32 = [a.astype(mx.float32) for a in (q, pk, pv)]
        want = np.array(
            mx.fast.scaled_dot_product_attention(
                f32[0][None],
                f32[1][table[None]].transpose(0, 2, 1, 3),
                f32[2][table[None]].transpose(0, 2, 1, 3),
                scale=d**-0.5,
                mask="causal",
            )[0].transpose(1, 0, 2)
        )
        err = float(np.abs(got - want).max())
        print(f"heads {heads}/{kv_heads}, head size {d}: max error {err:.2e}", flush=True)
        ok &= err < 1e-2
    return ok


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.rsplit("usage: ", 1)[1].strip(), file=sys.stderr)
        return 2
    if not mx.cuda.is_available():
        print("error: this bench needs MLX's CUDA backend", file=sys.stderr)
        return 2
    if not check():
        print("error: the kernel's output is wrong; no timings", file=sys.stderr)
        return 1
    out = {}
    for name, (heads, kv_heads, d) in HEADS.items():
        rows = out.setdefault(name, {})
        for t, length in CASES:
            q, pk, pv, table = inputs(heads, kv_heads, d, t, length)
            row = {
                "kernel_us": round(chain_us(kernel, q, pk, pv, table, 0.1), 1),
                "cudnn_us": round(chain_us(cudnn, q, pk, pv, table, 0.1), 1),
            }
            # a shape not met before: one query and one key fewer
            args = (q[:, : max(1, t - 1)], pk, pv, table[: length - 1], 0.1)
            row["kernel_first_ms"] = round(first_ms(kernel, *args), 2)
            q2 = q[:, : max(2, t - 1)]
            row["cudnn_first_ms"] = round(first_ms(cudnn, q2, pk, pv, table[: length - 1], 0.1), 2)
            rows[f"{t}x{length}"] = row
            print(f"{name} {t}x{length}: {row}", flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
