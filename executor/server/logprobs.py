"""OpenAI's ``logprobs`` objects built from the engine's per-token log-probabilities: the chat
form (``{"content": [...]}``) and the legacy completion form (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``)."""

from __future__ import annotations

import codecs
import math

from strata.executor.serving import TokenLogprob

LOGPROB_FLOOR = -9999.0
"""Reported in place of a log-probability of minus infinity (a token the logits rule out), which
JSON cannot carry; vLLM reports the same value."""


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _token_label(tok, token_id: int, as_ids: bool) -> str:
    """How logprobs name a token: ``token_id:N``; else its text (special tokens' too), or, for a
    token holding part of a UTF-8 character, ``bytes:\\xNN...`` as OpenAI names such tokens (as
    text they would all read U+FFFD, and collide as keys of a completion's ``top_logprobs``)."""
    if as_ids:
        return f"token_id:{token_id}"
    data = tok.token_bytes(token_id, skip_special=False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _token_entry(tok, token_id: int, logprob: float, as_ids: bool) -> dict:
    """OpenAI's chat ``logprobs`` entry of one token: its name, log-probability and bytes."""
    return {
        "token": _token_label(tok, token_id, as_ids),
        "logprob": _logprob(logprob),
        "bytes": list(tok.token_bytes(token_id, skip_special=False)),
    }


def chat_logprobs(
    tok, entries: list[tuple[int, TokenLogprob]] | None, as_ids: bool = False
) -> dict | None:
    """A chat choice's ``logprobs`` object (``{"content": [...]}``) for ``entries``; None
    when the request did not ask for logprobs. ``as_ids``: name tokens ``token_id:N``."""
    if entries is None:
        return None
    return {
        "content": [
            {
                **_token_entry(tok, tid, lp.logprob, as_ids),
                "top_logprobs": [_token_entry(tok, a, v, as_ids) for a, v in lp.top],
            }
            for tid, lp in entries
        ]
    }


class TextOffsets:
    """Where each generated token's text starts in a completion's text (characters), for the
    legacy ``text_offset``: the text holds a token's characters once its UTF-8 character is
    complete, and nothing of a special token (as ``Generation`` decodes it).

    Args:
        tok: the tokenizer.
    """

    def __init__(self, tok):
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def next(self, token_id: int) -> int:
        """The offset of ``token_id``'s text, then advance past it."""
        at = self.chars
        self.chars += len(self._utf8.decode(self._tok.token_bytes(token_id)))
        return at


def completion_logprobs(
    tok,
    entries: list[tuple[int, TokenLogprob]] | None,
    offsets: TextOffsets,
    as_ids: bool = False,
) -> dict | None:
    """A completion choice's legacy ``logprobs`` object (``tokens``, ``token_logprobs``,
    ``top_logprobs`` as ``{token: logprob}``, ``text_offset`` from ``offsets``, which carries on
    across a stream's chunks); None when the request did not ask for logprobs. ``as_ids``: name
    tokens ``token_id:N``."""
    if entries is None:
        return None
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for tid, lp in entries:
        out["tokens"].append(_token_label(tok, tid, as_ids))
        out["token_logprobs"].append(_logprob(lp.logprob))
        out["top_logprobs"].append({_token_label(tok, a, as_ids): _logprob(v) for a, v in lp.top})
        out["text_offset"].append(offsets.next(tid))
    return out
