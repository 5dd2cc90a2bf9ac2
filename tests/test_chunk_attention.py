"""Chunk attention's two paths: MLX's fused SDPA, and the plain-operations path that short
multi-query chunks (speculative verification, a prompt's suffix after a prefix hit) take on
MLX's CUDA backend (``executor.models.llama.EXPLICIT_ATTENTION_MAX_QUERIES``). Both must give
the same numbers for the masks ``_attention_span`` makes: causal, sliding window, grouped-query
heads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import executor.models.llama as llama


@pytest.mark.parametrize(
    ("heads", "kv_heads", "t", "start", "window"),
    [(9, 3, 5, 40, 0), (4, 1, 7, 20, 0), (4, 2, 3, 30, 8), (8, 8, 2, 0, 0), (4, 2, 32, 16, 0)],
)
def test_explicit_path_equals_sdpa(monkeypatch, heads, kv_heads, t, start, window) -> None:
    rng = np.random.default_rng(heads * 100 + t)
    d, length = 64, start + t
    q = mx.array(rng.standard_normal((1, heads, t, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, kv_heads, length, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, kv_heads, length, d)).astype(np.float32))
    keys, values, mask = llama._attention_span(k, v, start, t, window)
    monkeypatch.setattr(llama, "EXPLICIT_ATTENTION_MAX_QUERIES", 0)
    fused = llama._chunk_attention(q, keys, values, 0.125, mask)
    monkeypatch.setattr(llama, "EXPLICIT_ATTENTION_MAX_QUERIES", 32)
    explicit = llama._chunk_attention(q, keys, values, 0.125, mask)
    assert explicit.shape == fused.shape == (1, heads, t, d)
    np.testing.assert_allclose(np.array(explicit), np.array(fused), rtol=1e-5, atol=1e-5)


def test_one_query_and_long_chunks_keep_the_fused_kernel(monkeypatch) -> None:
    """The explicit path is only for 2..max queries: a decode-like chunk and a prefill chunk
    longer than the bound call SDPA."""
    calls = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(
        mx.fast, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    monkeypatch.setattr(llama, "EXPLICIT_ATTENTION_MAX_QUERIES", 4)
    for t in (1, 2, 4, 5):
        q = mx.zeros((1, 2, t, 16))
        k = mx.zeros((1, 2, 10 + t, 16))
        keys, values, mask = llama._attention_span(k, k, 10, t, 0)
        llama._chunk_attention(q, keys, values, 1.0, mask)
    assert len(calls) == 2  # t = 1 and t = 5
