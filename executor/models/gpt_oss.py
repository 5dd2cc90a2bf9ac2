"""Architecture ``gpt-oss`` (gpt-oss-20b, gpt-oss-120b) as llama.cpp runs it
(``LLM_ARCH_OPENAI_MOE``: ``src/models/openai-moe-iswa.cpp``, its hyperparameters and tensors in
``src/llama-model.cpp``).

The llama decoder (``executor/models/llama.py``) with:

- Q/K/V biases and an output-projection bias (``attn_output.bias``), all required;
- NeoX RoPE (halves rotated, llama.cpp's ``LLAMA_ROPE_TYPE_NEOX``; MLX's ``traditional=False``),
  scores scaled by 1/sqrt(head_dim); YaRN where the file sets ``rope.scaling.type`` yarn (as the
  published files do: ``LlamaModel._rope``);
- attention sinks: one learned logit per query head (``attn_sinks.weight``), an extra term in
  every softmax denominator with no value behind it (llama.cpp's ``build_attn`` hands them to
  ``ggml_soft_max_ext``; ``executor.attention.attend`` takes them on every path);
- alternating attention: the even blocks see the last ``attention.sliding_window`` tokens (their
  own included), the odd blocks every token (llama.cpp's ``set_swa_pattern(2)``,
  ``strata.common.describe``), both with the same RoPE;
- the FFN's input norm is ``post_attention_norm`` (there is no ``ffn_norm``);
- a mixture of experts in every block (``LlamaModel.moe_ffn``): the router has a bias
  (``ffn_gate_inp.bias``); the top ``expert_used_count`` experts are chosen by logit and
  weighted by the softmax of their k logits (llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE_
  SOFTMAX_WEIGHT``, ``norm_w = false``, no scale); each expert has biases on its gate, up and
  down projections and a clamped SwiGLU (:func:`swiglu_oai`); experts are
  ``expert_feed_forward_length`` wide and ship in MXFP4 (``strata.common.quant``);
- an untied head (``output.weight`` required).
"""

from __future__ import annotations

import mlx.core as mx
from strata.executor.models.llama import LayerAttention, LlamaModel, MoeRouting
from strata.executor.ops import linear, linear_add
from strata.executor.weights import Weight

SWIGLU_OAI_ALPHA = 1.702
"""The sigmoid's slope in gpt-oss's gated activation (llama.cpp's ``build_moe_ffn``,
``LLM_FFN_SWIGLU_OAI_MOE``)."""
SWIGLU_OAI_LIMIT = 7.0
"""The clamp of gpt-oss's gate (above only) and up (both sides) projections."""


def swiglu_oai(gate: mx.array, up: mx.array) -> mx.array:
    """gpt-oss's clamped SwiGLU, as ggml's ``ggml_swiglu_oai`` computes it (ggml-cpu
    ``ggml_compute_forward_swiglu_oai``): x = min(gate, 7), y = clamp(up, -7, 7),
    out = x * sigmoid(1.702 x) * (y + 1). Elementwise, any shape, ``gate``'s dtype."""
    x = mx.minimum(gate, SWIGLU_OAI_LIMIT)
    y = mx.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return x * mx.sigmoid(SWIGLU_OAI_ALPHA * x) * (y + 1.0)


class GptOssModel(LlamaModel):
    """A gpt-oss-architecture model over a weight store (see :class:`LlamaModel`)."""

    rope_traditional = False
    rope_freqs_tensor = False
    moe_routing = MoeRouting(gating="softmax_weight", norm=False)
    ffn_norm_name = "post_attention_norm"

    def layer_attention(self, layer: int) -> LayerAttention:
        """The windowed (even) blocks use ``rope.freq_base_swa`` where the file has it, else the
        one RoPE; the scale (YaRN's or linear) is the same for every block, as llama.cpp's
        ``get_rope_freq_scale`` gives it."""
        a = self.arch
        if layer in a.sliding_window_layers:
            base = a.rope_freq_base_swa or a.rope_freq_base
            return LayerAttention(base, a.rope_freq_scale, False, a.sliding_window)
        return LayerAttention(a.rope_freq_base, a.rope_freq_scale, False, 0)

    def attention_sinks(self, w: dict[str, Weight], layer: int) -> mx.array:
        """``blk.N.attn_sinks.weight``, [heads] in the compute dtype, the one ``attend`` takes
        them in (MLX's SDPA refuses sinks wider than its queries)."""
        sinks = w[f"blk.{layer}.attn_sinks.weight"]
        assert isinstance(sinks, mx.array)  # a vector is never stored quantized
        return sinks.astype(self.dtype)

    def _output(
        self, w: dict[str, Weight], name: str, h: mx.array, x: mx.array, post_norm: str
    ) -> mx.array:
        """The residual ``x`` plus the output projection ``name`` of ``h`` and its bias."""
        return linear_add(h, w[name + ".weight"], x, self.config) + w[name + ".bias"]

    def expert(self, ws: dict[str, Weight], h: mx.array) -> mx.array:
        """One expert on the rows that chose it, h [n, d] -> [n, d]: gate and up projections
        plus their biases, :func:`swiglu_oai`, the down projection plus its bias (llama.cpp's
        ``build_moe_ffn``: the biases are added per chosen expert before the activation and
        before the router's weight)."""
        c = self.config
        gate = linear(h, ws["gate"], c) + ws["gate_bias"]
        up = linear(h, ws["up"], c) + ws["up_bias"]
        return linear(swiglu_oai(gate, up), ws["down"], c) + ws["down_bias"]
