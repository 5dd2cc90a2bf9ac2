"""Architecture ``glm4moe`` (GLM-4.5, GLM-4.5-Air, GLM-4.6) as llama.cpp runs it
(``src/models/glm4-moe.cpp``; its hyperparameters and tensors in the same file's
``load_arch_hparams`` / ``load_arch_tensors``).

The llama decoder (``executor/models/llama.py``) with:

- Q/K/V projections with biases (``attn_{q,k,v}.bias``; llama.cpp takes them when present, and
  GLM-4.5's files have them), and per-head RMSNorm of Q and K before RoPE where the file has
  ``attn_{q,k}_norm`` (GLM-4.5 355B has them, Air not);
- partial NeoX RoPE: the first ``rope.dimension_count`` dimensions of each head (half the head
  in GLM-4.5) rotated in halves (llama.cpp's ``LLAMA_ROPE_TYPE_NEOX``; MLX's
  ``traditional=False`` with ``dims`` < head_dim leaves the rest unchanged, as ggml's rope does);
  queries scaled by 1/sqrt(head_dim), head_dim being ``attention.key_length``;
- the FFN's input norm is ``post_attention_norm`` (there is no ``ffn_norm``): RMSNorm of the
  residual stream after attention (in the ``blk.N.ffn`` unit, ``strata.common.describe``);
- the first ``leading_dense_block_count`` blocks have a dense SwiGLU FFN ``feed_forward_length``
  wide; the others are MoE (``LlamaModel.moe_block``):

  - router: sigmoid over all experts' logits (``expert_gating_func``, default sigmoid), the
    selection bias ``exp_probs_b.bias`` added for choosing the top ``expert_used_count`` only,
    the chosen experts weighted by their unbiased sigmoid probabilities, renormalized where
    ``expert_weights_norm`` is true and scaled by ``expert_weights_scale`` (llama.cpp reads all
    three from the GGUF for glm4moe, defaults: false, 0 = none), grouped top-k where the file
    sets ``expert_group_count`` (``llama.route``);
  - experts ``expert_feed_forward_length`` wide (else ``feed_forward_length /
    expert_used_count``);
  - ``expert_shared_count`` ungated shared experts, ``ffn_{gate,up,down}_shexp``
    ``expert_shared_count * expert_feed_forward_length`` wide, whose SwiGLU is added to the
    routed sum (``LlamaModel.shared_ffn``);

- ``nextn_predict_layers`` multi-token-prediction blocks after the others in the file: llama.cpp
  loads them as skipped tensors and never runs them; Strata leaves them out of the description
  (``Architecture.block_count`` counts the blocks that run), so they are neither planned nor
  loaded;
- the head may be tied to the embeddings (``output.weight`` optional).

Not supported: the multimodal M-RoPE variant (``rope.dimension_sections``, which llama.cpp runs
only for GLM-4.5V's vision inputs) and a fused ``ffn_gate_up_exps`` (refused as an unused tensor).
"""

from __future__ import annotations

from strata.executor.models.llama import MOE_GGUF_KEYS_ALL, LlamaModel, MoeRouting


class Glm4MoeModel(LlamaModel):
    """A glm4moe-architecture model over a weight store (see :class:`LlamaModel`)."""

    rope_traditional = False
    qk_norm = True
    rope_freqs_tensor = False
    ffn_norm_name = "post_attention_norm"
    shared_expert = True
    moe_routing = MoeRouting(gating="sigmoid", norm=False, gguf_keys=MOE_GGUF_KEYS_ALL)
