"""Synthetic GGUF models: a real architecture's shapes and quant types, random weights.

Models bigger than this machine's memory are not available as real files, yet tier streaming has
to be exercised at their sizes. :func:`write_synthetic` writes a GGUF with the tensor names,
shapes and GGML types llama.cpp's converter produces for a given shape (:data:`SHAPES`: dense
Llama-3 8B and 1B, SmolLM2-135M; mixture-of-experts Mixtral-8x7B (architecture ``llama`` with
experts) and Qwen3-30B-A3B (``qwen3moe``); smaller shapes for benchmarks and tests), filled with
seeded random weights, and a real tokenizer copied from another GGUF (SmolLM2's by default, 49152
tokens, so embedding and head have 49152 rows whatever the real model's vocabulary). llama.cpp
loads and runs these files too, so it stays the oracle for the executor on them.

What is written: the architecture's required tensors and an untied head, names and shapes from
the inventory ``strata.common.tensors``; for ``ftype`` T (one of Q4_0, Q4_1, Q8_0), shapes in
numpy order (rows, cols) (the GGUF shape reversed), ``d`` the width, ``hd`` the head dim,
``q = heads * hd`` (= d unless the shape sets ``key_length``), ``kv = kv_heads * hd``, ``ff`` the
(per-expert) FFN width, ``E`` the expert count, "std" the target standard deviation of the
dequantized weights:

* ``token_embd.weight`` [vocab, d], T, std 1 (an RMSNorm follows, so its scale is free);
* per block ``blk.N.``: ``attn_norm`` and ``ffn_norm`` [d] F32, 1 + N(0, 0.05²); ``attn_q``
  [q, d], ``attn_k`` and ``attn_v`` [kv, d], ``attn_output`` [d, q]; qwen3moe also
  ``attn_q_norm`` and ``attn_k_norm`` [hd] F32, 1 + N(0, 0.05²) (RMSNorm of each head);
* a dense block: ``ffn_gate`` and ``ffn_up`` [ff, d], ``ffn_down`` [d, ff];
* an MoE block (E > 0) instead: the router ``ffn_gate_inp`` [E, d] F32, and the stacked experts
  ``ffn_gate_exps`` and ``ffn_up_exps`` [E, ff, d], ``ffn_down_exps`` [E, d, ff] (GGUF shapes
  [d, ff, E] and [ff, d, E], the expert dimension last, so each expert's bytes are contiguous);
* all matrices T with std 1/sqrt(cols) (the fan-in), so activations keep a unit scale;
* ``output_norm.weight`` [d] F32, 1 + N(0, 0.05²);
* ``output.weight`` [vocab, d], Q8_0, std ``logit_std``/sqrt(d).

Metadata as llama.cpp reads it: ``{arch}.block_count``, ``embedding_length``,
``feed_forward_length``, ``attention.head_count``/``head_count_kv``, ``rope.freq_base``,
``attention.layer_norm_rms_epsilon`` and, for MoE, ``{arch}.expert_count`` and
``expert_used_count``. Mixtral's experts are ``feed_forward_length`` wide; qwen3moe's are
``qwen3moe.expert_feed_forward_length`` wide, and its ``feed_forward_length`` is the config's
dense ``intermediate_size`` (6144 for Qwen3-30B-A3B; no layer uses it), as the converter writes
them; qwen3moe also has ``attention.key_length``/``value_length`` (its head dim, 128, is not
width / heads). MoE files also carry ``strata.synthetic.seed`` and ``strata.synthetic.routing``
(how the file was made: :func:`planner.synthetic_routing.successor_permutations` needs the seed).

The head is untied and Q8_0. llama.cpp's quantizer keeps ``token_embd`` in the file type and
writes ``output.weight`` as Q6_K for Q4_0/Q4_1 files, but the executor cannot load Q6_K yet
(``strata.common.quant.SUPPORTED_TYPES``), so Q8_0 — what llama.cpp uses for Q8_0 files — stands
in.
An untied head also keeps the embedding's scale (std 1, a sane residual stream) apart from the
head's (logits of std about ``logit_std``; 3 by default, as SmolLM2's real logits have a std of
3 to 4 over the vocabulary, so greedy decoding sees clear winners as it does on a trained model).

Weights are never quantized from floats (far too slow at 8B): each quant block is built directly
as bytes (``gguf.constants.GGML_QUANT_SIZES`` gives the sizes): random codes and a per-block scale
``d`` = base × U(0.5, 1.5), base chosen so every matrix has the std above:

* Q4_0 (f16 d, 16 B nibbles; w = d (q - 8)): nibble 0 is replaced by 8, so q - 8 is symmetric in
  [-7, 7] (mean 0, variance 17.5); uniform codes in [-8, 7] would have a mean of -d/2, a bias
  shared by every row that adds up over thousands of columns;
* Q4_1 (f16 d, f16 m, 16 B nibbles; w = d q + m): q uniform in [0, 15] (variance 21.25) and
  m = -d × U(7, 8), so every block is centred near 0;
* Q8_0 (f16 d, 32 × int8; w = d q): code -128 is replaced by 0 (q in [-127, 127], variance
  5397.5), as llama.cpp's quantizer never writes -128.

Every tensor draws from its own generator, seeded by (seed, crc32 of its name), so the file is a
pure function of (shape, ftype, seed, routing, tokenizer) — the same bytes on every run (numpy's
``Generator`` streams are stable across releases barring bug fixes) — and a tensor's contents do
not depend on which other tensors the file has (block 0 of ``--layers 2`` equals block 0 of the
full model, in every routing mode). Tensors are generated in chunks of rows (a stacked expert
tensor as E × rows rows) and streamed to disk: memory stays around ``_CHUNK_BYTES`` times a small
factor whatever the model size.

Routing (MoE shapes; ``routing=``, ``strata synth --routing``)
---------------------------------------------------------

Fixed targets of ``skewed`` (:mod:`planner.synthetic_routing`, set before any measurement): each
layer's top quarter of experts takes ``TARGET_SHARE`` = 0.60 of its selections, and given that an
expert fired, its designated successor at the next layer fires ``TARGET_LIFT`` = 3 times more
often than chance (k/E).

The design (``uniform`` and ``skewed``). Experts are arranged in E *lanes*
(:func:`planner.synthetic_routing.expert_lanes`): lane c holds one expert per layer (a random id
per layer), lane c has popularity rank c, and the designated successor of lane c's expert at
layer l is lane c's expert at layer l+1. A token's router logit for lane c at layer l is, in units
of the token noise's std, ``beta[c] + eps[l, c]``, with ``beta[c] = -B c / (E - 1)`` and the
noise correlated by ``rho`` from one layer to the next along the lane. ``skewed`` uses the (B, rho)
that :func:`planner.synthetic_routing.calibrate` finds for (E, k) (8 experts top-2: B = 2.66,
rho = 0.81; 128 top-8: B = 1.87, rho = 0.20); ``uniform`` uses B = rho = 0 (every expert equally
likely, layers independent). The weights carry it through a *routing subspace*: the first
``m = 32 + n_noise`` dimensions of the residual stream, a "popularity" block P (dimensions 0-31)
and a "noise" block N (the next ``n_noise`` = 32 × clamp(d // 256, 1, 8)):

* ``token_embd``: every token's P block is the constant 1 (each of its 32 elements; exact in all
  three types), a direction shared by every token; its N block keeps the random codes, a
  token-specific noise vector of std 1, but without the per-block scale jitter (so that all
  tokens' noise vectors have about the same norm).
* ``attn_output`` rows 0..m-1 and every expert's ``ffn_down_exps`` rows 0..m-1 are zero, so
  nothing but the embedding writes the routing subspace: it reaches every layer unchanged, and
  RMSNorm scales it by 1/rms(h) like the rest of the stream, which moves no top-k.
* ``ffn_gate_inp`` of layer l, row of lane c's expert: ``beta[c] / 32`` on each of the 32 P
  columns (so the row reads ``beta[c]`` from the P block), the lane's noise direction ``nu[l, c]``
  on the N columns, zero elsewhere, all times ``ROUTER_GAIN``. ``nu[0, c]`` is a random unit
  vector, so it reads N(0, 1) noise from the embedding's N block, and ``nu[l+1, c] = unit(rho
  nu[l, c] + sqrt(1 - rho²) fresh)`` (a fresh random unit vector, seeded per layer): the noise a
  token sees on a lane is correlated by rho between consecutive layers (in expectation over the
  draws; one draw's directions overlap by about ±1/sqrt(n_noise)).

The uniform and skewed files of one (shape, seed) differ only in their ``ffn_gate_inp`` tensors
(and the metadata naming the routing).
What differs from a trained model: a token's routing is a function of its id alone (the routing
subspace holds nothing else), so a repeated token routes the same way at every layer and context
never moves the choice (in trained models it does too). Lanes make a popular
expert's successor popular too, so about half of the lift over chance is popularity (the "lift
over marginal" of :func:`planner.synthetic_routing.routing_stats` is about 1.6). Measured
statistics differ from the targets by the sampling noise of the token set and of one draw of the
noise directions.

A first design, simulated and dropped: each expert's FFN writes a signature direction that the
next layer's router row of its successor reads. An expert's output reaches the residual stream
multiplied by its routing weight w, so the successor's boost is proportional to w: the top-1
expert's successor wins with a large weight, whose successor wins again, while the other chosen
experts' successors get little. In the simulation the lift for 8 experts top-2 stayed under about
2.8 at a share of 0.6, and fell again as the boost grew; successors of independent popularity
also bound it (see :mod:`planner.synthetic_routing`).

``random``: the router is random like every other weight (N(0, 1/d) over the whole width, router
logits of std about 1) and nothing else is designed: a plain random model. Its routing is not
uniform: attention averages the values of all earlier tokens, so the residual stream of a random
model builds up a component shared by every token, which a random router reads as a fixed
per-expert bias that grows with depth (``tiny-moe`` with 16 layers: the top quarter's share
climbs from 0.33 at the first layer to 0.45-0.6 in the last ones).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES, MODEL_TENSOR
from pydantic import ValidationError
from strata.common.atomic import temporary_beside
from strata.common.errors import StrataError
from strata.common.schemas import Architecture
from strata.common.tensors import file_tensors
from strata.planner.synthetic_routing import SEED_KEY, calibrate, expert_lanes
from tqdm import tqdm

__all__ = [
    "FTYPES",
    "ROUTING",
    "ROUTING_KEY",
    "SEED_KEY",
    "SHAPES",
    "RoutingLayout",
    "Shape",
    "SyntheticModel",
    "TensorSpec",
    "architecture",
    "routing_layout",
    "shape_from_args",
    "tensor_specs",
    "write_synthetic",
]

_T = GGMLQuantizationType

_CHUNK_BYTES = 16 << 20  # generate and write at most ~16 MiB of tensor bytes at a time
_BLOCK = 32  # elements per block of every type written here (Q4_0, Q4_1, Q8_0)

ARCHS = ("llama", "qwen3moe")
"""Architectures written: ``llama`` (dense, or Mixtral-style with experts) and ``qwen3moe``."""

ROUTING = ("uniform", "skewed", "random")
"""Router designs of MoE models (module docstring)."""

ROUTER_GAIN = 1.0
"""Designed routers are scaled so that a token's logits are ``ROUTER_GAIN`` × (beta + noise) /
rms(h) (h the residual stream): about a random router's logit scale at the first layer, flatter
where the stream has grown. It changes the routing weights, never the choice."""

ROUTING_KEY = "strata.synthetic.routing"
"""Metadata key of MoE files' routing (``SEED_KEY``, from planner.synthetic_routing, their seed)."""

_P_WIDTH = 32  # popularity block of the routing subspace: dimensions 0..31
_NORM_STD = 0.05  # std of a norm weight around 1 (module docstring)


@dataclass(frozen=True)
class Shape:
    """A model shape: architecture, sizes, attention and (for MoE) experts.

    Attributes:
        name: label written into ``general.name`` (a preset's name, ``+key=value`` per override).
        layers: transformer blocks.
        width: embedding length (residual stream width), elements.
        ffn: feed-forward hidden length, elements: one expert's in an MoE model.
        heads: query heads.
        kv_heads: key/value heads (grouped-query attention).
        context_length: trained context written to the metadata, tokens (plans choose their own).
        rope_freq_base: RoPE theta.
        rms_eps: RMSNorm epsilon.
        arch: ``general.architecture``: ``llama`` or ``qwen3moe`` (:data:`ARCHS`).
        experts: experts per MoE block (0: dense).
        experts_used: experts chosen per token (0 for dense).
        key_length: head dim written as ``attention.key_length``/``value_length`` (0: width /
            heads, no key).
        dense_ffn: qwen3moe's ``feed_forward_length`` (the config's dense intermediate size,
            which no layer uses); 0 writes ``ffn``.
    """

    name: str
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    context_length: int
    rope_freq_base: float
    rms_eps: float = 1e-5
    arch: str = "llama"
    experts: int = 0
    experts_used: int = 0
    key_length: int = 0
    dense_ffn: int = 0

    @property
    def head_dim(self) -> int:
        """Elements per attention head: ``key_length``, else width / heads."""
        return self.key_length or self.width // self.heads

    @property
    def q_width(self) -> int:
        """Rows of ``attn_q`` (= columns of ``attn_output``): heads × head dim."""
        return self.heads * self.head_dim

    def validate(self) -> None:
        """Check the shape can be written in 32-element blocks and run as its architecture.

        Raises:
            StrataError: one line naming the bad value and what it must be.
        """
        if self.arch not in ARCHS:
            raise StrataError(f"architecture {self.arch!r}: use one of {', '.join(ARCHS)}")
        for key in ("layers", "width", "ffn", "heads", "kv_heads"):
            if getattr(self, key) < 1:
                raise StrataError(f"--{key.replace('_', '-')} must be at least 1")
        # Every quantized row runs along `width`, `ffn` or `q_width` in 32-element blocks; K/V
        # have kv_heads * head_dim rows, which need not be a multiple of anything.
        for key, value in (("width", self.width), ("ffn", self.ffn)):
            if value % _BLOCK:
                raise StrataError(
                    f"--{key} {value} is not a multiple of {_BLOCK} (the quant block size)"
                )
        if not self.key_length and self.width % self.heads:
            raise StrataError(
                f"--width {self.width} is not a multiple of --heads {self.heads} "
                "(head dim = width / heads)"
            )
        if self.head_dim % 2:
            raise StrataError(f"head dim {self.head_dim} (width / heads) must be even for RoPE")
        if self.q_width % _BLOCK:
            raise StrataError(
                f"heads x head dim = {self.q_width} is not a multiple of {_BLOCK} "
                "(attn_output's rows are that long)"
            )
        if self.heads % self.kv_heads:
            raise StrataError(
                f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads} "
                "(grouped-query attention shares each KV head among a whole number of heads)"
            )
        if self.experts < 0 or self.experts_used < 0:
            raise StrataError("--experts and --experts-used must not be negative")
        if self.experts and not 1 <= self.experts_used <= self.experts:
            raise StrataError(
                f"--experts-used {self.experts_used} must be 1 to --experts {self.experts}"
            )
        if not self.experts and self.experts_used:
            raise StrataError(
                f"--experts-used {self.experts_used} without experts (--experts 0 is dense)"
            )
        if self.arch == "qwen3moe" and not self.experts:
            raise StrataError("qwen3moe has experts in every block: --experts must be at least 1")


#: Preset shapes (from the models' config.json / GGUF metadata).
SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape("llama3-8b", 32, 4096, 14336, 32, 8, 8192, 500000.0),
    "llama3-1b": Shape("llama3-1b", 16, 2048, 8192, 32, 8, 131072, 500000.0),
    "smollm2-135m": Shape("smollm2-135m", 30, 576, 1536, 9, 3, 8192, 100000.0),
    "tiny": Shape("tiny", 2, 64, 128, 4, 2, 2048, 10000.0),
    # Mixtral-8x7B: llama with 8 experts of 14336, 2 per token.
    "mixtral-8x7b": Shape(
        "mixtral-8x7b", 32, 4096, 14336, 32, 8, 32768, 1e6, 1e-5, experts=8, experts_used=2
    ),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token; head dim 128 (q is 4096 wide, d 2048).
    "qwen3-30b-a3b": Shape(
        "qwen3-30b-a3b",
        48,
        2048,
        768,
        32,
        4,
        40960,
        1e6,
        1e-6,
        arch="qwen3moe",
        experts=128,
        experts_used=8,
        key_length=128,
        dense_ffn=6144,
    ),
    # Mixtral's layout (32 blocks, 8 experts top-2, head dim 128, 4 query heads per KV head) at a
    # quarter of its width and FFN: 1.7 GB in Q4_0, 6.2 MB per expert, for CPU streaming benches.
    "mixtral-bench": Shape(
        "mixtral-bench", 32, 1024, 3584, 8, 2, 32768, 1e6, 1e-5, experts=8, experts_used=2
    ),
    # For tests: 4 MoE blocks of 8 experts (top-2), width 128.
    "tiny-moe": Shape("tiny-moe", 4, 128, 64, 4, 2, 2048, 10000.0, experts=8, experts_used=2),
}

#: ``--ftype`` name -> (GGML type of the block matrices and token_embd, general.file_type).
FTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "Q4_0": (_T.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (_T.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "Q8_0": (_T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}

# Variance of the code term (q - 8, q, q) of each type as drawn here; see the module docstring.
_CODE_VAR = {_T.Q4_0: 2 * sum(k * k for k in range(1, 8)) / 16, _T.Q4_1: 255 / 12}
_CODE_VAR[_T.Q8_0] = 2 * sum(k * k for k in range(1, 128)) / 256
_JITTER_RMS = math.sqrt(13 / 12)  # sqrt(E[u^2]) for u ~ U(0.5, 1.5), the per-block scale jitter


def _code_lut(qtype: GGMLQuantizationType) -> np.ndarray | None:
    """Byte -> byte map applied to uniform random code bytes (None: use them as they are)."""
    b = np.arange(256, dtype=np.uint8)
    if qtype == _T.Q4_0:  # nibble 0 (code -8) -> 8 (code 0), in both halves of the byte
        lo, hi = b & 0x0F, b >> 4
        lo[lo == 0], hi[hi == 0] = 8, 8
        return lo | (hi << 4)
    if qtype == _T.Q8_0:  # int8 -128 -> 0
        b[0x80] = 0
        return b
    return None


def shape_from_args(
    shape: str,
    *,
    layers: int | None = None,
    width: int | None = None,
    ffn: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    experts: int | None = None,
    experts_used: int | None = None,
) -> Shape:
    """A preset shape with the given overrides, validated.

    ``experts=0`` alone makes a llama MoE preset dense (experts_used follows to 0).

    Raises:
        StrataError: unknown preset or an invalid override (one line).
    """
    base = SHAPES.get(shape)
    if base is None:
        raise StrataError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    given = dict(
        layers=layers,
        width=width,
        ffn=ffn,
        heads=heads,
        kv_heads=kv_heads,
        experts=experts,
        experts_used=experts_used,
    )
    overrides = {k: v for k, v in given.items() if v is not None and v != getattr(base, k)}
    name = base.name + "".join(f"+{k}={v}" for k, v in overrides.items())
    if experts == 0 and experts_used is None:
        overrides["experts_used"] = 0
    s = dataclasses.replace(base, name=name, **overrides)
    s.validate()
    return s


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write.

    Attributes:
        name: GGUF tensor name.
        shape: numpy order (``(rows, cols)`` for matrices, ``(experts, rows, cols)`` for stacked
            experts: the GGUF shape reversed).
        qtype: GGML type.
        std: target standard deviation of the weights (matrices, routers) or of ``w - 1``
            (norms).
        kind: ``matrix`` (quantized, zero mean), ``norm`` (F32, mean 1) or ``router`` (F32;
            random with zero mean for ``random`` routing, else built by the routing design).
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    std: float
    kind: str = "matrix"

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the file (before alignment padding)."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def architecture(shape: Shape, vocab: int) -> Architecture:
    """The hyperparameters of a model of ``shape`` with a ``vocab``-token tokenizer: those
    ``strata.common.describe`` reads back from the metadata :func:`write_synthetic` writes (an
    untied head; qwen3moe's experts ``expert_feed_forward_length`` wide).

    Raises:
        StrataError: a shape ``Architecture`` refuses (validate it first for a clearer error).
    """
    try:
        return Architecture(
            name=shape.arch,
            block_count=shape.layers,
            context_length=shape.context_length,
            embedding_length=shape.width,
            feed_forward_length=shape.dense_ffn or shape.ffn,
            head_count=shape.heads,
            head_count_kv=shape.kv_heads,
            head_dim=shape.head_dim,
            vocab_size=vocab,
            rope_freq_base=shape.rope_freq_base,
            rope_dimension_count=shape.head_dim,
            rms_norm_eps=shape.rms_eps,
            tied_embeddings=False,
            expert_count=shape.experts,
            expert_used_count=shape.experts_used,
            expert_feed_forward_length=shape.ffn if shape.arch == "qwen3moe" else 0,
        )
    except ValidationError as e:
        raise StrataError(f"shape {shape.name}: {e.errors()[0]['msg']}") from None


def tensor_specs(
    shape: Shape, qtype: GGMLQuantizationType, vocab: int, *, logit_std: float = 3.0
) -> list[TensorSpec]:
    """Every tensor of a model of ``shape``, in file order (embedding, blocks, head): the
    architecture's required tensors and an untied head (``strata.common.tensors.file_tensors``),
    with the types and scales of the module docstring.

    Raises:
        StrataError: as :func:`architecture`, or experts the architecture cannot have.
    """
    d = shape.width
    specs = []
    for t in file_tensors(architecture(shape, vocab)):
        dims = t.shape[::-1]  # numpy order
        if t.kind == MODEL_TENSOR.TOKEN_EMBD:
            spec = TensorSpec(t.name, dims, qtype, 1.0)
        elif t.kind == MODEL_TENSOR.OUTPUT:
            spec = TensorSpec(t.name, dims, _T.Q8_0, logit_std / math.sqrt(d))
        elif t.kind == MODEL_TENSOR.FFN_GATE_INP:
            spec = TensorSpec(t.name, dims, _T.F32, 1 / math.sqrt(d), "router")
        elif len(dims) == 1 and t.key.endswith("norm.weight"):
            spec = TensorSpec(t.name, dims, _T.F32, _NORM_STD, "norm")
        elif len(dims) > 1:
            spec = TensorSpec(t.name, dims, qtype, 1 / math.sqrt(dims[-1]))  # fan-in: the columns
        else:
            raise StrataError(f"synthetic models cannot write {shape.arch}'s tensor {t.key}")
        specs.append(spec)
    return specs


# --------------------------------------------------------------------------- routing design


@dataclass(frozen=True)
class RoutingLayout:
    """The designed routing of a ``uniform`` or ``skewed`` model (module docstring).

    Attributes:
        noise_width: dimensions of the noise block N (a multiple of 32); the routing subspace
            is dimensions ``0 .. 32 + noise_width - 1``: the P block, then N.
        spread: B, the popularity bias range (noise std units; 0 for uniform).
        rho: correlation of a lane's noise from one layer to the next (0 for uniform).
    """

    noise_width: int
    spread: float
    rho: float

    @property
    def width(self) -> int:
        """Dimensions 0..width-1 are the routing subspace."""
        return _P_WIDTH + self.noise_width


def routing_layout(shape: Shape, routing: str) -> RoutingLayout | None:
    """The routing design of a model of ``shape``: None for ``random`` routers and dense shapes.

    N is 32 × clamp(width // 256, 1, 8) dimensions wide; (B, rho) are 0 for ``uniform`` and
    :func:`planner.synthetic_routing.calibrate`'s for ``skewed``.

    Raises:
        StrataError: an unknown routing, ``skewed`` or ``random`` on a dense shape, a width
            under 128 (the routing subspace may take at most half of the stream), or expert
            counts the skewed design cannot meet its targets with (one line).
    """
    if routing not in ROUTING:
        raise StrataError(f"unknown --routing {routing!r}: use one of {', '.join(ROUTING)}")
    if not shape.experts:
        if routing != "uniform":  # the default: nothing to route
            raise StrataError(f"--routing {routing} needs an MoE shape (--experts at least 1)")
        return None
    if routing == "random":
        return None
    noise = _BLOCK * min(8, max(1, shape.width // 256))
    if 2 * (_P_WIDTH + noise) > shape.width:
        raise StrataError(
            f"--routing {routing} needs --width at least {2 * (_P_WIDTH + noise)} (its routing "
            f"subspace is {_P_WIDTH + noise} dimensions, at most half of the stream); "
            "--routing random has no such limit"
        )
    if routing == "uniform":
        return RoutingLayout(noise, 0.0, 0.0)
    cal = calibrate(shape.experts, shape.experts_used)  # raises if the targets are out of reach
    return RoutingLayout(noise, cal.spread, cal.rho)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@functools.lru_cache(maxsize=4)
def _lane_noise(n: int, width: int, rho: float, seed: int, layer: int) -> np.ndarray:
    """``nu[layer]``, each lane's noise direction over the N block: float64 [n, width], unit rows.

    nu[0] = fresh[0], nu[l] = unit(rho nu[l-1] + sqrt(1 - rho²) fresh[l]), with fresh[l] random
    unit rows (normal draws seeded by (seed, "lane-noise", l), normalized). Computed layer after
    layer (cached), so layer l does not depend on how many layers the model has.
    """
    rng = np.random.default_rng([seed, zlib.crc32(b"lane-noise"), layer])
    fresh = _unit_rows(rng.standard_normal((n, width)))
    if layer == 0 or rho == 0:
        return fresh
    prev = _lane_noise(n, width, rho, seed, layer - 1)
    return _unit_rows(rho * prev + math.sqrt(1 - rho * rho) * fresh)


def _designed_router(shape: Shape, layout: RoutingLayout, seed: int, layer: int) -> np.ndarray:
    """``ffn_gate_inp`` of one block in the uniform or skewed design: float32 [E, width]."""
    n = shape.experts
    beta = -layout.spread * np.arange(n) / (n - 1)  # by lane: lane 0 is the most popular
    lanes = expert_lanes(n, layer + 1, seed)[layer]  # lanes[c] = expert id of lane c
    w = np.zeros((n, shape.width))
    w[lanes, :_P_WIDTH] = (beta / _P_WIDTH)[:, None]
    w[lanes, _P_WIDTH : layout.width] = _lane_noise(n, layout.noise_width, layout.rho, seed, layer)
    return (ROUTER_GAIN * w).astype(np.float32)


def _block_bytes(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``values`` (float, a multiple of 32 long) quantized: uint8 [n_blocks, type_size]."""
    data = gguf.quants.quantize(values.reshape(1, -1).astype(np.float32), qtype)
    return data.reshape(-1, GGML_QUANT_SIZES[qtype][1])


_Patch = Callable[[np.ndarray, int], None]
"""Edits a chunk in place: (uint8 [rows, row_bytes], index of its first row)."""


def _design_patch(spec: TensorSpec, shape: Shape, layout: RoutingLayout) -> _Patch | None:
    """How the routing design edits a quantized tensor's random rows (None: it does not)."""
    name = spec.name
    if name == "token_embd.weight":
        p_block = _block_bytes(np.ones(_P_WIDTH), spec.qtype).reshape(-1)
        size = p_block.size  # bytes per block
        n_blocks = layout.noise_width // _BLOCK
        # N blocks keep their random codes but get the scale of std 1 without the per-block
        # jitter, so every token's noise vector has about the same norm (one block scale of
        # U(0.5, 1.5) would set a whole token's noise scale at narrow widths).
        d = np.array([spec.std / math.sqrt(_CODE_VAR[spec.qtype])], dtype="<f2")
        fields = d.view(np.uint8)
        if spec.qtype == _T.Q4_1:  # m = -7.5 d centres the codes 0..15
            fields = np.concatenate([fields, np.array(-7.5 * d, dtype="<f2").view(np.uint8)])

        def embd(rows: np.ndarray, start: int) -> None:
            rows[:, :size] = p_block  # the P block: 1 in every token
            blocks = rows[:, size : size * (1 + n_blocks)].reshape(len(rows), n_blocks, size)
            blocks[:, :, : fields.size] = fields

        return embd
    if name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
        period = shape.width  # ffn_down_exps: E stacked [width, ff] matrices

        def zero(rows: np.ndarray, start: int) -> None:
            idx = (start + np.arange(rows.shape[0])) % period
            rows[idx < layout.width] = 0  # d = 0: every weight 0, in all three types

        return zero
    return None


def _chunks(
    spec: TensorSpec, seed: int, patch: _Patch | None = None, router: np.ndarray | None = None
) -> Iterator[np.ndarray]:
    """The tensor's bytes (uint8), a chunk of whole rows at a time.

    Args:
        spec: the tensor.
        seed: the model's seed (with the name, it seeds the tensor's generator).
        patch: edits each chunk of random rows in place (the routing design).
        router: a designed router's values (``kind == "router"``) instead of random ones.
    """
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.kind == "norm":
        yield rng.normal(1.0, spec.std, spec.shape).astype("<f4").view(np.uint8)
        return
    if spec.kind == "router":
        values = rng.normal(0.0, spec.std, spec.shape) if router is None else router
        yield np.ascontiguousarray(values, dtype="<f4").view(np.uint8).reshape(-1)
        return
    rows, cols = math.prod(spec.shape[:-1]), spec.shape[-1]
    type_size = GGML_QUANT_SIZES[spec.qtype][1]
    row_bytes = cols // _BLOCK * type_size
    step = max(1, _CHUNK_BYTES // row_bytes)
    lut = _code_lut(spec.qtype)
    base = spec.std / math.sqrt(_CODE_VAR[spec.qtype]) / _JITTER_RMS
    for start in range(0, rows, step):
        n = min(step, rows - start) * (cols // _BLOCK)  # blocks in this chunk
        out = np.empty((n, type_size), dtype=np.uint8)
        head = 4 if spec.qtype == _T.Q4_1 else 2  # f16 fields before the codes
        codes = rng.integers(0, 256, (n, type_size - head), dtype=np.uint8)
        out[:, head:] = codes if lut is None else lut[codes]
        d = (base * rng.uniform(0.5, 1.5, n)).astype("<f2")
        out[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        if spec.qtype == _T.Q4_1:
            m = (-d.astype(np.float32) * rng.uniform(7.0, 8.0, n)).astype("<f2")
            out[:, 2:4] = m.view(np.uint8).reshape(n, 2)
        if patch is not None:
            patch(out.reshape(-1, row_bytes), start)
        yield out.reshape(-1)


_Field = tuple[str, object, GGUFValueType, GGUFValueType | None]


def _tokenizer_fields(source: str) -> tuple[_Field, ...]:
    """Every ``tokenizer.*`` key of the source GGUF as (key, value, type, array element type)."""
    from strata.common.catalog import resolve_model

    path = resolve_model(source).path
    st = path.stat()
    return _read_tokenizer_fields(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_tokenizer_fields(path: str, size: int, mtime_ns: int) -> tuple[_Field, ...]:
    # Size and mtime in the key make a changed file read again. Callers must not mutate the
    # returned values.
    from strata.common.gguf_file import open_gguf

    g = open_gguf(path)
    out = []
    for key in g.keys():
        if not key.startswith("tokenizer."):
            continue
        types = g.field_types(key)
        if types[0] == GGUFValueType.ARRAY and len(types) != 2:
            raise StrataError(f"{path}: tokenizer key {key} is an empty array; cannot copy it")
        out.append((key, g.field(key), types[0], types[1] if len(types) == 2 else None))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise StrataError(f"{path}: no tokenizer.ggml.tokens; give a GGUF that has a tokenizer")
    return tuple(out)


@dataclass(frozen=True)
class SyntheticModel:
    """What :func:`write_synthetic` wrote.

    Attributes:
        path: the GGUF file.
        shape: the shape it has.
        ftype: ``Q4_0``, ``Q4_1`` or ``Q8_0``.
        vocab: tokenizer vocabulary size (rows of token_embd and output).
        n_params: weights in the file (elements).
        size_bytes: file size.
        routing: ``uniform``, ``skewed`` or ``random`` (:data:`ROUTING`; ``uniform`` for dense
            shapes).
        seed: the seed it was written with.
    """

    path: Path
    shape: Shape
    ftype: str
    vocab: int
    n_params: int
    size_bytes: int
    routing: str = "uniform"
    seed: int = 0


def write_synthetic(
    path: str | Path,
    shape: Shape,
    *,
    ftype: str = "Q4_0",
    seed: int = 0,
    tokenizer: str = "smollm2-135m",
    logit_std: float = 3.0,
    routing: str = "uniform",
    progress: bool = False,
) -> SyntheticModel:
    """Write a synthetic GGUF (see the module docstring), streaming tensors to disk.

    The file appears at ``path`` only when complete (written to a temporary file of its own
    beside it, then renamed).

    Args:
        path: the GGUF to write (overwritten if it exists).
        shape: from :data:`SHAPES` or :func:`shape_from_args`.
        ftype: GGML type of token_embd and the block matrices: Q4_0, Q4_1 or Q8_0.
        seed: non-negative; the same (shape, ftype, seed, routing, tokenizer) gives the same
            bytes.
        tokenizer: catalog name or GGUF path whose ``tokenizer.*`` keys are copied.
        logit_std: target std of the logits (``output.weight`` std is ``logit_std / sqrt(width)``
            and the head's input is RMS-normalised).
        routing: MoE shapes: ``uniform``, ``skewed`` or ``random`` (module docstring); dense
            shapes take only the default, ``uniform``.
        progress: a tqdm bar on stderr (bytes written).

    Raises:
        StrataError: unknown ftype or routing, negative seed, invalid shape, a routing the shape
            cannot carry (:func:`routing_layout`), missing output folder, a tokenizer source
            without a tokenizer, or a write error (one line).
    """
    if ftype not in FTYPES:
        raise StrataError(
            f"unknown --ftype {ftype!r}: use one of {', '.join(FTYPES)} (the types the executor "
            "loads)"
        )
    if seed < 0:
        raise StrataError(f"--seed {seed} is negative; use 0 or more")
    if not logit_std > 0:
        raise StrataError(f"logit_std {logit_std} must be positive")
    shape.validate()
    layout = routing_layout(shape, routing)
    path = Path(path)
    if not path.parent.is_dir():
        raise StrataError(f"{path.parent}: no such folder for the output file")
    qtype, file_type = FTYPES[ftype]
    tok = _tokenizer_fields(tokenizer)
    vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))
    specs = tensor_specs(shape, qtype, vocab, logit_std=logit_std)

    arch = shape.arch
    w = gguf.GGUFWriter(None, arch)
    w.add_type("model")
    moe = f", {shape.experts_used} of {shape.experts} experts, {routing} routing"
    w.add_name(
        f"Synthetic {shape.name} {ftype} (random weights{moe if shape.experts else ''}, "
        f"seed {seed})"
    )
    w.add_description(
        f"Synthetic model written by Strata's synth.py: real {arch} shapes and quant types, random "
        f"weights, tokenizer copied from {Path(tokenizer).name}. Not a trained model."
    )
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.width)
    w.add_feed_forward_length(shape.dense_ffn or shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    if shape.key_length:
        w.add_key_length(shape.key_length)
        w.add_value_length(shape.key_length)
    w.add_rope_freq_base(shape.rope_freq_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(shape.ffn)
    w.add_file_type(file_type)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(shape.head_dim)
    if shape.experts:  # (dense files stay byte-identical to those of earlier versions)
        w.add_uint32(SEED_KEY, seed)
        w.add_string(ROUTING_KEY, routing)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for s in specs:
        if s.qtype == _T.F32:
            w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes)
        else:  # byte shape in, element shape recorded (gguf's quant_shape_from_byte_shape)
            byte_shape = (*s.shape[:-1], s.nbytes // math.prod(s.shape[:-1]))
            w.add_tensor_info(s.name, byte_shape, np.dtype(np.uint8), s.nbytes, raw_dtype=s.qtype)

    def chunks(s: TensorSpec) -> Iterator[np.ndarray]:
        if layout is None:
            return _chunks(s, seed)
        router = None
        if s.kind == "router":
            router = _designed_router(shape, layout, seed, int(s.name.split(".")[1]))
        return _chunks(s, seed, _design_patch(s, shape, layout), router)

    align = w.data_alignment
    total = sum(s.nbytes for s in specs)
    partial: Path | None = None
    try:
        # A name of its own: two runs writing one model do not write into one file.
        partial = temporary_beside(path)
        # GGUFWriter writes the header, metadata and tensor table (offsets padded to `align`);
        # the data follows in the same order, each tensor starting on an `align` boundary.
        w.write_header_to_file(partial)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        with (
            open(partial, "r+b") as f,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=path.name,
                disable=not progress,
                file=sys.stderr,
            ) as bar,
        ):
            f.seek(0, os.SEEK_END)
            f.write(bytes(-f.tell() % align))
            for s in specs:
                for chunk in chunks(s):
                    f.write(chunk)
                    bar.update(chunk.size)
                f.write(bytes(-s.nbytes % align))
        partial.replace(path)
    except OSError as e:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise StrataError(f"{path}: cannot write the model: {e.strerror or e}") from None
    except BaseException:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise
    n_params = sum(math.prod(s.shape) for s in specs)
    return SyntheticModel(
        path,
        shape,
        ftype,
        vocab,
        n_params,
        path.stat().st_size,
        routing if shape.experts else "uniform",
        seed,
    )
