"""Stop strings: generated text cut before the first one, across chunk boundaries, holding back
any tail that could be the start of one, so that a stop string never leaks into a streamed chunk
and the joined stream equals the non-streamed text."""

from __future__ import annotations


class StopMatcher:
    """Cuts generated text before the first stop string, across chunk boundaries.

    ``push`` returns the text that is safe to send: a tail that could be the start of a stop
    string is held back until the next piece decides it. The pieces returned by ``push`` (and
    ``flush`` at the end when no stop string matched) join to the text cut before the first stop
    string, however the text was split.

    Args:
        stops: the stop strings (non-empty).
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns ``(text safe to send, whether a stop string matched)``; after a match the
        returned text is everything before the stop string and the rest is dropped."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0
        for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, once the text is complete (it did not become a stop string)."""
        held, self._held = self._held, ""
        return held
