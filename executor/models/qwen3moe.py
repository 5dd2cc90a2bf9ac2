"""Architecture ``qwen3moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B) as llama.cpp runs it
(``src/models/qwen3moe.cpp``).

The qwen3 decoder (``executor/models/qwen3.py``: per-head Q/K RMSNorm before NeoX RoPE, head
dimension from ``attention.key_length``) with a mixture of experts in every block's FFN
(``LlamaModel.moe_ffn``):

- router: softmax over all experts, top ``expert_used_count``, the chosen probabilities
  renormalized to sum to 1 (llama.cpp passes ``norm_w = true``; Qwen3's ``norm_topk_prob``), not
  scaled (``hparams.expert_weights_scale`` is never read for qwen3moe);
- experts ``expert_feed_forward_length`` wide, else ``feed_forward_length / expert_used_count``;
- no shared expert; the head may be tied to the embeddings.
"""

from __future__ import annotations

from strata.executor.models.llama import MoeRouting
from strata.executor.models.qwen3 import Qwen3Model


class Qwen3MoeModel(Qwen3Model):
    """A qwen3moe-architecture model over a weight store (see :class:`LlamaModel`)."""

    moe_routing = MoeRouting(gating="softmax", norm=True)
