"""Text <-> token ids for a GGUF model, built from the file's own ``tokenizer.ggml.*`` metadata.

The goal is to produce exactly the ids llama.cpp produces for the same file, so the rules here
follow llama.cpp's ``src/llama-vocab.cpp``: the pre-tokenizer regexes per ``tokenizer.ggml.pre``,
the defaults of ``add_bos_token`` and ``add_space_prefix``, the splitting out of special tokens
before the model runs (``tokenizer_st_partition``), and the end-of-generation (EOG) token set.

The model itself runs in a HuggingFace ``tokenizers.Tokenizer`` built in memory from the GGUF vocab
(no ``transformers``, no tokenizer.json). Special tokens are split out here, in Python, because
llama.cpp matches them in its own order (longest text first) and only when asked to
(``parse_special``); the HF tokenizer only ever sees plain text.

Supported ``tokenizer.ggml.model`` values: ``gpt2`` (byte-level BPE, ``_build_gpt2``) and ``llama``
(SentencePiece, e.g. Gemma, ``_build_spm``); other models raise ``TokenizerError``. A new model
plugs in as one more entry of ``_BACKENDS``.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
from gguf import GGUFValueType, TokenType
from strata.common.errors import StrataError
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

if TYPE_CHECKING:
    from strata.common.gguf_file import GGUFFile

log = logging.getLogger(__name__)

_K = gguf.Keys.Tokenizer


class TokenizerError(StrataError, ValueError):
    """The GGUF's tokenizer metadata is missing, malformed or of a kind not supported yet."""


# --------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, per tokenizer.ggml.pre.
#
# The strings are llama.cpp's (llm_tokenizer_bpe's constructor in src/llama-vocab.cpp), kept
# verbatim so they can be diffed against it; where llama.cpp rewrote a tokenizer.json regex for
# std::regex (e.g. "(?i:'s|...)" -> "'[sS]|..."), we use its rewrite, since matching llama.cpp's
# ids is the point. Each regex of a list splits every piece produced by the previous one, keeping
# both the matches and the text between them (llama.cpp's unicode_regex_split).
# --------------------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# llama.cpp runs regexes without \p{..} on text whose non-ASCII whitespace became "\v", so their
# literal ranges never match whitespace, though some span it (U+0800-U+4E00 holds U+2000-U+200A and
# U+3000). "&&[^\s]" says the same to Oniguruma, here and in deepseek-llm's punctuation class.
_CJK = r"[一-龥ࠀ-一가-퟿&&[^\s]]+"


def _char_class(*ranges: tuple[int, ...]) -> str:
    """A regex character class from code point ranges ((first, last) or (single,))."""
    return "[" + "".join("-".join(chr(c) for c in r) for r in ranges) + "]"


# llama.cpp's deepseek-llm letter class, written as code points: several of its characters
# (U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126, U+212A) are canonically equivalent to others, and
# editors silently normalise them, which changes or even reverses the ranges.
_DEEPSEEK_LETTERS = _char_class(
    (0x41, 0x5A),
    (0x61, 0x7A),
    (0xB5,),
    (0xC0, 0xD6),
    (0xD8, 0xF6),
    (0xF8, 0x1BA),
    (0x1BC, 0x1BF),
    (0x1C4, 0x293),
    (0x295, 0x2AF),
    (0x370, 0x373),
    (0x376, 0x377),
    (0x37B, 0x37D),
    (0x37F,),
    (0x386,),
    (0x388, 0x38A),
    (0x38C,),
    (0x38E, 0x3A1),
    (0x3A3, 0x3F5),
    (0x3F7, 0x481),
    (0x48A, 0x52F),
    (0x531, 0x556),
    (0x10A0, 0x10C5),
    (0x13A0, 0x13F5),
    (0x13F8, 0x13FD),
    (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B),
    (0x1D6B, 0x1D77),
    (0x1D79, 0x1D9A),
    (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45),
    (0x1F48, 0x1F4D),
    (0x1F50, 0x1F57),
    (0x1F59,),
    (0x1F5B,),
    (0x1F5D,),
    (0x1F5F, 0x1F7D),
    (0x1F80, 0x1FB4),
    (0x1FB6, 0x1FBC),
    (0x1FBE,),
    (0x1FC2, 0x1FC4),
    (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3),
    (0x1FD6, 0x1FDB),
    (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4),
    (0x1FF6, 0x1FFC),
    (0x2102,),
    (0x2107,),
    (0x210A, 0x2113),
    (0x2115,),
    (0x2119, 0x211D),
    (0x2124,),
    (0x2126,),
    (0x2128,),
    (0x212A, 0x212D),
    (0x212F, 0x2134),
    (0x2139,),
    (0x213C, 0x213F),
    (0x2145, 0x2149),
    (0x214E,),
    (0x2183, 0x2184),
    (0x2C00, 0x2C7B),
    (0x2C7E, 0x2CE4),
    (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3),
    (0xA640, 0xA66D),
    (0xA680, 0xA69B),
    (0xA722, 0xA76F),
    (0xA771, 0xA787),
    (0xA78B, 0xA78E),
    (0xAB70, 0xABBF),
    (0xFB00, 0xFB06),
    (0xFB13, 0xFB17),
    (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A),
    (0x10400, 0x1044F),
    (0x104B0, 0x104D3),
    (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2),
    (0x10CC0, 0x10CF2),
    (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)

_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?" + _DEEPSEEK_LETTERS + "+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。&&[^\s]]+",
    r"\s+$",
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp pre-tokenizes one family of ``tokenizer.ggml.pre`` values.

    ``add_bos`` is llama.cpp's default for ``tokenizer.ggml.add_bos_token`` when the key is absent;
    ``ignore_merges`` emits a whole pre-token directly when it is in the vocab (llama3 and tekken).
    """

    regexes: tuple[str, ...]
    add_bos: bool = False
    ignore_merges: bool = False


_PRE_TOKENIZER_GROUPS: tuple[tuple[tuple[str, ...], _PreTokenizer], ...] = (
    (("default",), _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _PreTokenizer((_LLAMA3,), add_bos=True, ignore_merges=True),
    ),
    (("dbrx", "smaug-bpe"), _PreTokenizer((_LLAMA3,))),
    (("deepseek-llm",), _PreTokenizer(_DEEPSEEK_LLM)),
    (("deepseek-coder",), _PreTokenizer(_DEEPSEEK_CODER)),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _PreTokenizer(_DEEPSEEK3)),
    (("falcon",), _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        _PreTokenizer((_GPT2,)),
    ),
    (
        (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        _PreTokenizer((r"\p{N}", _GPT2)),
    ),
    (
        (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        _PreTokenizer((_QWEN2,)),
    ),
    (("qwen35",), _PreTokenizer((_QWEN35,))),
    (("poro-chat", "bloom", "gpt3-finnish"), _PreTokenizer((_BLOOM,))),
    (("viking",), _PreTokenizer((_BLOOM, r"\p{N}"))),
    (("tekken",), _PreTokenizer((_TEKKEN,), add_bos=True, ignore_merges=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _PreTokenizer((_GPT4O,))),
    (("seed-coder",), _PreTokenizer((_SEED_CODER,))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), _PreTokenizer((_BAILINGMOE,))),
)
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    name: spec for names, spec in _PRE_TOKENIZER_GROUPS for name in names
}


# --------------------------------------------------------------------------------------------
# Special-token rules (llama_vocab::impl::load). llama.cpp finds some roles by token text when the
# GGUF has no id for them, and forces every token found that way to CONTROL.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Role:
    """A special-token role: its GGUF id keys (a later key wins) and the texts that identify it."""

    keys: tuple[str, ...]
    texts: tuple[str, ...]
    ends_generation: bool


_ROLES: dict[str, _Role] = {
    "eot": _Role(
        (_K.EOT_ID,),
        (
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ),
        ends_generation=True,
    ),
    "eom": _Role((_K.EOM_ID,), ("<|eom_id|>",), ends_generation=True),
    "fim_pre": _Role(
        (_K.FIM_PRE_ID, _K.PREFIX_ID),
        (
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ),
        ends_generation=False,
    ),
    "fim_suf": _Role(
        (_K.FIM_SUF_ID, _K.SUFFIX_ID),
        (
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ),
        ends_generation=False,
    ),
    "fim_mid": _Role(
        (_K.FIM_MID_ID, _K.MIDDLE_ID),
        (
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ),
        ends_generation=False,
    ),
    "fim_pad": _Role(
        (_K.FIM_PAD_ID,),
        ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
        ends_generation=True,
    ),
    "fim_rep": _Role(
        (_K.FIM_REP_ID,),
        ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
        ends_generation=True,
    ),
    "fim_sep": _Role((_K.FIM_SEP_ID,), ("<|file_sep|>",), ends_generation=True),
}

# Tokens that end generation whatever their role (llama.cpp matches these by text).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
# gpt-oss (harmony) markers llama.cpp always renders as text: forced to USER_DEFINED.
_ALWAYS_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# Token types that are "special": skipped by decode(skip_special=True) and, in text, recognised
# only with parse_special=True (llama.cpp: LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_UNKNOWN).
_SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.UNKNOWN})
# Token types split out of the text before BPE (llama.cpp's cache_special_tokens).
_ADDED_TYPES = _SPECIAL_TYPES | {TokenType.USER_DEFINED}


# --------------------------------------------------------------------------------------------
# Reading the metadata
# --------------------------------------------------------------------------------------------


@dataclass
class _Vocab:
    """The tokenizer metadata of one GGUF, read once.

    ``types`` is a mutable copy: llama.cpp's load-time rules re-type a few tokens.
    """

    meta: GGUFFile
    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    token_to_id: dict[str, int]

    def value(self, key: str) -> object:
        """A metadata value as a Python object, or None when the key is absent."""
        return self.meta.field(key)

    def token_id(self, key: str) -> int | None:
        """The id stored under ``key`` when present and inside the vocab, else None."""
        value = self.value(key)
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(self.tokens):
            log.warning("ignoring %s = %r: not a token id of this vocab", key, value)
            return None
        return value


def _read_vocab(meta: GGUFFile) -> _Vocab:
    """Read and check the vocabulary fields shared by every tokenizer model."""
    model = _string_field(meta, _K.MODEL)
    if model is None:
        raise TokenizerError(f"the GGUF has no {_K.MODEL}; it carries no tokenizer")
    listed = _typed_array(meta, _K.LIST, GGUFValueType.STRING)
    if listed is None:
        raise TokenizerError(f"the GGUF has no {_K.LIST} (the vocabulary)")
    tokens = _renamed_empty_tokens(listed)
    types = _typed_array(meta, _K.TOKEN_TYPE, GGUFValueType.INT32)
    if types is None:
        types = [TokenType.NORMAL] * len(tokens)
    elif len(types) < len(tokens):
        raise TokenizerError(f"{_K.TOKEN_TYPE} has {len(types)} entries for {len(tokens)} tokens")
    return _Vocab(
        meta=meta,
        model=model,
        pre=_string_field(meta, _K.PRE),
        tokens=tokens,
        types=types[: len(tokens)],
        token_to_id=_index_tokens(tokens),
    )


def _string_field(meta: GGUFFile, key: str) -> str | None:
    value = meta.field(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise TokenizerError(f"{key} is not a string in the GGUF metadata")
    return value


def _typed_array(meta: GGUFFile, key: str, *items: GGUFValueType) -> list | None:
    """The array under ``key`` (None when absent), checked to hold values of one of ``items``."""
    types = meta.field_types(key)
    if types is None:
        return None
    if types[0] != GGUFValueType.ARRAY or types[-1] not in items:
        kinds = " or ".join(item.name for item in items)
        raise TokenizerError(f"{key} is not an array of {kinds} in the GGUF metadata")
    return meta.field(key)


def _renamed_empty_tokens(tokens: list[str]) -> list[str]:
    # llama.cpp renames empty tokens so that every text maps back to exactly one id.
    return [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]


def _index_tokens(tokens: list[str]) -> dict[str, int]:
    token_to_id = {text: i for i, text in enumerate(tokens)}
    if len(token_to_id) != len(tokens):
        seen: dict[str, int] = {}
        for i, text in enumerate(tokens):
            if text in seen:
                raise TokenizerError(
                    f"duplicate token in the vocabulary: {text!r} has ids {seen[text]} and {i}"
                )
            seen[text] = i
    return token_to_id


# --------------------------------------------------------------------------------------------
# Tokenizer models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Backend:
    """What one tokenizer model contributes.

    Attributes:
        hf: encodes plain text (no special-token handling) to ids.
        normal_bytes: the bytes a NORMAL token's text stands for.
        add_bos: llama.cpp's default for ``add_bos_token`` when the key is absent.
        default_bos, default_eos: llama.cpp's default ids when the GGUF names none.
        chunkable: long texts may be cut at ``_safe_chunks`` boundaries and encoded chunk by
            chunk (see ``_ChunkCache``).
    """

    hf: Tokenizer
    normal_bytes: Callable[[str], bytes]
    add_bos: bool
    default_bos: int | None
    default_eos: int | None
    chunkable: bool = False


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte value."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_OF_CHAR = _byte_level_alphabet()
# str.translate table sending each alphabet character to the latin-1 character of its byte.
_TO_LATIN1 = {ord(char): byte for char, byte in _BYTE_OF_CHAR.items()}


def _byte_level_bytes(text: str) -> bytes:
    """The bytes a byte-level BPE token stands for (its characters are GPT-2 alphabet letters)."""
    try:
        return text.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        # A character outside the alphabet (malformed vocab): keep it as its own UTF-8.
        return b"".join(
            bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode() for c in text
        )


def _parse_merges(vocab: _Vocab) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, in rank order.

    Merges naming a piece outside the vocab are dropped: the HF BPE model refuses them, and in
    llama.cpp such a merge only yields a symbol that falls back to single bytes anyway.
    """
    raw = _typed_array(vocab.meta, _K.MERGES, GGUFValueType.STRING)
    if raw is None:
        raise TokenizerError(f"the GGUF has no {_K.MERGES}; a BPE tokenizer needs them")
    known = vocab.token_to_id
    pairs: list[tuple[str, str]] = []
    for merge in raw:
        cut = merge.find(" ", 1)  # from 1: the first piece may itself be a space
        left, right = merge[:cut], merge[cut + 1 :]
        if cut > 0 and left in known and right in known and left + right in known:
            pairs.append((left, right))
    if len(pairs) != len(raw):
        log.warning(
            "dropped %d of %d BPE merges naming tokens outside the vocabulary",
            len(raw) - len(pairs),
            len(raw),
        )
    return pairs


def _pre_tokenizer_spec(pre: str | None) -> _PreTokenizer:
    if pre is None:
        log.warning("the GGUF has no %s; using llama.cpp's 'default' (quality may suffer)", _K.PRE)
        return _PRE_TOKENIZERS["default"]
    spec = _PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise TokenizerError(
            f"unknown pre-tokenizer {pre!r} ({_K.PRE}) for tokenizer model 'gpt2'; "
            f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    return spec


def _build_gpt2(vocab: _Vocab, hf: Tokenizer | None) -> _Backend:
    """Byte-level BPE (``tokenizer.ggml.model == "gpt2"``); ``hf``: the one built before for
    this metadata (``_cached_hf``), else None to build it."""
    spec = _pre_tokenizer_spec(vocab.pre)
    if hf is None:
        bpe = models.BPE(
            vocab=vocab.token_to_id, merges=_parse_merges(vocab), ignore_merges=spec.ignore_merges
        )
        hf = Tokenizer(bpe)
        try:
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        except Exception as e:  # tokenizers raises a bare Exception for a bad regex
            raise TokenizerError(f"pre-tokenizer {vocab.pre!r}: regex rejected: {e}") from e
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        hf.decoder = decoders.ByteLevel()
    # 11 and 11: llama.cpp's BOS and EOS for a BPE vocab whose GGUF names none.
    return _Backend(
        hf=hf,
        normal_bytes=_byte_level_bytes,
        add_bos=spec.add_bos,
        default_bos=11,
        default_eos=11,
        chunkable=True,
    )


def _spm_merges(vocab: _Vocab) -> list[tuple[str, str]]:
    """SentencePiece's merge rule as BPE merges: each split of a token into two tokens, ranked
    by the token's score, highest first (then by token id).

    llama.cpp (``llm_tokenizer_spm_session::tokenize``) starts from the text's characters and
    repeatedly merges the adjacent pair whose concatenation is a token (of any type) with the
    highest score, the leftmost pair among equal scores. A HF BPE merges the adjacent pair of
    lowest rank, the leftmost among equal ranks, and only pairs that are merges: given every
    split, it makes the same choices. They could differ only when pairs making two different
    tokens of exactly equal score compete (llama.cpp takes the leftmost, the BPE the lower
    rank); in Gemma's vocabulary every normal token has a score of its own. Scores are
    ``tokenizer.ggml.scores`` (float32 or int32), 0 when absent (``llama_vocab::impl::load``).
    """
    tokens = vocab.tokens
    scores = _typed_array(vocab.meta, _K.SCORES, GGUFValueType.FLOAT32, GGUFValueType.INT32)
    if scores is None:
        scores = [0.0] * len(tokens)
    elif len(scores) < len(tokens):
        raise TokenizerError(f"{_K.SCORES} has {len(scores)} entries for {len(tokens)} tokens")
    known = vocab.token_to_id
    ranked = [
        (-scores[i], i, text[:cut], text[cut:])
        for i, text in enumerate(tokens)
        for cut in range(1, len(text))
        if text[:cut] in known and text[cut:] in known
    ]
    ranked.sort(key=lambda merge: merge[:2])
    return [(left, right) for _, _, left, right in ranked]


def _unescape_spaces(text: str) -> bytes:
    """The bytes a SentencePiece token stands for: "▁" is a space (llama_unescape_whitespace)."""
    return text.replace("▁", " ").encode()


def _build_spm(vocab: _Vocab, hf: Tokenizer | None) -> _Backend:
    """SentencePiece (``tokenizer.ggml.model == "llama"``: Llama 1/2, Gemma, ...).

    As llama.cpp's ``llama_vocab::impl::tokenize`` (``LLAMA_VOCAB_TYPE_SPM``) does to each piece of
    text between special tokens: prepend a space when ``tokenizer.ggml.add_space_prefix`` (default
    true; every such piece is the first or follows a special token), write spaces as "▁"
    (``llama_escape_whitespace``), then merge by score (``_spm_merges``). A character left on its
    own that is not a token becomes the ``<0xXX>`` tokens of its UTF-8 bytes (``resegment``,
    ``byte_to_token``): the BPE's byte fallback. This assumes, as SentencePiece vocabularies
    guarantee, that every character of a token is itself a token (llama.cpp could otherwise merge
    an out-of-vocab character; Gemma's only such character is the space, which never reaches the
    model). BOS is added by default, BOS and EOS default to ids 1 and 2 (``load``).
    """
    if hf is None:
        bpe = models.BPE(vocab=vocab.token_to_id, merges=_spm_merges(vocab), byte_fallback=True)
        hf = Tokenizer(bpe)
        add_prefix = vocab.value(_K.ADD_PREFIX)
        prefix = [normalizers.Prepend("▁")] if add_prefix is None or add_prefix else []
        hf.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
        hf.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    return _Backend(
        hf=hf, normal_bytes=_unescape_spaces, add_bos=True, default_bos=1, default_eos=2
    )


_BACKENDS: dict[str, Callable[[_Vocab, Tokenizer | None], _Backend]] = {
    "gpt2": _build_gpt2,
    "llama": _build_spm,
}
_NOT_YET: dict[str, str] = {
    "bert": "WordPiece",
    "t5": "Unigram",
    "rwkv": "RWKV",
    "plamo2": "PLaMo-2",
    "gemma4": "Gemma-4 BPE",
    "hybriddna": "hybrid DNA",
    "whitespace": "whitespace BPE",
}


def _backend_for(vocab: _Vocab, header_sha256: str | None = None) -> _Backend:
    """The tokenizer model's backend; its HF tokenizer read from the cache when one was built
    before for the same metadata (``header_sha256``, None: no cache), else built and cached."""
    build = _BACKENDS.get(vocab.model)
    if build is not None:
        if len(vocab.tokens) < HF_CACHE_MIN_TOKENS:
            header_sha256 = None
        cached = _cached_hf(header_sha256, len(vocab.tokens))
        backend = build(vocab, cached)
        if cached is None and header_sha256 is not None:
            _keep_hf(header_sha256, backend.hf)
        return backend
    if vocab.model in _NOT_YET:
        raise TokenizerError(
            f"tokenizer model {vocab.model!r} ({_NOT_YET[vocab.model]}) is not supported yet"
        )
    raise TokenizerError(
        f"unknown tokenizer model {vocab.model!r} ({_K.MODEL}); supported: {', '.join(_BACKENDS)}"
    )


# --------------------------------------------------------------------------------------------
# The built HF tokenizer, cached
# --------------------------------------------------------------------------------------------

HF_CACHE_MIN_TOKENS = 65_536
"""Smallest vocabulary whose built HF tokenizer is cached: below it, building takes about as long
as reading the built one back, and the files of small test models would only fill the cache;
Gemma-3's 262,144 tokens are read back in about half the time they take to build
(docs/benchmarks.md, "First token")."""


@functools.cache
def _builder_identity() -> str:
    """12 hex digits naming what builds an HF tokenizer from the metadata: this module's source
    and the ``tokenizers`` version. A change to either names other files, so a tokenizer built
    by other code is never read back."""
    import tokenizers

    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(tokenizers.__version__.encode())
    return h.hexdigest()[:12]


def _hf_cache_path(header_sha256: str) -> Path:
    """``<cache>/tokenizers/<header sha256>.<builder identity>.json``: the HF tokenizer depends
    on the GGUF's metadata and the code that builds it (``_builder_identity``), so the key is
    the sha256 of the GGUF's header (metadata and tensor table), which ``open_gguf`` computes
    anyway (no hashing of the weights), and the builder."""
    from strata.common.catalog import cache_dir

    return cache_dir() / "tokenizers" / f"{header_sha256}.{_builder_identity()}.json"


def _cached_hf(header_sha256: str | None, vocab_size: int) -> Tokenizer | None:
    """The HF tokenizer built before for this header, or None (none, unreadable, damaged or not
    of ``vocab_size`` tokens: it is built again and the file replaced). Reading it back is
    about twice as fast as building it from a large vocabulary (SentencePiece's merges are
    derived token by token)."""
    if header_sha256 is None:
        return None
    path = _hf_cache_path(header_sha256)
    if not path.is_file():
        return None
    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a damaged file
        log.warning("rebuilding the cached tokenizer: %s", _first_line(e))
        return None
    if hf.get_vocab_size(with_added_tokens=False) != vocab_size:
        log.warning("rebuilding the cached tokenizer %s: not of this vocabulary", path.name)
        return None
    return hf


def _keep_hf(header_sha256: str, hf: Tokenizer) -> None:
    """Write ``hf`` to the cache, whole or not at all, and remove the files other builders made
    for the same header (superseded); a cache that cannot be written only costs the next run
    the build (one warning)."""
    from strata.common.atomic import replaced

    path = _hf_cache_path(header_sha256)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path, "w") as f:
            f.write(hf.to_str())
        for old in path.parent.glob(f"{header_sha256}.*.json"):
            if old != path:
                old.unlink(missing_ok=True)
    except (OSError, StrataError) as e:
        log.warning("cannot cache the tokenizer in %s: %s", path.parent, _first_line(e))


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


# --------------------------------------------------------------------------------------------
# Special tokens
# --------------------------------------------------------------------------------------------


def _special_id(vocab: _Vocab, key: str, default: int | None) -> int | None:
    """An id from ``key``, else llama.cpp's default for the model (dropped if outside the vocab)."""
    found = vocab.token_id(key)
    if found is not None:
        return found
    return default if default is not None and default < len(vocab.tokens) else None


def _mark_control(vocab: _Vocab, token_id: int) -> None:
    # llama.cpp: a control-looking token that is not CONTROL is a conversion bug; fix its type.
    if vocab.types[token_id] not in _SPECIAL_TYPES:
        vocab.types[token_id] = TokenType.CONTROL


def _role_id(vocab: _Vocab, role: _Role) -> int | None:
    """The id for a role: the last of its keys present, else the first of its texts in the vocab."""
    ids = [i for i in (vocab.token_id(key) for key in role.keys) if i is not None]
    if ids:
        return ids[-1]
    for text in role.texts:
        found = vocab.token_to_id.get(text)
        if found is not None:
            _mark_control(vocab, found)
            return found
    return None


def _eog_ids(vocab: _Vocab, always: Iterable[int | None]) -> set[int]:
    """llama.cpp's end-of-generation set: role ids, EOG-looking texts, minus known conflicts."""
    eog = {i for i in always if i is not None}
    for text in _EOG_TEXTS:
        found = vocab.token_to_id.get(text)
        if found is not None:
            eog.add(found)
            _mark_control(vocab, found)
    _drop_conflicting_eog(vocab, eog)
    return eog


def _drop_conflicting_eog(vocab: _Vocab, eog: set[int]) -> None:
    """Undo two text rules that misfire on harmony (gpt-oss, solar-open) and gemma4 vocabs."""
    texts = {vocab.tokens[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        # There, <|end|> closes a message but not the turn.
        end = texts["<|end|>"]
        eog.discard(end)
        vocab.types[end] = TokenType.USER_DEFINED
    if "<|tool_response>" in texts and "</s>" in texts:
        eog.discard(texts["</s>"])
        vocab.types[texts["</s>"]] = TokenType.NORMAL


def _force_rendered(vocab: _Vocab) -> None:
    for text in _ALWAYS_RENDERED_TEXTS:
        found = vocab.token_to_id.get(text)
        if found is not None:
            vocab.types[found] = TokenType.USER_DEFINED


def _add_rule(vocab: _Vocab, key: str, default: bool, token_id: int | None, id_key: str) -> bool:
    """An add_bos/add_eos flag: the GGUF's, else llama.cpp's default (check_add_special_token)."""
    rule = vocab.value(key)
    add = default if rule is None else bool(rule)
    if add and token_id is None:
        raise TokenizerError(f"{key} is true, but {id_key} is not set")
    return add


def _split_on(pieces: list[str | int], text: str, token_id: int) -> list[str | int]:
    """Replace each occurrence of ``text`` in the text pieces by ``token_id``."""
    out: list[str | int] = []
    for piece in pieces:
        if isinstance(piece, int) or text not in piece:
            out.append(piece)
            continue
        first, *rest = piece.split(text)
        if first:
            out.append(first)
        for part in rest:
            out.append(token_id)
            if part:
                out.append(part)
    return out


# --------------------------------------------------------------------------------------------
# Long texts in chunks
#
# The regex pre-tokenizer is most of the cost of encoding a long prompt (a 1,000-token English
# document with SmolLM2's: 1.5 ms on the GPU host, 1.6-2.8 ms on 2 cores). A byte-level BPE
# tokenizer can instead encode a long text in chunks, cut where every pre-tokenizer cuts anyway,
# and remember the ids of each chunk: a prompt repeating a long prefix (a document asked about
# twice, a chat history) then pre-tokenizes only its new chunks.
#
# Why the ids do not change. A chunk boundary is a position i with text[i] == " " between two
# ASCII letters. Each regex of _PRE_TOKENIZER_GROUPS cuts its piece at its matches (the text
# between them is kept as pieces too), and for every one of them:
#   (a) no match holds both text[i-1] (a letter) and the space: every alternative that can match
#       a letter holds whitespace only as its optional first character (" ?\p{L}+",
#       "[^\r\n\p{L}\p{N}]?\p{L}+", tekken/gpt-4o's case runs, bloom's " ?[^(\s|...)]+",
#       deepseek's "\s?" + letters or punctuation), or none at all (the contractions, gpt-4o's
#       contraction suffix, deepseek-v3's punctuation + letters); the whitespace alternatives
#       match no letter;
#   (b) the matches left of i are the same on text[:i]: no regex has a lookbehind or "^"; the
#       lookaheads read one character and say the same of " " as of the end of the text
#       ("(?!\S)": true; "(?=[\p{L}])": false), and "\s+$" needs whitespace before the end,
#       where text[:i] has a letter. Nothing right of i reads left of it, so text[i:] matches as
#       that part of the whole text does;
#   (c) in every regex list, a regex has a match starting at i, the space followed by a letter
#       (GPT2's " ?\p{L}+", llama3/qwen2/qwen35/seed-coder/bailingmoe's "[^\r\n\p{L}\p{N}]?\p{L}+",
#       tekken/gpt-4o's prefix + case run (one of their two takes any ASCII letter), bloom's,
#       deepseek-llm/coder's "\s?" + letters, deepseek-v3's "[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+").
# So each regex either cuts at i, after which both ways see the same pieces, or leaves the three
# characters inside one in-between piece, which the next regex treats as it treats the two halves;
# by (c) the list has cut at i by its end, and BPE sees the same pre-tokens either way (ByteLevel
# runs without its own regex). With no normalizer, and added tokens already split out by
# _split_special (and none containing a space), the text reaches the pre-tokenizer as is.
# SentencePiece (a "▁" prefix per text, merges across spaces) is never chunked.
# --------------------------------------------------------------------------------------------

CHUNK_MIN_CHARS = 1024
"""Plain-text pieces at least this many characters long are encoded in chunks."""
CHUNK_CHARS = 512
"""Characters from a chunk's start to the first place it may end (the next safe boundary)."""
CHUNK_CACHE_SIZE = 4096
"""Chunks whose ids are remembered, least recently used dropped first. Only chunks of at most
``CHUNK_KEEP_CHARS`` characters are remembered, so this holds at most 8 M characters and their
ids (a chunk ends at the first safe boundary past ``CHUNK_CHARS``: text with few of them, e.g.
Chinese, makes chunks of any length)."""
CHUNK_KEEP_CHARS = 4 * CHUNK_CHARS
"""The longest chunk remembered (characters)."""

_SAFE_BOUNDARY = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")


def _safe_chunks(text: str, chunk_chars: int) -> list[str]:
    """``text`` cut at the first safe boundary at or after each chunk's start + ``chunk_chars``.

    The cuts depend only on the text up to the next boundary, so texts sharing a long prefix
    are cut alike over it.
    """
    chunks: list[str] = []
    start = 0
    while (cut := _SAFE_BOUNDARY.search(text, start + max(chunk_chars, 1))) is not None:
        chunks.append(text[start : cut.start()])
        start = cut.start()
    chunks.append(text[start:])
    return chunks


class _ChunkCache:
    """Encodes long plain texts chunk by chunk, remembering each chunk's ids (thread-safe).

    A text of at least ``min_chars`` characters is cut by ``_safe_chunks``; the chunks not
    remembered are encoded together (``encode_batch``, in parallel) and remembered, up to
    ``max_chunks`` chunks of at most ``keep_chars`` (``CHUNK_KEEP_CHARS``) characters each. A
    text's last chunk is not remembered: it ends at the text's end, not at a boundary, so a
    longer text that shares it cuts there differently (only the same text again would reuse
    it). Shorter texts, and texts with no safe boundary, are encoded whole.
    """

    def __init__(self, hf: Tokenizer, max_chunks: int = CHUNK_CACHE_SIZE):
        self.hf = hf
        self.min_chars = CHUNK_MIN_CHARS
        self.chunk_chars = CHUNK_CHARS
        self.max_chunks = max_chunks
        self.keep_chars = CHUNK_KEEP_CHARS
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """The ids of plain ``text``, as ``hf.encode(text, add_special_tokens=False).ids``."""
        chunks = _safe_chunks(text, self.chunk_chars) if len(text) >= self.min_chars else [text]
        if len(chunks) == 1:
            return self.hf.encode(text, add_special_tokens=False).ids
        found: dict[str, array] = {}
        with self._lock:
            for chunk in chunks:
                ids = self._ids.get(chunk)
                if ids is not None:
                    self._ids.move_to_end(chunk)
                    found[chunk] = ids
        missing = list(dict.fromkeys(c for c in chunks if c not in found))
        if missing:
            encodings = self.hf.encode_batch(missing, add_special_tokens=False)
            new = {chunk: array("i", e.ids) for chunk, e in zip(missing, encodings, strict=True)}
            found.update(new)
            last = chunks[-1]
            keep = {c: ids for c, ids in new.items() if c != last and len(c) <= self.keep_chars}
            with self._lock:
                self._ids.update(keep)
                while len(self._ids) > self.max_chunks:
                    self._ids.popitem(last=False)
        return [i for chunk in chunks for i in found[chunk]]

    def clear(self) -> None:
        """Forget every remembered chunk."""
        with self._lock:
            self._ids.clear()


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class GGUFTokenizer:
    """A GGUF model's tokenizer, giving the same ids as llama.cpp for the same file.

    Build it with ``from_gguf(path)``, or ``from_gguf(g)`` when the file is already open as a
    ``GGUFFile``.

    Attributes:
        vocab_size (int): number of tokens.
        bos_id, eos_id (int | None): beginning/end-of-sequence ids (the GGUF's, else llama.cpp's
            model default; None when there is none).
        eot_id (int | None): end-of-turn id: ``tokenizer.ggml.eot_token_id``, else the first of
            llama.cpp's EOT-looking texts present (``<|eot_id|>``, ``<|im_end|>``, ...), else None.
            (llama.cpp takes whichever of them its hash map yields first, e.g. ``<|endoftext|>``
            rather than ``<|im_end|>`` for SmolLM2; both are in ``eog_ids`` either way.)
        eog_ids (frozenset[int]): ids that end generation (llama.cpp's ``special_eog_ids``).
        add_bos (bool): whether ``encode`` prepends BOS by default
            (``tokenizer.ggml.add_bos_token``, else llama.cpp's default for the tokenizer).
        add_eos (bool): whether ``encode`` appends EOS by default (``tokenizer.ggml.add_eos_token``,
            else false).
        chat_template (str | None): ``tokenizer.chat_template``.
        hf (tokenizers.Tokenizer): the underlying HF tokenizer; it encodes plain text only
            (control tokens are not recognised, no BOS).
        chunks (_ChunkCache | None): encodes plain-text pieces of ``chunks.min_chars``
            characters or more in chunks of about ``chunks.chunk_chars`` characters, remembering
            each chunk's ids: the same ids, sooner when a prompt repeats a long prefix (SmolLM2,
            a 1,000-token document: 1.6 ms whole; 1.2-1.8 ms chunked with nothing remembered;
            0.3-0.5 ms for the document remembered plus a new 16-token suffix, on 2 cores). Set
            only for byte-level BPE ("Long texts in chunks" says why the ids stay the same);
            None, or set to None, encodes every piece whole.
    """

    def __init__(self, vocab: _Vocab, backend: _Backend):
        """Use ``from_gguf``; this wires up already-read parts."""
        self.vocab_size = len(vocab.tokens)
        self.hf = backend.hf
        self.chat_template = _string_field(vocab.meta, _K.CHAT_TEMPLATE)
        self.bos_id = _special_id(vocab, _K.BOS_ID, backend.default_bos)
        self.eos_id = _special_id(vocab, _K.EOS_ID, backend.default_eos)
        roles = {name: _role_id(vocab, role) for name, role in _ROLES.items()}
        self.eot_id = roles["eot"]
        _force_rendered(vocab)
        ending = [roles[name] for name, role in _ROLES.items() if role.ends_generation]
        self.eog_ids = frozenset(_eog_ids(vocab, [self.eos_id, *ending]))
        self.add_bos = _add_rule(vocab, _K.ADD_BOS, backend.add_bos, self.bos_id, _K.BOS_ID)
        self.add_eos = _add_rule(vocab, _K.ADD_EOS, False, self.eos_id, _K.EOS_ID)
        self._tokens = vocab.tokens
        self._types = vocab.types
        # llama.cpp splits special tokens out longest text first.
        self._added = sorted(
            (i for i, t in enumerate(vocab.types) if t in _ADDED_TYPES),
            key=lambda i: (-len(vocab.tokens[i]), i),
        )
        self._register_added_tokens()
        self.chunks = _ChunkCache(self.hf) if self._may_chunk(backend) else None
        self._piece_cache: dict[int, bytes] = {}
        self._normal_bytes = backend.normal_bytes

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | Path | GGUFFile, cache: bool = True) -> GGUFTokenizer:
        """Build the tokenizer of a GGUF: a path, or a file already open (``open_gguf``), whose
        metadata it reads without rereading the file. With ``cache``, the HF tokenizer is read
        from (or written to) the cache, keyed by the GGUF header's sha256 (``_cached_hf``).

        Raises:
            strata.common.errors.GGUFError: the file is missing or not a valid GGUF, or a text
                value is not valid UTF-8.
            TokenizerError: its tokenizer metadata is missing, malformed or not supported yet.
        """
        from strata.common.gguf_file import GGUFFile, open_gguf

        g = source if isinstance(source, GGUFFile) else open_gguf(source)
        vocab = _read_vocab(g)
        return cls(vocab, _backend_for(vocab, g.header_sha256 if cache else None))

    def _register_added_tokens(self) -> None:
        # Registered so that ``self.hf`` on its own treats them as llama.cpp does without
        # parse_special: user-defined tokens are matched, control tokens are plain text.
        self.hf.add_tokens(
            [  # add_special_tokens would make them all special
                AddedToken(
                    self._tokens[i], special=self._types[i] in _SPECIAL_TYPES, normalized=False
                )
                for i in self._added
            ]
        )
        self.hf.encode_special_tokens = True

    def _may_chunk(self, backend: _Backend) -> bool:
        """Whether chunked encoding keeps the ids (see "Long texts in chunks")."""
        added = [self._tokens[i] for i in self._added]
        added += [t.content for t in self.hf.get_added_tokens_decoder().values()]
        return backend.chunkable and self.hf.normalizer is None and not any(" " in t for t in added)

    # -- encoding ----------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        add_bos: bool | None = None,
        parse_special: bool = False,
        add_eos: bool | None = None,
    ) -> list[int]:
        """Token ids for ``text``, as llama.cpp's ``llama_tokenize``.

        Args:
            text: the text.
            add_bos: prepend BOS; None follows the GGUF's rule (``self.add_bos``).
            parse_special: recognise control tokens written in the text (e.g. ``<|im_end|>`` in a
                rendered chat prompt). Without it they are tokenized as ordinary text; user-defined
                tokens are recognised either way, as in llama.cpp.
            add_eos: append EOS; None follows the GGUF's rule (``self.add_eos``).

        Raises:
            TokenizerError: BOS or EOS was asked for but the model has none.
        """
        ids = self._marker(self.bos_id, "BOS", self.add_bos if add_bos is None else add_bos)
        for piece in self._split_special(text, parse_special):
            if isinstance(piece, int):
                ids.append(piece)
            elif self.chunks is not None:
                ids.extend(self.chunks.encode(piece))
            else:
                ids.extend(self.hf.encode(piece, add_special_tokens=False).ids)
        return ids + self._marker(self.eos_id, "EOS", self.add_eos if add_eos is None else add_eos)

    @staticmethod
    def _marker(token_id: int | None, name: str, wanted: bool) -> list[int]:
        if not wanted:
            return []
        if token_id is None:
            raise TokenizerError(f"this model has no {name} token to add")
        return [token_id]

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """``text`` cut into plain-text pieces and special-token ids (tokenizer_st_partition)."""
        pieces: list[str | int] = [text] if text else []
        for token_id in self._added:
            token_text = self._tokens[token_id]
            if token_text not in text:
                continue
            if parse_special or self._types[token_id] == TokenType.USER_DEFINED:
                pieces = _split_on(pieces, token_text, token_id)
        return pieces

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD.

        The tokens' pieces joined, as llama.cpp streams them (``token_to_piece``). Unlike
        ``llama_detokenize``, no leading space is dropped for ``add_space_prefix`` vocabularies
        (Llama 2; not Gemma): generated text keeps its first space.

        Args:
            ids: token ids.
            skip_special: drop control and unknown tokens (BOS, ``<|im_end|>``, ...), as llama.cpp's
                ``token_to_piece(special=false)``.

        Raises:
            TokenizerError: an id is outside the vocabulary.
        """
        data = b"".join(self.token_bytes(i, skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        """The bytes one token stands for (possibly part of a UTF-8 character).

        Raises:
            TokenizerError: ``token_id`` is outside the vocabulary.
        """
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if skip_special and self._types[token_id] in _SPECIAL_TYPES:
            return b""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece_cache[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> bytes:
        """llama.cpp's token_to_piece with special=true: what the token writes into the text."""
        text, kind = self._tokens[token_id], self._types[token_id]
        if kind in _ADDED_TYPES:
            return text.encode()
        if kind == TokenType.NORMAL:
            return self._normal_bytes(text)
        if kind == TokenType.BYTE:  # "<0xAB>"
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED / undefined tokens write nothing

    def is_control(self, token_id: int) -> bool:
        """Whether ``token_id`` is a control or unknown token (BOS, ``<|im_end|>``, ...): text
        never produces it and decoding drops it (``skip_special``)."""
        return self._types[token_id] in _SPECIAL_TYPES

    def token_text(self, token_id: int) -> str:
        """The text of one token including special ones (e.g. ``"<|im_start|>"``), for templates.

        Raises:
            TokenizerError: ``token_id`` is outside the vocabulary.
        """
        return self.decode([token_id], skip_special=False)

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        """A fresh incremental detokenizer over this tokenizer (see ``StreamDecoder``)."""
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Turns token ids, pushed one at a time, into text chunks safe to print as they come.

    A chunk never ends inside a UTF-8 character: the bytes of an incomplete character are held
    back until the rest arrives. The chunks of ``push`` for each id, then ``flush``, join to
    exactly ``tokenizer.decode(ids, skip_special)``.
    """

    def __init__(self, tokenizer: GGUFTokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by this token ('' while a character is still incomplete).

        Raises:
            TokenizerError: ``token_id`` is outside the vocabulary.
        """
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, self._skip_special))

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); then starts afresh."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail
