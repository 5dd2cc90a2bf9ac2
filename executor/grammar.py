"""Constrained decoding: a grammar that decides, step by step, which tokens a sequence may take.

Structured outputs (``response_format``) and forced tool calls (``tool_choice``) are grammars
over the model's own vocabulary, enforced with llguidance (Microsoft's grammar engine: a token
mask per step, computed from a lexer and an Earley parser over the token trie, in tens of µs for
a 49k-token vocabulary). Its pieces here:

- :class:`Vocabulary`: every token's bytes, as llama.cpp's ``token_to_piece`` writes them, in
  llguidance's form (control tokens marked with a leading 0xFF byte, so that no text grammar can
  produce them), built once per tokenizer (:func:`vocabulary`);
- :func:`json_schema_grammar`: a JSON schema (or JSON mode's any-object) as a grammar, refused
  with a :class:`GrammarError` naming the schema feature llguidance would not enforce, never
  accepted and ignored; separators are fixed (``", "`` and ``": "``, no free whitespace), so a
  model cannot spend its tokens on whitespace;
- :class:`Constraint`: one sequence's grammar state, cloned from a compiled prototype kept per
  grammar (``PROTOTYPES`` most recent): the allowed tokens of the next step (:meth:`Constraint.
  mask`), the masks along a speculative draft (:meth:`Constraint.masks_along`), and the tokens
  taken (:meth:`Constraint.consume`).

The sampler (``executor.sampling.Sampler``) applies the mask to the logits before it picks or
verifies, so greedy decoding, sampling and speculative decoding all draw only grammatical tokens.
A grammar's end is an end-of-generation token: once the text is complete the mask allows only
those, and the request finishes with ``"stop"``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par
from strata.common.errors import StrataError

if TYPE_CHECKING:
    from strata.executor.tokenizer import GGUFTokenizer

PROTOTYPES = 64
"""Compiled grammars kept (least recently used dropped): a client repeating one schema compiles
it once; each request then takes a copy (``LLMatcher.deep_copy``: microseconds)."""

JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
"""llguidance's JSON options for every schema (its ``x-guidance`` keys): the separators OpenAI's
and Python's ``json.dumps`` write, no other whitespace between tokens of JSON (a flexible
whitespace rule lets a weak model fill ``max_tokens`` with newlines), and ``lenient`` off: a
schema keyword llguidance does not implement is an error, not a keyword quietly dropped."""

MAX_SCHEMA_BYTES = 1 << 20
"""Largest JSON schema accepted (its JSON text): a schema is a grammar llguidance compiles on the
request's path, and real ones are a few kB."""


class GrammarError(StrataError):
    """A grammar or schema that cannot be enforced; the message names the feature and the fix."""


GRAMMAR_FAILED = "the request's grammar failed: "
"""How a request's error starts when its grammar failed mid-reply (llguidance's parser limits,
a grammar no further token fits): the request's fault, which the server answers with a 400,
not the engine's (``executor.runner``, ``executor.server.generation``)."""


class Vocabulary:
    """The model's tokens in llguidance's form (``llguidance.LLTokenizer``).

    Args:
        tokenizer: the model's tokenizer; its end-of-generation ids are the grammar's ends.
        size: the logits' width (the model's output rows), which may exceed the tokenizer's
            vocabulary; the extra ids are never allowed.
    """

    def __init__(self, tokenizer: GGUFTokenizer, size: int | None = None):
        self.tokenizer = tokenizer
        self.size = tokenizer.vocab_size if size is None else max(size, tokenizer.vocab_size)
        self.ll = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Tokens(tokenizer)), eos_token=sorted(tokenizer.eog_ids)
        )


class _Tokens:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer: each token's bytes (control
    tokens prefixed with 0xFF, as llguidance's own llama.cpp adapter marks them), the special
    ids, and plain-text tokenization (no BOS, control-token texts not parsed)."""

    def __init__(self, tokenizer: GGUFTokenizer):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(tokenizer.vocab_size):
            if tokenizer.is_control(i):
                self.special_token_ids.append(i)
                self.tokens.append(b"\xff" + tokenizer.token_text(i).encode())
            else:
                self.tokens.append(tokenizer.token_bytes(i, skip_special=False))

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, add_eos=False)


_vocabularies: dict[tuple[int, int | None], Vocabulary] = {}
_vocab_lock = threading.Lock()


def vocabulary(tokenizer: GGUFTokenizer, size: int | None = None) -> Vocabulary:
    """The :class:`Vocabulary` of ``tokenizer`` for logits ``size`` wide, built on first use (a
    pass over every token: about 0.1 s for 49k tokens) and kept (with the tokenizer) for the
    process's life; one per width, so a mask is always as wide as the logits it is asked for."""
    key = (id(tokenizer), size)
    with _vocab_lock:
        v = _vocabularies.get(key)
        if v is None or v.tokenizer is not tokenizer:
            v = _vocabularies[key] = Vocabulary(tokenizer, size)
        return v


def json_schema_grammar(schema: Any, where: str = "response_format") -> str:
    """A JSON schema (``True``/``{}``: any JSON value) as an llguidance grammar, with
    ``JSON_OPTIONS``.

    Raises:
        GrammarError: ``schema`` is not a JSON object or boolean, is larger than
            ``MAX_SCHEMA_BYTES``, or uses a feature llguidance does not enforce (named); ``where``
            names the request field in the message.
    """
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"{where}: the schema must be a JSON object, not {_kind(schema)}")
    if schema is False:
        raise GrammarError(f"{where}: the schema false allows no value; give a schema object")
    if schema is True:
        schema = {}
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise GrammarError(
            f"{where}: the schema is {len(text)} bytes; give one of at most {MAX_SCHEMA_BYTES}"
        )
    extension = schema.get("x-guidance", {})
    if not isinstance(extension, dict):
        raise GrammarError(
            f"{where}: the schema's x-guidance (llguidance's JSON options) must be an object, "
            f"not {_kind(extension)}; leave it out"
        )
    options = {**JSON_OPTIONS, **extension}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": options})
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{where}: the schema cannot be enforced: {_first_line(e)}") from None
    check_grammar(grammar, where)
    return grammar


def lark_grammar(lark: str, where: str) -> str:
    """A grammar in llguidance's Lark dialect (``%json {...}`` embeds a JSON schema), checked.

    Raises:
        GrammarError: it does not compile, or uses something llguidance would not enforce.
    """
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{where}: the grammar cannot be enforced: {_first_line(e)}") from None
    check_grammar(grammar, where)
    return grammar


def check_grammar(grammar: str, where: str) -> None:
    """Refuse a grammar llguidance cannot compile or would enforce only in part: its warnings
    (an unknown string ``format``, ...) name features that would be ignored.

    Raises:
        GrammarError: naming the first error or warning.
    """
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except (ValueError, TypeError) as e:
        failed, messages = True, [str(e)]
    # Without a tokenizer, special tokens named by id (``<[id]>``) cannot be checked here:
    # the engine's compile against the vocabulary checks them (``Constraint``).
    messages = [m for m in messages if not m.startswith("no tokenizer")]
    if failed or messages:
        detail = "; ".join(_first_line(m) for m in messages) or "not a valid grammar"
        raise GrammarError(
            f"{where}: the schema cannot be enforced: {detail}; leave that feature out"
        )


_prototypes: OrderedDict[tuple[int, str], llguidance.LLMatcher] = OrderedDict()
_proto_lock = threading.Lock()


class Constraint:
    """One sequence's grammar state.

    Args:
        vocab: the model's vocabulary.
        grammar: an llguidance grammar (:func:`json_schema_grammar`, :func:`lark_grammar`).

    Raises:
        GrammarError: the grammar does not compile against this vocabulary.
    """

    def __init__(self, vocab: Vocabulary, grammar: str):
        self.vocab = vocab
        key = (id(vocab), grammar)
        with _proto_lock:
            proto = _prototypes.get(key)
            if proto is not None:
                _prototypes.move_to_end(key)
        if proto is None:
            proto = llguidance.LLMatcher(vocab.ll, grammar)
            if proto.is_error():
                detail = _first_line(proto.get_error())
                raise GrammarError(f"the grammar cannot be enforced: {detail}")
            _check_some_text(proto, vocab)
            with _proto_lock:
                _prototypes[key] = proto
                while len(_prototypes) > PROTOTYPES:
                    _prototypes.popitem(last=False)
        self._m = proto.deep_copy()

    def mask(self) -> np.ndarray:
        """The tokens allowed next: bool [vocab.size] (the logits' width); once the grammar has
        ended, only the end-of-generation tokens.

        Raises:
            GrammarError: the grammar allows no token (it failed on an earlier token).
        """
        if self._m.is_stopped():
            return self._ends()
        return self._allowed(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8))

    def _allowed(self, bits: np.ndarray) -> np.ndarray:
        """llguidance's bitmask (uint8, token i at bit i % 8 of byte i // 8) as bool
        [vocab.size].

        Raises:
            GrammarError: no token is allowed.
        """
        size = self.vocab.size
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)  # token i: bit i
        if len(allowed) >= size:
            allowed = allowed[:size]
        else:
            allowed = np.pad(allowed, (0, size - len(allowed)))
        if not allowed.any():
            detail = _first_line(self._m.get_error())
            raise GrammarError(f"the grammar allows no next token: {detail}")
        return allowed

    def _ends(self) -> np.ndarray:
        allowed = np.zeros(self.vocab.size, dtype=bool)
        allowed[self.vocab.ll.eos_tokens] = True
        return allowed

    def consume(self, tokens: list[int]) -> None:
        """Advance past ``tokens`` (taken by the sampler, so each was allowed); nothing past the
        grammar's end (the sequence is finishing on an end-of-generation token).

        Raises:
            GrammarError: a token the grammar refuses (a drafter's or the sampler's fault).
        """
        for t in tokens:
            if self._m.is_stopped():
                return
            if not self._m.consume_token(int(t)):
                raise GrammarError(
                    f"token {int(t)} does not fit the grammar: {_first_line(self._m.get_error())}"
                )

    def masks_along(self, draft: list[int]) -> list[np.ndarray]:
        """The masks of a speculative verification: row j's after the tokens so far and
        ``draft[:j]``, for j = 0 .. K, stopping after the first draft token the grammar refuses
        (no later row can be reached: that token's probability is 0 under its mask); after an
        end-of-generation token (which ends the sequence) the rows keep its mask. The state is
        left as it was."""
        masks = [self.mask()]
        taken = 0
        for t in map(int, draft):
            if not masks[-1][t]:
                break
            if self._m.is_stopped() or t in self.vocab.ll.eos_tokens:
                masks.append(masks[-1])
                continue
            if not self._m.consume_token(t):
                break
            taken += 1
            masks.append(self.mask())
        if taken and not self._m.rollback(taken):
            raise GrammarError(f"the grammar could not take back {taken} draft tokens")
        return masks


_executor: llguidance.LLExecutor | None = None


def next_masks(constraints: list[Constraint]) -> list[np.ndarray | GrammarError]:
    """:meth:`Constraint.mask` of several sequences at once: the grammars still running are
    computed together on llguidance's own thread pool (``LLExecutor``, outside the GIL), so a
    batch of 16 constrained sequences costs about one mask's time on a machine with cores to
    spare. Each entry is the mask, or the :class:`GrammarError` that sequence's mask raised (a
    failure ends its own request only)."""
    global _executor
    out: list[np.ndarray | GrammarError] = [np.zeros(0, bool)] * len(constraints)
    running = [i for i, c in enumerate(constraints) if not c._m.is_stopped()]
    if len(running) > 1:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        words = (constraints[running[0]].vocab.ll.vocab_size + 31) // 32
        bits = np.zeros((len(running), words), dtype=np.int32)
        fill_next_token_bitmask_par(
            _executor, [(constraints[i]._m, j) for j, i in enumerate(running)], bits
        )
    row = {i: j for j, i in enumerate(running)}
    for i, c in enumerate(constraints):
        try:
            if c._m.is_stopped():
                out[i] = c._ends()
            elif len(running) > 1:
                out[i] = c._allowed(bits[row[i]].view(np.uint8))
            else:
                out[i] = c.mask()
        except GrammarError as e:
            out[i] = e
    return out


def _check_some_text(proto: llguidance.LLMatcher, vocab: Vocabulary) -> None:
    """Refuse a grammar whose first step allows only the end: a schema no JSON value meets
    (``{"$ref": "#"}``, a definition that only refers to itself) compiles, but would give an
    empty reply that is not JSON with ``finish_reason: "stop"``.

    Raises:
        GrammarError: naming the likely cause.
    """
    probe = proto.deep_copy()
    bits = np.unpackbits(np.frombuffer(probe.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits[: vocab.size])
    if probe.is_error() or not set(allowed.tolist()) - set(vocab.ll.eos_tokens):
        raise GrammarError(
            "the schema allows no value (an empty reply is all it could give: a $ref that only "
            "refers to itself, or constraints nothing meets); give a schema some JSON meets"
        )


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _first_line(e: object) -> str:
    """llguidance's message in one line of at most 300 characters: its first line, and where
    that only announces the detail ("regex parse error:"), the detail's last line too (its
    parser state and the grammar text stay out)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[-1].removeprefix('error:').strip()}"
    return text[:300]
