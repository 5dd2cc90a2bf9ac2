"""Architecture ``qwen3`` (dense Qwen3) as llama.cpp runs it (``src/models/qwen3.cpp``).

The llama decoder (``executor/models/llama.py``) with per-head RMSNorm of Q and K
(``attn_q_norm``, ``attn_k_norm``, weights of ``head_dim``) after the projections and before
RoPE, no Q/K/V biases, NEOX RoPE (halves rotated, MLX's ``traditional=False``), and a head
dimension from ``qwen3.attention.key_length`` that need not be width / heads.
"""

from __future__ import annotations

from strata.executor.models.llama import LlamaModel


class Qwen3Model(LlamaModel):
    """A qwen3-architecture model over a weight store (see :class:`LlamaModel`)."""

    rope_traditional = False
    qk_norm = True
    rope_freqs_tensor = False
