"""Architecture ``olmoe`` (OLMoE-1B-7B) as llama.cpp runs it (``src/models/olmoe.cpp``).

The llama decoder (``executor/models/llama.py``) with:

- Q and K each RMS-normalized over the whole projection (``attn_q_norm``, ``attn_k_norm`` are
  ``n_embd`` wide in llama.cpp, so K has as many heads as Q) after the projections and before
  the split into heads and RoPE; no Q/K/V biases (llama.cpp's olmoe graph adds none);
- NeoX RoPE (halves rotated, llama.cpp's ``LLAMA_ROPE_TYPE_NEOX``; MLX's ``traditional=False``);
- a mixture of experts in every block's FFN (``LlamaModel.moe_ffn``): softmax over all experts,
  top ``expert_used_count``, the chosen probabilities used as they are (llama.cpp passes
  ``norm_w = false``; OLMoE's ``norm_topk_prob`` is false) and not scaled; experts are
  ``feed_forward_length`` wide (llama.cpp reads no ``expert_feed_forward_length`` for olmoe);
- an ``output.weight`` llama.cpp requires (no tied embeddings), and ``expert_count`` > 0.
"""

from __future__ import annotations

from strata.executor.models.llama import LlamaModel, MoeRouting


class OlmoeModel(LlamaModel):
    """An olmoe-architecture model over a weight store (see :class:`LlamaModel`)."""

    rope_traditional = False
    qk_norm = True
    qk_norm_full = True
    rope_freqs_tensor = False
    moe_routing = MoeRouting(gating="softmax", norm=False)
