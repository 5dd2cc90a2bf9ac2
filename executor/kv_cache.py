"""A contiguous per-sequence KV cache (the paged, block-pool cache of the serving path replaces it).

Keys and values of layer ``l`` are kept as ``[1, n_kv_heads, capacity, head_dim]`` arrays in the
compute dtype, grown in steps of ``step`` tokens (so decode does not reallocate every token) up to
``max_tokens``.
"""

from __future__ import annotations

import mlx.core as mx

from planner.errors import StrataError


class KVCache:
    """Keys and values of one sequence, all layers.

    Args:
        n_layers: blocks of the model.
        n_kv_heads: key/value heads per layer.
        head_dim: dimension of one head.
        max_tokens: most tokens the cache may hold (the plan's context).
        dtype: element dtype (the compute dtype).
        step: growth step in tokens.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: mx.Dtype,
        step: int = 256,
    ):
        self.n_kv_heads, self.head_dim, self.max_tokens = n_kv_heads, head_dim, max_tokens
        self.dtype, self.step = dtype, step
        self.keys: list[mx.array | None] = [None] * n_layers
        self.values: list[mx.array | None] = [None] * n_layers
        self.offset = 0  # tokens already stored (the position of the next token)

    def update(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``k``/``v`` ([1, kv_heads, T, head_dim]) at ``offset`` for ``layer``.

        Returns all keys and values so far, ``[1, kv_heads, offset + T, head_dim]``. The caller
        advances ``offset`` once per forward pass (after the last layer) with ``advance``.

        Raises:
            StrataError: the sequence would exceed ``max_tokens``.
        """
        t = k.shape[2]
        end = self.offset + t
        if end > self.max_tokens:
            raise StrataError(
                f"sequence of {end} tokens exceeds the plan's context of {self.max_tokens}; "
                "re-plan with a larger --context or lower --max-tokens"
            )
        cur = self.keys[layer]
        if cur is None or cur.shape[2] < end:
            cap = min(self.max_tokens, -(-end // self.step) * self.step)
            shape = (1, self.n_kv_heads, cap, self.head_dim)
            nk, nv = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
            if cur is not None:
                nk[:, :, : self.offset] = cur[:, :, : self.offset]
                nv[:, :, : self.offset] = self.values[layer][:, :, : self.offset]
            self.keys[layer], self.values[layer] = nk, nv
        self.keys[layer][:, :, self.offset : end] = k
        self.values[layer][:, :, self.offset : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, t: int) -> None:
        """Mark ``t`` more tokens as stored."""
        self.offset += t
