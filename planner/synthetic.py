"""Synthetic GGUF models: a real architecture's shapes and quant types, random weights.

Models bigger than this machine's memory are not available as real files, yet tier streaming has
to be exercised at their sizes. :func:`write_synthetic` writes a GGUF of architecture ``llama``
with the tensor names, shapes and GGML types llama.cpp's converter produces for a given shape
(Llama-3 8B and 1B, SmolLM2-135M, or a tiny test shape), filled with seeded random weights, and a
real tokenizer copied from another GGUF (SmolLM2's by default, 49152 tokens). llama.cpp loads and
runs these files too, so it stays the oracle for the executor on them.

What is written, for ``ftype`` T (one of Q4_0, Q4_1, Q8_0); shapes in numpy order (rows, cols),
``hd`` the head dim, "std" the target standard deviation of the dequantized weights:

* ``token_embd.weight`` [vocab, width], T, std 1 (an RMSNorm follows, so its scale is free);
* per block ``blk.N.``: ``attn_norm`` and ``ffn_norm`` [width] F32, 1 + N(0, 0.05²);
  ``attn_q`` [width, width], ``attn_k`` and ``attn_v`` [kv_heads * hd, width], ``attn_output``
  [width, width], ``ffn_gate`` and ``ffn_up`` [ffn, width], ``ffn_down`` [width, ffn], all T
  with std 1/sqrt(cols) (the fan-in), so activations keep a unit scale through the block;
* ``output_norm.weight`` [width] F32, 1 + N(0, 0.05²);
* ``output.weight`` [vocab, width], Q8_0, std ``logit_std``/sqrt(width).

The head is untied and Q8_0. llama.cpp's quantizer keeps ``token_embd`` in the file type and
writes ``output.weight`` as Q6_K for Q4_0/Q4_1 files, but the executor cannot load Q6_K yet
(``executor.quant.SUPPORTED_TYPES``), so Q8_0 — what llama.cpp uses for Q8_0 files — stands in.
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
pure function of (shape, ftype, seed, tokenizer) — the same bytes on every run (numpy's
``Generator`` streams are stable across releases barring bug fixes) — and a tensor's
contents do not depend on which other tensors the file has (block 0 of ``--layers 2`` equals
block 0 of the full model). Tensors are generated in chunks of rows and streamed to disk: memory
stays around ``_CHUNK_BYTES`` times a small factor whatever the model size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from tqdm import tqdm

from planner.errors import StrataError

__all__ = [
    "FTYPES",
    "SHAPES",
    "Shape",
    "SyntheticModel",
    "TensorSpec",
    "shape_from_args",
    "tensor_specs",
    "write_synthetic",
]

_T = GGMLQuantizationType

_CHUNK_BYTES = 16 << 20  # generate and write at most ~16 MiB of tensor bytes at a time
_BLOCK = 32  # elements per block of every type written here (Q4_0, Q4_1, Q8_0)


@dataclass(frozen=True)
class Shape:
    """A llama-architecture shape.

    Attributes:
        name: label written into ``general.name`` (a preset's name, ``+key=value`` per override).
        layers: transformer blocks.
        width: embedding length (residual stream width), elements.
        ffn: feed-forward hidden length, elements.
        heads: query heads; head dim = width / heads.
        kv_heads: key/value heads (grouped-query attention).
        context_length: trained context written to the metadata, tokens (plans choose their own).
        rope_freq_base: RoPE theta.
        rms_eps: RMSNorm epsilon.
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

    @property
    def head_dim(self) -> int:
        """Elements per attention head."""
        return self.width // self.heads

    def validate(self) -> None:
        """Check the shape can be written in 32-element blocks and run as a llama model.

        Raises:
            StrataError: one line naming the bad value and what it must be.
        """
        for key in ("layers", "width", "ffn", "heads", "kv_heads"):
            if getattr(self, key) < 1:
                raise StrataError(f"--{key.replace('_', '-')} must be at least 1")
        # Every quantized row runs along `width` or `ffn` in 32-element blocks; K/V have
        # kv_heads * head_dim rows, which need not be a multiple of anything.
        for key, value in (("width", self.width), ("ffn", self.ffn)):
            if value % _BLOCK:
                raise StrataError(
                    f"--{key} {value} is not a multiple of {_BLOCK} (the quant block size)"
                )
        if self.width % self.heads:
            raise StrataError(
                f"--width {self.width} is not a multiple of --heads {self.heads} "
                "(head dim = width / heads)"
            )
        if self.head_dim % 2:
            raise StrataError(f"head dim {self.head_dim} (width / heads) must be even for RoPE")
        if self.heads % self.kv_heads:
            raise StrataError(
                f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads} "
                "(grouped-query attention shares each KV head among a whole number of heads)"
            )


#: Preset shapes (from the models' config.json / GGUF metadata).
SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape("llama3-8b", 32, 4096, 14336, 32, 8, 8192, 500000.0),
    "llama3-1b": Shape("llama3-1b", 16, 2048, 8192, 32, 8, 131072, 500000.0),
    "smollm2-135m": Shape("smollm2-135m", 30, 576, 1536, 9, 3, 8192, 100000.0),
    "tiny": Shape("tiny", 2, 64, 128, 4, 2, 2048, 10000.0),
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
) -> Shape:
    """A preset shape with the given overrides, validated.

    Raises:
        StrataError: unknown preset or an invalid override (one line).
    """
    base = SHAPES.get(shape)
    if base is None:
        raise StrataError(f"unknown shape {shape!r}: use one of {', '.join(SHAPES)}")
    given = dict(layers=layers, width=width, ffn=ffn, heads=heads, kv_heads=kv_heads)
    overrides = {k: v for k, v in given.items() if v is not None and v != getattr(base, k)}
    name = base.name + "".join(f"+{k}={v}" for k, v in overrides.items())
    s = dataclasses.replace(base, name=name, **overrides)
    s.validate()
    return s


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write.

    Attributes:
        name: GGUF tensor name.
        shape: numpy order (``(rows, cols)`` for matrices, the GGUF shape reversed).
        qtype: GGML type.
        std: target standard deviation of the weights (matrices) or of ``w - 1`` (norms).
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    std: float

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the file (before alignment padding)."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def tensor_specs(
    shape: Shape, qtype: GGMLQuantizationType, vocab: int, *, logit_std: float = 3.0
) -> list[TensorSpec]:
    """Every tensor of a llama model of ``shape``, in file order (embedding, blocks, head)."""
    d, kv = shape.width, shape.kv_heads * shape.head_dim
    norm_std = 0.05

    def mat(name: str, rows: int, cols: int, t: GGMLQuantizationType = qtype) -> TensorSpec:
        return TensorSpec(name, (rows, cols), t, 1 / math.sqrt(cols))

    specs = [TensorSpec("token_embd.weight", (vocab, d), qtype, 1.0)]
    for i in range(shape.layers):
        p = f"blk.{i}."
        specs += [
            TensorSpec(p + "attn_norm.weight", (d,), _T.F32, norm_std),
            mat(p + "attn_q.weight", d, d),
            mat(p + "attn_k.weight", kv, d),
            mat(p + "attn_v.weight", kv, d),
            mat(p + "attn_output.weight", d, d),
            TensorSpec(p + "ffn_norm.weight", (d,), _T.F32, norm_std),
            mat(p + "ffn_gate.weight", shape.ffn, d),
            mat(p + "ffn_up.weight", shape.ffn, d),
            mat(p + "ffn_down.weight", d, shape.ffn),
        ]
    specs.append(TensorSpec("output_norm.weight", (d,), _T.F32, norm_std))
    specs.append(TensorSpec("output.weight", (vocab, d), _T.Q8_0, logit_std / math.sqrt(d)))
    return specs


def _chunks(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes (uint8), a chunk of whole rows at a time."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.qtype == _T.F32:
        yield rng.normal(1.0, spec.std, spec.shape).astype("<f4").view(np.uint8)
        return
    rows, cols = spec.shape
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
        yield out.reshape(-1)


_Field = tuple[str, object, GGUFValueType, GGUFValueType | None]


def _tokenizer_fields(source: str) -> tuple[_Field, ...]:
    """Every ``tokenizer.*`` key of the source GGUF as (key, value, type, array element type)."""
    from planner.catalog import resolve_model

    path = resolve_model(source).path
    st = path.stat()
    return _read_tokenizer_fields(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_tokenizer_fields(path: str, size: int, mtime_ns: int) -> tuple[_Field, ...]:
    # Parsing 49152 tokens and their merges with GGUFReader takes about 1.5 s; size and mtime in
    # the key make a changed file read again. Callers must not mutate the returned values.
    from planner.gguf_file import open_gguf

    g = open_gguf(path)
    out = []
    for key, f in g.reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        types = list(f.types)
        if len(types) > 2 or (types[0] == GGUFValueType.ARRAY and len(types) != 2):
            raise StrataError(f"{path}: tokenizer key {key} is a nested array; cannot copy it")
        out.append((key, f.contents(), types[0], types[1] if len(types) == 2 else None))
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
    """

    path: Path
    shape: Shape
    ftype: str
    vocab: int
    n_params: int
    size_bytes: int


def write_synthetic(
    path: str | Path,
    shape: Shape,
    *,
    ftype: str = "Q4_0",
    seed: int = 0,
    tokenizer: str = "smollm2-135m",
    logit_std: float = 3.0,
    progress: bool = False,
) -> SyntheticModel:
    """Write a synthetic llama GGUF (see the module docstring), streaming tensors to disk.

    The file appears at ``path`` only when complete (written to ``path.partial``, then renamed).

    Args:
        path: the GGUF to write (overwritten if it exists).
        shape: from :data:`SHAPES` or :func:`shape_from_args`.
        ftype: GGML type of token_embd and the block matrices: Q4_0, Q4_1 or Q8_0.
        seed: non-negative; the same (shape, ftype, seed, tokenizer) gives the same bytes.
        tokenizer: catalog name or GGUF path whose ``tokenizer.*`` keys are copied.
        logit_std: target std of the logits (``output.weight`` std is ``logit_std / sqrt(width)``
            and the head's input is RMS-normalised).
        progress: a tqdm bar on stderr (bytes written).

    Raises:
        StrataError: unknown ftype, negative seed, invalid shape, missing output folder, a
            tokenizer source without a tokenizer, or a write error (one line).
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
    path = Path(path)
    if not path.parent.is_dir():
        raise StrataError(f"{path.parent}: no such folder for the output file")
    qtype, file_type = FTYPES[ftype]
    tok = _tokenizer_fields(tokenizer)
    vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))
    specs = tensor_specs(shape, qtype, vocab, logit_std=logit_std)

    w = gguf.GGUFWriter(None, "llama")
    w.add_type("model")
    w.add_name(f"Synthetic {shape.name} {ftype} (random weights, seed {seed})")
    w.add_description(
        "Synthetic model written by Strata's synth.py: real llama shapes and quant types, random "
        f"weights, tokenizer copied from {Path(tokenizer).name}. Not a trained model."
    )
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.width)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_freq_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(file_type)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(shape.head_dim)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for s in specs:
        if s.qtype == _T.F32:
            w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes)
        else:  # byte shape in, element shape recorded (gguf's quant_shape_from_byte_shape)
            byte_shape = (*s.shape[:-1], s.nbytes // math.prod(s.shape[:-1]))
            w.add_tensor_info(s.name, byte_shape, np.dtype(np.uint8), s.nbytes, raw_dtype=s.qtype)

    partial = path.with_name(path.name + ".partial")
    align = w.data_alignment
    total = sum(s.nbytes for s in specs)
    try:
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
                for chunk in _chunks(s, seed):
                    f.write(chunk)
                    bar.update(chunk.size)
                f.write(bytes(-s.nbytes % align))
        partial.replace(path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise StrataError(f"{path}: cannot write the model: {e.strerror or e}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    n_params = sum(math.prod(s.shape) for s in specs)
    return SyntheticModel(path, shape, ftype, vocab, n_params, path.stat().st_size)
