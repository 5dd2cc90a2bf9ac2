"""Architecture ``gemma3`` (Gemma 3 text models) as llama.cpp runs it (``src/models/gemma3.cpp``,
its hyperparameter rules in ``llama-model.cpp``).

The llama decoder (``executor/models/llama.py``) with:

- the token embeddings scaled by sqrt(width);
- per-head RMSNorm of Q and K before RoPE, and RMSNorm of the attention and FFN outputs before
  their residual adds (``post_attention_norm``, ``post_ffw_norm``). Every norm weight is used as
  stored: llama.cpp's converter already added Gemma's 1 to them;
- a GELU-gated FFN (tanh approximation, as ggml's GELU);
- NEOX RoPE (halves rotated); queries scaled by 1/sqrt(head_dim), head_dim being
  ``attention.key_length`` (llama.cpp's rule; the 62-block 27B uses 1/sqrt(width / heads), its
  query_pre_attn_scalar);
- sliding-window attention where ``gemma3.attention.sliding_window`` is set: the windowed blocks
  (``strata.common.describe``: all but every 6th, or ``attention.sliding_window_pattern``) see the
  last ``sliding_window`` tokens with RoPE base ``rope.freq_base_swa`` (10000 by default) and no
  position scaling; the global blocks use ``rope.freq_base`` and ``rope.scaling.factor``;
- final logit soft-capping, ``c * tanh(logits / c)``, when the GGUF has
  ``gemma3.final_logit_softcapping``.
"""

from __future__ import annotations

import math

import mlx.core as mx
from strata.executor.models.llama import LayerAttention, LlamaModel

GELU_COEF_A = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class Gemma3Model(LlamaModel):
    """A gemma3-architecture model over a weight store (see :class:`LlamaModel`)."""

    rope_traditional = False
    qk_norm = True
    post_norms = True
    rope_freqs_tensor = False

    def query_scale(self) -> float:
        a = self.arch
        if a.block_count == 62:  # llama.cpp types it 27B: query_pre_attn_scalar = width / heads
            return 1.0 / math.sqrt(a.embedding_length / a.head_count)
        return 1.0 / math.sqrt(a.head_dim)

    def layer_attention(self, layer: int) -> LayerAttention:
        a = self.arch
        if layer in a.sliding_window_layers:
            base = a.rope_freq_base_swa or a.rope_freq_base
            return LayerAttention(base, 1.0, False, a.sliding_window)
        return LayerAttention(a.rope_freq_base, a.rope_freq_scale, False, 0)

    def embed(self, ids: list[int], device_ids: mx.array | None = None) -> mx.array:
        x = super().embed(ids, device_ids)
        return x * mx.array(math.sqrt(self.arch.embedding_length), dtype=x.dtype)

    def activation(self, gate: mx.array) -> mx.array:
        return gelu_tanh(gate)

    def final_logits(self, logits: mx.array) -> mx.array:
        cap = self.arch.final_logit_softcapping
        if cap > 0:
            return mx.tanh(logits / cap) * cap
        return logits


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + mx.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))
