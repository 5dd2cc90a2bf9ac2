"""Architecture ``llama`` (Llama 1-3, SmolLM, Mistral-style dense models) as llama.cpp runs it.

Per block: RMSNorm -> grouped-query attention with RoPE -> residual; RMSNorm -> SwiGLU FFN ->
residual. GGUF's llama Q/K weights are permuted by the converter so that RoPE rotates adjacent
pairs (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``), which is MLX's ``traditional=True``.
The forward pass runs unit by unit, asking the weight store for each unit as it is needed, so a
unit on any tier is used the moment it arrives and the numbers never depend on the tier.
"""

from __future__ import annotations

import math

import mlx.core as mx

from executor.kv_cache import KVCache
from executor.ops import linear
from executor.weights import Weight, WeightStore
from planner.schemas import Architecture


class LlamaModel:
    """A llama-architecture model over a weight store.

    Args:
        arch: hyperparameters from the GGUF.
        store: the weights, on the tiers the plan chose.
        dtype: compute dtype of activations and the KV cache.
    """

    rope_traditional = True  # adjacent-pair rotation, see module docstring

    def __init__(self, arch: Architecture, store: WeightStore, dtype: mx.Dtype):
        self.arch, self.store, self.dtype = arch, store, dtype
        self.scale = 1.0 / math.sqrt(arch.head_dim)

    @staticmethod
    def expected_shapes(arch: Architecture) -> dict[str, list[int] | None]:
        """Tensor name -> GGUF shape (ne0 first) this forward pass needs; None = optional."""
        d, hd, v, ff = (
            arch.embedding_length,
            arch.head_dim,
            arch.vocab_size,
            arch.feed_forward_length,
        )
        q, kv = arch.head_count * hd, arch.head_count_kv * hd
        shapes: dict[str, list[int] | None] = {
            "token_embd.weight": [d, v],
            "output_norm.weight": [d],
            "output.weight": None,
        }
        for i in range(arch.block_count):
            p = f"blk.{i}."
            shapes.update(
                {
                    p + "attn_norm.weight": [d],
                    p + "attn_q.weight": [d, q],
                    p + "attn_k.weight": [d, kv],
                    p + "attn_v.weight": [d, kv],
                    p + "attn_output.weight": [q, d],
                    p + "ffn_norm.weight": [d],
                    p + "ffn_gate.weight": [d, ff],
                    p + "ffn_up.weight": [d, ff],
                    p + "ffn_down.weight": [ff, d],
                    p + "attn_q.bias": None,
                    p + "attn_k.bias": None,
                    p + "attn_v.bias": None,
                }
            )
        return shapes

    def make_cache(self, max_tokens: int) -> KVCache:
        """An empty KV cache for one sequence of at most ``max_tokens`` tokens."""
        a = self.arch
        return KVCache(a.block_count, a.head_count_kv, a.head_dim, max_tokens, self.dtype)

    def _norm(self, x: mx.array, w: Weight) -> mx.array:
        return mx.fast.rms_norm(x, w, self.arch.rms_norm_eps)

    def _proj(self, w: dict[str, Weight], name: str, x: mx.array) -> mx.array:
        y = linear(x, w[name + ".weight"])
        bias = w.get(name + ".bias")
        return y if bias is None else y + bias

    def attention(self, w: dict[str, Weight], layer: int, x: mx.array, cache: KVCache) -> mx.array:
        """Self-attention of block ``layer``: x [1, T, d] -> [1, T, d]; appends K/V to the cache."""
        a, p = self.arch, f"blk.{layer}."
        _, t, _ = x.shape
        h = self._norm(x, w[p + "attn_norm.weight"])
        q = self._proj(w, p + "attn_q", h).reshape(1, t, a.head_count, a.head_dim)
        k = self._proj(w, p + "attn_k", h).reshape(1, t, a.head_count_kv, a.head_dim)
        v = self._proj(w, p + "attn_v", h).reshape(1, t, a.head_count_kv, a.head_dim)
        q, k, v = (z.transpose(0, 2, 1, 3) for z in (q, k, v))
        rope = dict(
            dims=a.rope_dimension_count,
            traditional=self.rope_traditional,
            base=a.rope_freq_base,
            scale=1.0,
            offset=cache.offset,
        )
        q, k = mx.fast.rope(q, **rope), mx.fast.rope(k, **rope)
        keys, values = cache.update(layer, k, v)
        o = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=self.scale, mask="causal" if t > 1 else None
        )
        o = o.transpose(0, 2, 1, 3).reshape(1, t, a.head_count * a.head_dim)
        return self._proj(w, p + "attn_output", o)

    def ffn(self, w: dict[str, Weight], layer: int, x: mx.array) -> mx.array:
        """SwiGLU FFN of block ``layer``: x [1, T, d] -> [1, T, d]."""
        p = f"blk.{layer}."
        h = self._norm(x, w[p + "ffn_norm.weight"])
        g = linear(h, w[p + "ffn_gate.weight"])
        u = linear(h, w[p + "ffn_up.weight"])
        return linear(nn_silu(g) * u, w[p + "ffn_down.weight"])

    def forward(self, ids: list[int], cache: KVCache, all_logits: bool = False) -> mx.array:
        """Run ``ids`` (the next T tokens of the sequence) through the model.

        Returns:
            float32 logits, [T, vocab] if ``all_logits`` else [1, vocab] for the last token.
        """
        s = self.store
        x = s.rows("token_embd.weight", "token_embd", ids)[None].astype(self.dtype)
        for i in range(self.arch.block_count):
            attn, ffn = f"blk.{i}.attn", f"blk.{i}.ffn"
            x = s.release(attn, x + self.attention(s.unit(attn), i, x, cache))
            x = s.release(ffn, x + self.ffn(s.unit(ffn), i, x))
        cache.advance(len(ids))
        out = s.unit("output")
        x = self._norm(x if all_logits else x[:, -1:], out["output_norm.weight"])
        head = out.get("output.weight")
        if head is None:  # tied embeddings: the head is the token embedding table
            logits = linear(x[0], s.unit("token_embd")["token_embd.weight"]).astype(mx.float32)
            return s.release("token_embd", s.release("output", logits))
        return s.release("output", linear(x[0], head).astype(mx.float32))

    def unit_order(self) -> list[str]:
        """Units in the order ``forward`` asks the store for them (the streaming schedule)."""
        order = [f"blk.{i}.{k}" for i in range(self.arch.block_count) for k in ("attn", "ffn")]
        return order + ["output"] + (["token_embd"] if self.arch.tied_embeddings else [])


def nn_silu(x: mx.array) -> mx.array:
    """SiLU, x * sigmoid(x)."""
    return x * mx.sigmoid(x)
