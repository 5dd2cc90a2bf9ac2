"""Architecture ``deepseek2`` (DeepSeek-V2/V2.5/V3/R1, Kimi K2, GLM-4.7-Flash) as llama.cpp runs it
(``src/models/deepseek2.cpp``; hyperparameters ``strata.common.describe._mla_keys``, tensors
``strata.common.tensors._mla_attention``).

Multi-head latent attention (MLA), in the absorbed form llama.cpp uses for files with
``attn_k_b``/``attn_v_b`` (its ``is_mla()`` path), per block and token:

- Q: ``attn_q`` (or ``attn_q_a`` -> RMSNorm ``attn_q_a_norm`` -> ``attn_q_b`` where
  ``q_lora_rank`` > 0), ``heads`` heads of ``nope + rope`` dims: ``q_nope`` (the first ``nope``)
  and ``q_pe`` (the last ``rope``, RoPE'd);
- ``attn_kv_a_mqa`` gives the compressed latent (``kv_lora_rank`` dims, then RMSNorm
  ``attn_kv_a_norm``) and one RoPE'd key part ``k_pe`` (``rope`` dims) shared by all heads;
- **the KV cache stores one row per token and block: [latent, k_pe]**, ``kv_lora_rank + rope``
  elements, one "head" (llama.cpp's MLA cache is the same MQA row, its V a view of K); the values
  are the row's latent part (``PagedKVCache(value_dim=kv_lora_rank)``), not a copy;
- each head's ``q_nope`` is taken into latent space by ``attn_k_b`` (per head [kv_lora_rank,
  nope]): the query [q_nope @ k_b^T, q_pe] scores against the cached rows (one key head for all
  query heads), scaled by 1/sqrt(nope + rope); the softmax-weighted latent is each head's output
  in latent space, taken out by ``attn_v_b`` (per head [v, kv_lora_rank]) and through
  ``attn_output``.

Scores are q_nope . (k_b latent) + q_pe . k_pe: exactly the decompressed attention's, so a file
in the legacy layout (one ``attn_kv_b`` [heads * (nope + v), kv_lora_rank], which llama.cpp
decompresses into per-head K/V instead) runs the same way, its ``attn_kv_b`` split per head into
the two parts here: the same function, rounded otherwise.

RoPE rotates adjacent pairs (llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` for deepseek2). Strata's CUDA
paged-attention kernel reads a value pool as wide as the keys, so an MLA cache always takes the
generic MLX attention paths (``executor.attention.kernel_attention`` declines a cache whose
values are part of its keys); the fused Q/K/V product is not used either (three different
projections).

Scale and YaRN: scores are scaled by 1/sqrt(nope + rope) times llama.cpp's mscale² (with YaRN
and ``rope.scaling.yarn_log_multiplier``, all of YaRN's magnitude is in that scale and the RoPE'd
parts keep only ``rope.scaling.attn_factor``; without the multiplier, and with linear scaling,
llama.cpp's graph scales otherwise: :meth:`Deepseek2Model.query_scale`,
:meth:`Deepseek2Model._yarn`, each case checked against llama.cpp by a synthetic model).
``attention.temperature_scale`` (Mistral-Large-3's per-position query temperature) is refused
when the file is described (``strata.common.describe._mla_keys``).

FFN: the first ``leading_dense_block_count`` blocks a dense SwiGLU, the others a mixture of
experts (``LlamaModel.moe_ffn``) with ``expert_shared_count`` ungated shared experts; the router
as the GGUF says (``expert_gating_func``, ``expert_weights_norm``, ``expert_weights_scale``, the
selection bias ``exp_probs_b``, expert groups), softmax, not renormalized and unscaled where it
says nothing (sigmoid for GLM-4.7-Flash's files: :func:`glm47_flash`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
from strata.common.schemas import Architecture
from strata.common.tensors import mla_dims
from strata.executor.attention import attend
from strata.executor.config import RuntimeConfig
from strata.executor.models.llama import MOE_GGUF_KEYS_ALL, LlamaModel, MoeRouting
from strata.executor.ops import QuantLinear, linear, linear_add
from strata.executor.paged_kv import ForwardBatch, PagedKVCache, SequenceCache
from strata.executor.weights import Weight, WeightStore


class Deepseek2Model(LlamaModel):
    """A deepseek2-architecture model over a weight store (see :class:`LlamaModel`)."""

    rope_traditional = True
    rope_freqs_tensor = False
    shared_expert = True  # ungated: deepseek2's blocks have no ffn_gate_inp_shexp
    moe_routing = MoeRouting(
        gating="softmax",
        norm=False,
        gguf_keys=MOE_GGUF_KEYS_ALL,
    )
    """llama.cpp's deepseek2 graph passes ``hparams.expert_weights_norm`` (default false),
    ``expert_weights_scale`` and ``expert_gating_func`` (softmax where the file has none, but
    sigmoid for GLM-4.7-Flash: :func:`glm47_flash`), all read from the GGUF."""

    def __init__(
        self, arch: Architecture, store: WeightStore, dtype: mx.Dtype, config: RuntimeConfig
    ):
        self.nope, self.rope_dims, self.v_dims, self.rank = mla_dims(arch)
        super().__init__(arch, store, dtype, config)
        if self.routing is not None and arch.expert_gating_func is None and glm47_flash(arch):
            self.routing = replace(self.routing, gating="sigmoid")

    def _graph_attn_factor(self) -> float:
        """The ``attn_factor`` llama.cpp's deepseek2 graph receives (``llama_context``'s
        constructor, ``cparams.yarn_attn_factor``): with YaRN (ext_factor != 0), g / (1 + 0.1 *
        ln factor), g = 1 where the file has ``rope.scaling.yarn_log_multiplier`` (its
        deepseek2 special case: mscale = mscale_all_dim) and get_mscale(factor) = 1 + 0.1 ln
        factor (factor > 1, else 1) where it has none; otherwise ``rope_yarn_attn_factor``
        (1: deepseek2 reads no ``yarn_attn_factor``); times ``rope.scaling.attn_factor`` either
        way."""
        a = self.arch
        factor = 1.0 / a.rope_freq_scale
        ext = 1.0 if a.rope_yarn_ext_factor is None else a.rope_yarn_ext_factor
        if a.rope_scaling_type == "yarn" and ext != 0:
            g = 1.0 if a.rope_yarn_log_mul or factor <= 1.0 else 1.0 + 0.1 * math.log(factor)
            attn = g / (1.0 + 0.1 * math.log(factor))
        else:
            attn = a.rope_yarn_attn_factor
        return attn * a.rope_attn_factor

    def query_scale(self) -> float:
        """mscale² / sqrt(nope + rope), as llama.cpp's deepseek2 graph computes ``kq_scale``: one
        head's decompressed Q/K width (``n_embd_head_k_mla``), not the cache row's; mscale =
        attn_factor_org * (1 + 0.1 * ``rope_yarn_log_mul`` * ln(1 / freq_scale)),
        attn_factor_org = :meth:`_graph_attn_factor` * (1 + 0.1 * ln(1 / freq_scale)) (the
        graph undoes the context's YaRN division for every scaling type: with linear scaling
        too, where nothing was divided, the scale grows so). 1/sqrt(nope + rope) without RoPE
        scaling or ``rope.scaling.attn_factor``."""
        a = self.arch
        log_factor = math.log(1.0 / a.rope_freq_scale)
        mscale = self._graph_attn_factor() * (1.0 + 0.1 * log_factor)
        mscale *= 1.0 + 0.1 * a.rope_yarn_log_mul * log_factor
        return float(np.float32(mscale * mscale / math.sqrt(a.key_length_mla)))

    def _yarn(self, base: float, freq_scale: float) -> tuple[mx.array, float]:
        """YaRN as :meth:`LlamaModel._yarn` (the same angles), the RoPE'd dims' magnitude the
        one ggml's RoPE gives deepseek2: :meth:`_graph_attn_factor` * (1 + 0.1 * ln(1 /
        freq_scale)) (ext_factor != 0; else the factor alone), i.e. ``rope.scaling.attn_factor``
        where the file has ``yarn_log_multiplier`` (the whole of YaRN's scaling then in
        :meth:`query_scale`), times 1 + 0.1 ln factor where it has none."""
        periods, _ = super()._yarn(base, freq_scale)
        a = self.arch
        ext = 1.0 if a.rope_yarn_ext_factor is None else a.rope_yarn_ext_factor
        mscale = self._graph_attn_factor()
        if ext != 0:
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        return periods, float(np.float32(mscale))

    # ----------------------------------------------------------------- the cache

    def make_cache(self, max_tokens: int) -> SequenceCache:
        """An empty latent cache for one sequence: one row of ``kv_lora_rank + rope`` per token
        and block, the values its first ``kv_lora_rank`` elements."""
        a = self.arch
        row = self.rank + self.rope_dims
        return SequenceCache(a.block_count, 1, row, max_tokens, self.dtype, value_dim=self.rank)

    def make_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """The latent block pool of the serving path (as :meth:`make_cache`'s rows)."""
        a = self.arch
        row = self.rank + self.rope_dims
        return PagedKVCache(
            a.block_count, 1, row, num_blocks, block_size, self.dtype, value_dim=self.rank
        )

    # ----------------------------------------------------------------- attention

    def attention(
        self,
        w: dict[str, Weight],
        layer: int,
        x: mx.array,
        batch: ForwardBatch,
        kv: PagedKVCache,
        rope_freqs: mx.array | None = None,
    ) -> mx.array:
        """The residual stream ``x`` [1, R, d] after block ``layer``'s latent attention (module
        docstring): ``x`` plus its output. The R rows' cache rows are written before any row
        attends, as in :meth:`LlamaModel.attention`."""
        p, la, c = f"blk.{layer}.", self.layers[layer], self.config
        rows, n, heads = x.shape[1], batch.num_tokens, self.arch.head_count
        nope, rank = self.nope, self.rank
        h = self._norm(x, w[p + "attn_norm.weight"])
        if self.arch.q_lora_rank:
            q = self._norm(linear(h, w[p + "attn_q_a.weight"], c), w[p + "attn_q_a_norm.weight"])
            q = linear(q, w[p + "attn_q_b.weight"], c)
        else:
            q = linear(h, w[p + "attn_q.weight"], c)
        q = q.reshape(rows, heads, 1, nope + self.rope_dims)
        positions = batch.positions(rows)
        q_pe = self._rope(q[..., nope:], la, positions, None)  # [R, heads, 1, rope]
        kv_a = linear(h, w[p + "attn_kv_a_mqa.weight"], c).reshape(rows, 1, 1, -1)
        latent = self._norm(kv_a[..., :rank], w[p + "attn_kv_a_norm.weight"])
        k_pe = self._rope(kv_a[..., rank:], la, positions, None)  # [R, 1, 1, rope]
        row = mx.concatenate([latent, k_pe], axis=-1).reshape(rows, 1, rank + self.rope_dims)
        kv.write(layer, batch.write_slots, row[:n] if rows > n else row, None)
        k_b, v_b = self._kv_b(w, p)
        # Each head's q_nope into latent space: [heads, R, nope] x k_b [heads, rank, nope].
        q_lat = _per_head(q[:, :, 0, :nope].transpose(1, 0, 2), k_b, heads)
        q_lat = q_lat.transpose(1, 0, 2)[:, :, None]  # [R, heads, 1, rank]
        o = attend(
            mx.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1),
            kv,
            layer,
            batch,
            la.window,
            self.scale,
            c,
        )  # [1, R, heads * rank]
        # Each head's latent output out through v_b: [heads, R, rank] x v_b [heads, v, rank].
        o = _per_head(o.reshape(rows, heads, rank).transpose(1, 0, 2), v_b, heads)
        o = o.transpose(1, 0, 2).reshape(1, rows, heads * self.v_dims)
        return linear_add(o, w[p + "attn_output.weight"], x, c)

    def _kv_b(
        self, w: dict[str, Weight], p: str
    ) -> tuple[Weight | _HeadsQuant, Weight | _HeadsQuant]:
        """The block's per-head latent expansions, each with one head's rows after another:
        k_b ([heads, rank, nope] from ``attn_k_b``, GGUF [nope, rank, heads]) and v_b ([heads, v,
        rank] from ``attn_v_b``, GGUF [rank, v, heads]), as stored: a quantized one arrives as a
        ``QuantLinear`` of all heads' rows (``executor.pack``), which :func:`_per_head` uses
        without a dequantized copy. In the legacy layout both are cut from ``attn_kv_b``
        ([heads * (nope + v), rank] in MLX order: each head's nope rows, then its v rows, as
        llama.cpp views them): a float one as views in the compute dtype; a quantized one as
        views of its packed rows (:class:`_HeadsQuant`: k_b's [heads, nope, rank] taken
        untransposed), never dequantized (a pass would otherwise expand every block's whole
        ``attn_kv_b``)."""
        if not self.arch.mla_legacy_kv_b:
            return w[p + "attn_k_b.weight"], w[p + "attn_v_b.weight"]
        heads, nope, rank = self.arch.head_count, self.nope, self.rank
        kv_b = w[p + "attn_kv_b.weight"]
        if isinstance(kv_b, QuantLinear):
            q = _HeadsQuant.of(kv_b, heads, transpose=False)
            k_b = replace(q, parts=tuple(None if a is None else a[:, :nope] for a in q.parts))
            v_b = replace(q, parts=tuple(None if a is None else a[:, nope:] for a in q.parts))
            return k_b, replace(v_b, transpose=True)
        kv_b = kv_b.reshape(heads, nope + self.v_dims, rank)
        k_b, v_b = kv_b[:, :nope].transpose(0, 2, 1), kv_b[:, nope:]
        return k_b.astype(self.dtype), v_b.astype(self.dtype)


@dataclass(frozen=True)
class _HeadsQuant:
    """Quantized per-head matrices for ``mx.gather_qmm``: ``parts`` (weight, scales, biases:
    None for MXFP4), each [heads, rows, packed], quantized along their last axis, in MLX's
    ``mode``; ``transpose``: head h's product is x @ W_h^T (W_h [out, in], as a ``QuantLinear``'s
    rows) or, False, x @ W_h (W_h [in, out], the legacy ``attn_kv_b``'s nope rows taking q_nope
    into latent space)."""

    parts: tuple[mx.array, mx.array, mx.array | None]
    group_size: int
    bits: int
    mode: str
    transpose: bool

    @classmethod
    def of(cls, w: QuantLinear, heads: int, transpose: bool) -> _HeadsQuant:
        """``w``'s rows ([heads * rows, in]) as ``heads`` matrices of ``rows`` rows (views)."""
        rows = w.shape[0] // heads
        parts = tuple(None if a is None else a.reshape(heads, rows, -1) for a in w.parts)
        return cls(parts, w.group_size, w.bits, w.mode, transpose)


def _per_head(x: mx.array, w: Weight | _HeadsQuant, heads: int) -> mx.array:
    """Each head's rows times its own matrix: x [heads, R, in], ``w`` the heads' matrices [heads,
    out, in] (a float array; or a ``QuantLinear`` of [heads * out, in] rows, or a
    :class:`_HeadsQuant`, taken by ``mx.gather_qmm``, head h's x with head h's matrix) -> [heads,
    R, out] in ``x``'s dtype."""
    if isinstance(w, QuantLinear):
        w = _HeadsQuant.of(w, heads, transpose=True)
    if isinstance(w, _HeadsQuant):
        y = mx.gather_qmm(
            x,
            *w.parts,
            rhs_indices=mx.arange(heads, dtype=mx.uint32),
            transpose=w.transpose,
            group_size=w.group_size,
            bits=w.bits,
            mode=w.mode,
        )
        return y.astype(x.dtype)
    return x @ w.astype(x.dtype).transpose(0, 2, 1)


GLM47_FLASH_VOCAB = 154880
"""GLM-4.7-Flash's vocabulary, by which llama.cpp recognizes its files (``glm47_flash``)."""


def glm47_flash(arch: Architecture) -> bool:
    """Whether llama.cpp takes the file for GLM-4.7-Flash, whose router is sigmoid where the GGUF
    has no ``expert_gating_func`` (the others' default is softmax, for the DeepSeek-V2/V2.5 files
    written before the key): 47 or 48 blocks and a vocabulary of 154,880 (``load_arch_hparams``
    in llama.cpp's ``src/models/deepseek2.cpp``)."""
    return arch.block_count in (47, 48) and arch.vocab_size == GLM47_FLASH_VOCAB
