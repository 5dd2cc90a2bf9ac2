"""Architecture ``llama`` (Llama 1-3, SmolLM, Mistral-style dense models) as llama.cpp runs it, and
the decoder the other architectures' files build on.

Per block: RMSNorm -> grouped-query attention with RoPE -> residual; RMSNorm -> SwiGLU FFN ->
residual. GGUF's llama Q/K weights are permuted by the converter so that RoPE rotates adjacent
pairs (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``), which is MLX's ``traditional=True``.

- Llama 3 RoPE scaling: ``rope_freqs.weight`` (one factor per rotated pair, in the ``globals``
  unit) divides each pair's frequency, as llama.cpp's ``ggml_rope_ext`` frequency factors do;
  ``rope.scaling.type`` ``linear`` scales positions by ``1 / rope.scaling.factor``.
- Mistral-style sliding windows: where the GGUF has ``llama.attention.sliding_window``, every
  block (or those of ``attention.sliding_window_pattern``) attends only to the last that many
  tokens, including its own. llama.cpp ignores that key for ``llama`` (its logits are the same
  with and without it), so such a file differs from llama.cpp past the window, by design.

The forward pass runs unit by unit, asking the weight store for each unit as it is needed, so a
unit on any tier is used the moment it arrives and the numbers never depend on the tier. The
other architectures (``qwen2.py``, ``qwen3.py``, ``gemma3.py``) subclass :class:`LlamaModel` and
switch its parts on or off through class attributes and small hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from executor.kv_cache import KVCache
from executor.ops import linear
from executor.weights import Weight, WeightStore
from planner.errors import StrataError
from planner.schemas import Architecture

ROPE_SCALING_SUPPORTED = ("none", "linear")
"""``rope.scaling.type`` values the forward pass implements (YaRN and LongRoPE are not yet)."""


@dataclass(frozen=True)
class LayerAttention:
    """How one block attends: RoPE parameters and the window.

    Attributes:
        rope_base: RoPE base (theta).
        rope_scale: position scale (llama.cpp's ``freq_scale``).
        use_rope_freqs: divide frequencies by ``rope_freqs.weight`` (Llama 3 scaling).
        window: attend to the last ``window`` tokens only (0: all of them).
    """

    rope_base: float
    rope_scale: float
    use_rope_freqs: bool
    window: int


class LlamaModel:
    """A llama-architecture model over a weight store.

    Args:
        arch: hyperparameters from the GGUF.
        store: the weights, on the tiers the plan chose.
        dtype: compute dtype of activations and the KV cache.

    Raises:
        StrataError: a RoPE scaling type the forward pass does not implement.
    """

    rope_traditional = True
    """Adjacent-pair rotation (llama.cpp's NORM RoPE); False rotates halves (NEOX)."""
    qkv_bias = False
    """Q/K/V biases are required (qwen2); llama takes them when present."""
    qk_norm = False
    """Per-head RMSNorm of Q and K before RoPE (``attn_q_norm``/``attn_k_norm``)."""
    post_norms = False
    """RMSNorm of the attention and FFN outputs before each residual add (``post_attention_norm``,
    ``post_ffw_norm``)."""
    rope_freqs_tensor = True
    """The architecture reads Llama 3's ``rope_freqs.weight`` when present."""

    def __init__(self, arch: Architecture, store: WeightStore, dtype: mx.Dtype):
        self.arch, self.store, self.dtype = arch, store, dtype
        if arch.rope_scaling_type not in ROPE_SCALING_SUPPORTED:
            raise StrataError(
                f"RoPE scaling {arch.rope_scaling_type!r} is not supported yet "
                f"(supported: {', '.join(ROPE_SCALING_SUPPORTED)})"
            )
        self.scale = self.query_scale()
        self.has_globals = self.rope_freqs_tensor and _has_unit(store, "globals")
        self.layers = [self.layer_attention(i) for i in range(arch.block_count)]

    # ----------------------------------------------------------------- architecture hooks

    def query_scale(self) -> float:
        """Scale of the attention scores, 1/sqrt(head_dim)."""
        return 1.0 / math.sqrt(self.arch.head_dim)

    def layer_attention(self, layer: int) -> LayerAttention:
        """RoPE and window of block ``layer``: one RoPE for all blocks; the windowed blocks of
        the description (Mistral-style) attend to ``sliding_window`` tokens."""
        a = self.arch
        window = a.sliding_window if layer in a.sliding_window_layers else 0
        return LayerAttention(a.rope_freq_base, a.rope_freq_scale, self.has_globals, window)

    def embed(self, ids: list[int]) -> mx.array:
        """The token embeddings of ``ids``, [1, T, d] in the compute dtype."""
        return self.store.rows("token_embd.weight", "token_embd", ids)[None].astype(self.dtype)

    def activation(self, gate: mx.array) -> mx.array:
        """The FFN's gate activation: SiLU (SwiGLU)."""
        return nn_silu(gate)

    def final_logits(self, logits: mx.array) -> mx.array:
        """The head's output as returned (float32)."""
        return logits

    # ----------------------------------------------------------------- tensors and cache

    @classmethod
    def expected_shapes(cls, arch: Architecture) -> dict[str, list[int] | None]:
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
        if cls.rope_freqs_tensor:
            shapes["rope_freqs.weight"] = None
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
                    p + "attn_q.bias": [q] if cls.qkv_bias else None,
                    p + "attn_k.bias": [kv] if cls.qkv_bias else None,
                    p + "attn_v.bias": [kv] if cls.qkv_bias else None,
                }
            )
            if cls.qk_norm:
                shapes[p + "attn_q_norm.weight"] = [hd]
                shapes[p + "attn_k_norm.weight"] = [hd]
            if cls.post_norms:
                shapes[p + "post_attention_norm.weight"] = [d]
                shapes[p + "post_ffw_norm.weight"] = [d]
        return shapes

    def make_cache(self, max_tokens: int) -> KVCache:
        """An empty KV cache for one sequence of at most ``max_tokens`` tokens."""
        a = self.arch
        return KVCache(a.block_count, a.head_count_kv, a.head_dim, max_tokens, self.dtype)

    # ----------------------------------------------------------------- the shared parts

    def _norm(self, x: mx.array, w: Weight) -> mx.array:
        return mx.fast.rms_norm(x, w, self.arch.rms_norm_eps)

    def _proj(self, w: dict[str, Weight], name: str, x: mx.array) -> mx.array:
        y = linear(x, w[name + ".weight"])
        bias = w.get(name + ".bias")
        return y if bias is None else y + bias

    def _rope(
        self, x: mx.array, la: LayerAttention, offset: int, freqs: mx.array | None
    ) -> mx.array:
        dims = self.arch.rope_dimension_count
        if la.use_rope_freqs and freqs is not None:
            # MLX's freqs are inverse frequencies: base^(2i/dims), times llama.cpp's factor.
            inv = (la.rope_base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * freqs
            return mx.fast.rope(
                x,
                dims,
                traditional=self.rope_traditional,
                base=None,
                scale=la.rope_scale,
                offset=offset,
                freqs=inv,
            )
        return mx.fast.rope(
            x,
            dims,
            traditional=self.rope_traditional,
            base=la.rope_base,
            scale=la.rope_scale,
            offset=offset,
        )

    def attention(
        self,
        w: dict[str, Weight],
        layer: int,
        x: mx.array,
        cache: KVCache,
        rope_freqs: mx.array | None = None,
    ) -> mx.array:
        """Self-attention of block ``layer``: x [1, T, d] -> [1, T, d]; appends K/V to the cache.

        ``rope_freqs``: Llama 3's frequency factors (the ``globals`` unit), if the model has them.
        """
        a, p, la = self.arch, f"blk.{layer}.", self.layers[layer]
        _, t, _ = x.shape
        h = self._norm(x, w[p + "attn_norm.weight"])
        q = self._proj(w, p + "attn_q", h).reshape(1, t, a.head_count, a.head_dim)
        k = self._proj(w, p + "attn_k", h).reshape(1, t, a.head_count_kv, a.head_dim)
        v = self._proj(w, p + "attn_v", h).reshape(1, t, a.head_count_kv, a.head_dim)
        if self.qk_norm:
            q = self._norm(q, w[p + "attn_q_norm.weight"])
            k = self._norm(k, w[p + "attn_k_norm.weight"])
        q, k, v = (z.transpose(0, 2, 1, 3) for z in (q, k, v))
        start = cache.offset
        q = self._rope(q, la, start, rope_freqs)
        k = self._rope(k, la, start, rope_freqs)
        keys, values = cache.update(layer, k, v)
        keys, values, mask = _attention_span(keys, values, start, t, la.window)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(1, t, a.head_count * a.head_dim)
        o = self._proj(w, p + "attn_output", o)
        return self._norm(o, w[p + "post_attention_norm.weight"]) if self.post_norms else o

    def ffn(self, w: dict[str, Weight], layer: int, x: mx.array) -> mx.array:
        """Gated FFN of block ``layer`` (SwiGLU, or the subclass's activation): [1, T, d]."""
        p = f"blk.{layer}."
        h = self._norm(x, w[p + "ffn_norm.weight"])
        g = linear(h, w[p + "ffn_gate.weight"])
        u = linear(h, w[p + "ffn_up.weight"])
        o = linear(self.activation(g) * u, w[p + "ffn_down.weight"])
        return self._norm(o, w[p + "post_ffw_norm.weight"]) if self.post_norms else o

    def forward(self, ids: list[int], cache: KVCache, all_logits: bool = False) -> mx.array:
        """Run ``ids`` (the next T tokens of the sequence) through the model.

        Returns:
            float32 logits, [T, vocab] if ``all_logits`` else [1, vocab] for the last token.
        """
        s = self.store
        x = self.embed(ids)
        rope_freqs = None
        if self.has_globals:
            # Read once per pass and released at once: a new array (``* 1.0``), as a streamed
            # unit's slot is reused once released.
            factors = s.unit("globals")["rope_freqs.weight"]
            rope_freqs = s.release("globals", factors.astype(mx.float32) * 1.0)
        for i in range(self.arch.block_count):
            attn, ffn = f"blk.{i}.attn", f"blk.{i}.ffn"
            x = s.release(attn, x + self.attention(s.unit(attn), i, x, cache, rope_freqs))
            x = s.release(ffn, x + self.ffn(s.unit(ffn), i, x))
        cache.advance(len(ids))
        out = s.unit("output")
        x = self._norm(x if all_logits else x[:, -1:], out["output_norm.weight"])
        head = out.get("output.weight")
        if head is None:
            # Tied embeddings: the head is the token embedding table. The output unit (the final
            # norm) is released before the table is asked for, so that a pool of one slot can
            # stream both.
            x = s.release("output", x)
            logits = linear(x[0], s.unit("token_embd")["token_embd.weight"]).astype(mx.float32)
            return s.release("token_embd", self.final_logits(logits))
        logits = self.final_logits(linear(x[0], head).astype(mx.float32))
        return s.release("output", logits)

    def unit_order(self) -> list[str]:
        """Units in the order ``forward`` asks the store for them (the streaming schedule)."""
        order = ["globals"] if self.has_globals else []
        order += [f"blk.{i}.{k}" for i in range(self.arch.block_count) for k in ("attn", "ffn")]
        return order + ["output"] + (["token_embd"] if self.arch.tied_embeddings else [])


def _has_unit(store: WeightStore, unit: str) -> bool:
    try:
        store.tier(unit)
    except KeyError:
        return False
    return True


def _attention_span(
    keys: mx.array, values: mx.array, start: int, t: int, window: int
) -> tuple[mx.array, mx.array, mx.array | str | None]:
    """The keys/values the ``t`` queries at positions ``start..start+t-1`` may see, and the mask.

    Without a window: all cached keys, causal. With one (llama.cpp's ``LLAMA_SWA_TYPE_STANDARD``):
    query ``i`` sees key ``j`` iff ``j <= i`` and ``i - j < window``; keys older than every
    query's window are sliced off, the rest masked.
    """
    if not window:
        return keys, values, "causal" if t > 1 else None
    first = max(0, start - window + 1)  # the oldest key the first query sees
    keys, values = keys[:, :, first:], values[:, :, first:]
    if t == 1:
        return keys, values, None
    qpos = mx.arange(start, start + t)[:, None]
    kpos = mx.arange(first, start + t)[None, :]
    return keys, values, (kpos <= qpos) & (qpos - kpos < window)


def nn_silu(x: mx.array) -> mx.array:
    """SiLU, x * sigmoid(x)."""
    return x * mx.sigmoid(x)
