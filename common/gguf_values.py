"""Metadata values of a GGUF file, typed and bounded before use.

A GGUF header is untrusted input: any key may hold any value type (an array, a string, NaN,
infinity) and any magnitude. Every hyperparameter Strata reads goes through ``read_int``,
``read_float``, ``read_bool`` or ``read_str`` here, which check the GGUF type class, finiteness and
a plausible range, and raise a one-line ``GGUFError`` naming the key, the value and the fix. The
range limits below are far above every released model (each says why), small enough that nothing
built from them (per-block lists, per-expert units, RoPE tables) can take unbounded time or
memory.

Per-layer arrays (a value per block, as some converters write ``head_count_kv``): read as
llama.cpp's loader reads them (``get_key_or_arr``), an array must hold one value per block
(``{arch}.block_count`` of them); one whose values are all equal reads as that value. Differing
values are refused, naming the key and each block's value: for the architectures Strata runs,
llama.cpp sizes every block's tensors and graph from block 0's ``head_count``,
``head_count_kv`` and ``feed_forward_length`` (``n_embd_k_gqa()``, ``n_ff()`` without a layer),
so it refuses such a file too, at its first block of another width.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
from strata.common.errors import GGUFError

_VT = gguf.GGUFValueType
_INTS = frozenset(
    {_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32, _VT.UINT64, _VT.INT64}
)
_FLOATS = frozenset({_VT.FLOAT32, _VT.FLOAT64})

MAX_BLOCKS = 4096
"""``block_count``: released models have at most a few hundred blocks (Llama 3.1 405B: 126);
per-block lists (the sliding-window layers, the plan's units) are built from it."""

MAX_EMBEDDING = 2**20
"""``embedding_length``: released models are at most 16,384 wide; 64x that."""

MAX_FFN = 2**22
"""``feed_forward_length`` and the expert FFN widths: released models at most 53,248 (405B)."""

MAX_HEADS = 2**14
"""``attention.head_count`` and ``head_count_kv``: released models have at most 128 heads."""

MAX_HEAD_DIM = 2**12
"""``attention.key_length`` / ``value_length``: released models use at most 576 (DeepSeek MLA)."""

MAX_EXPERTS = 2**16
"""``expert_count``: released models have at most 384 experts per block (Kimi K2)."""

MAX_EXPERT_UNITS = 2**15
"""``expert_count * block_count``: one placement unit per expert and block (Kimi K2: 384 x 61 =
23,424); the planner's ILP has a variable per unit and tier, so this bounds its size."""

MAX_CONTEXT = 2**24
"""``context_length`` and ``attention.sliding_window``, tokens: released models train on at most
10M tokens (Llama 4 Scout)."""

MAX_VOCAB = 2**24
"""``vocab_size``: released vocabularies have at most 262,144 tokens (Gemma 3)."""

MAX_ROPE_BASE = 1e12
"""``rope.freq_base`` (and ``_swa``): released models use at most 10^8; the base must also be
finite and positive or every rotation angle is NaN."""

MAX_ROPE_FACTOR = 1024.0
"""``rope.scaling.factor`` / ``rope.scale_linear``: released models stretch positions at most 40x
(DeepSeek V3's YaRN)."""

MAX_NORM_EPS = 1.0
"""``attention.layer_norm_rms_epsilon``: released models use 1e-6 to 1e-5; an epsilon near 1
already swamps the activations' variance."""

MAX_SCALE = 1e6
"""Multiplicative model constants (``final_logit_softcapping``, ``expert_weights_scale``):
released models use at most 50."""

_MISSING: Any = object()


def shown(text: str, limit: int = 80) -> str:
    """``text`` fit for a one-line message: control characters (terminal escapes, newlines) and
    other non-printable characters escaped as ``repr`` does, quoted, cut to ``limit``
    characters with ``...`` (a name from a file cannot clear the screen or forge a line)."""
    cut = text if len(text) <= limit else text[:limit]
    out = repr(cut)
    return out[:-1] + "..." + out[-1] if cut is not text else out


def _fail(g: Any, key: str, what: str, fix: str) -> GGUFError:
    return GGUFError(f"{g.path}: metadata {shown(key)} {what}; {fix}")


def _describe_value(g: Any, key: str) -> str:
    """The value of ``key`` for a message: type and a short form (arrays by length)."""
    types = g.field_types(key)
    if types[0] == _VT.ARRAY:
        return f"an array of {g.field_count(key)} {types[1].name if len(types) > 1 else 'values'}"
    if types[0] == _VT.STRING:
        try:
            return f"the string {shown(g.field(key), 40)}"
        except GGUFError:
            return "a string that is not UTF-8"
    return f"{types[0].name} {g.field(key)!r}"


def _scalar(g: Any, key: str, allowed: frozenset, kind: str, per_layer: bool) -> Any:
    """The raw value of ``key`` if its type is in ``allowed``, or a per-layer array of such
    values all equal (``per_layer``); None when absent.

    Raises:
        GGUFError: another type, an array longer than ``MAX_BLOCKS``, of another length than
            ``{arch}.block_count`` or of differing values (names each block's value).
    """
    types = g.field_types(key)
    if types is None:
        return None
    fix = "re-convert the model with a current llama.cpp (convert_hf_to_gguf.py)"
    if types[0] in allowed:
        return g.field(key)
    if per_layer and types[0] == _VT.ARRAY and len(types) == 2 and types[1] in allowed:
        n = g.field_count(key)
        if n > MAX_BLOCKS:
            raise _fail(
                g, key, f"is an array of {n} values (at most {MAX_BLOCKS}, one per block)", fix
            )
        blocks_key = f"{g.architecture}.block_count"
        blocks = g.field(blocks_key)
        if isinstance(blocks, float) and blocks.is_integer():  # read_int takes integral floats
            blocks = int(blocks)
        if isinstance(blocks, int) and not isinstance(blocks, bool) and n != blocks:
            raise _fail(
                g,
                key,
                f"is an array of {n} values but the model has {blocks} blocks ({blocks_key}); "
                "llama.cpp refuses it too",
                fix,
            )
        values = g.field(key)
        if all(v == values[0] for v in values):
            return values[0]
        shown_values = ", ".join(f"block {i}: {v}" for i, v in enumerate(values[:8]))
        raise _fail(
            g,
            key,
            f"has different values per block ({shown_values}{', ...' if n > 8 else ''})",
            "Strata, like llama.cpp for the architectures Strata runs, takes one value of this "
            "key for all blocks; this model is not supported",
        )
    raise _fail(g, key, f"is {_describe_value(g, key)}, not {kind}", fix)


def read_int(
    g: Any, key: str, lo: int, hi: int, default: Any = _MISSING, *, per_layer: bool = False
) -> Any:
    """Integer metadata ``key`` of ``g`` (a ``GGUFFile``) within [lo, hi].

    Integral floats are accepted (some converters write counts as floats); booleans are not.

    Args:
        lo, hi: plausible range, inclusive (one of the ``MAX_*`` limits above).
        default: returned when the key is absent; without it a missing key is an error.
        per_layer: accept an array of equal values (one per block).

    Raises:
        GGUFError: missing (no default), not an integer, not finite, out of range.
    """
    v = _scalar(g, key, _INTS | _FLOATS, "an integer", per_layer)
    if v is None:
        if default is _MISSING:
            raise _fail(g, key, "is missing", "this GGUF is not a model Strata can describe")
        return default
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise _fail(g, key, f"is {v!r}, not an integer", "re-convert the model")
        v = int(v)
    if not lo <= v <= hi:
        raise _fail(
            g,
            key,
            f"is {v}, outside the plausible range {lo} to {hi}",
            "the file is damaged or not a model Strata supports; re-download or re-convert it",
        )
    return v


def read_float(g: Any, key: str, lo: float, hi: float, default: Any = _MISSING) -> Any:
    """Finite numeric metadata ``key`` within [lo, hi] (integers accepted), as a float.

    Raises:
        GGUFError: missing (no default), not a number, NaN or infinite, out of range.
    """
    v = _scalar(g, key, _INTS | _FLOATS, "a number", True)
    if v is None:
        if default is _MISSING:
            raise _fail(g, key, "is missing", "this GGUF is not a model Strata can describe")
        return default
    v = float(v)
    if not math.isfinite(v):
        raise _fail(g, key, f"is {v!r}", "a model's constants must be finite; re-convert it")
    if not lo <= v <= hi:
        raise _fail(
            g,
            key,
            f"is {v!r}, outside the plausible range {lo!r} to {hi!r}",
            "the file is damaged or not a model Strata supports; re-download or re-convert it",
        )
    return v


def read_bool(g: Any, key: str, default: Any = None) -> Any:
    """Boolean metadata ``key`` (BOOL, or an integer 0 or 1); ``default`` when absent.

    Raises:
        GGUFError: another type or integer.
    """
    v = _scalar(g, key, _INTS | {_VT.BOOL}, "a boolean", False)
    if v is None:
        return default
    if v not in (0, 1):
        raise _fail(g, key, f"is {v!r}, not a boolean", "re-convert the model")
    return bool(v)


def read_str(g: Any, key: str, default: Any = None, max_chars: int = 256) -> Any:
    """String metadata ``key`` of at most ``max_chars`` characters; ``default`` when absent.

    Raises:
        GGUFError: another type, not UTF-8, too long.
    """
    v = _scalar(g, key, frozenset({_VT.STRING}), "a string", False)
    if v is None:
        return default
    if len(v) > max_chars:
        raise _fail(
            g,
            key,
            f"is a string of {len(v)} characters (at most {max_chars})",
            "re-convert the model",
        )
    return v
