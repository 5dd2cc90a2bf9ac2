"""Architecture ``qwen2moe`` (Qwen1.5-MoE, Qwen2-57B-A14B) as llama.cpp runs it
(``src/models/qwen2moe.cpp``).

The qwen2 decoder (``executor/models/qwen2.py``: Q/K/V biases, NeoX RoPE) with a mixture of
experts in every block's FFN (``LlamaModel.moe_ffn``):

- router: softmax over all experts, top ``expert_used_count``, the chosen probabilities used as
  they are (not renormalized: llama.cpp passes ``norm_w = false``) and not scaled (it passes
  ``hparams.expert_weights_scale``, which its qwen2moe hyperparameters never read);
- experts ``expert_feed_forward_length`` wide, else ``feed_forward_length / expert_used_count``;
- a shared expert (``ffn_{gate,up,down}_shexp``, ``expert_shared_feed_forward_length`` wide,
  else ``feed_forward_length``) that every token runs, its output multiplied by
  sigmoid(``ffn_gate_inp_shexp`` . h), h the FFN-normed input, and added to the experts' sum.

llama.cpp requires an ``output.weight`` (no tied embeddings) and ``expert_count`` > 0.
"""

from __future__ import annotations

from strata.executor.models.llama import MoeRouting
from strata.executor.models.qwen2 import Qwen2Model


class Qwen2MoeModel(Qwen2Model):
    """A qwen2moe-architecture model over a weight store (see :class:`LlamaModel`)."""

    moe_routing = MoeRouting(gating="softmax", norm=False)
    shared_expert = True
