"""Token ids in, text out, for one streamed request: detokenization and stop strings.

Stop strings are the daemon's business, not the engine's: they are matched on text, and one
string may span several tokens. Text that could still become the start of a stop string is
held back until it cannot, so a client never receives text that a stop string later cuts off.
"""
from __future__ import annotations

from executor.tokenizer import IncrementalDecoder, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, stop_strings: tuple[str, ...] = ()):
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._stops = tuple(stop_strings)
        self._pending = ""  # decoded, not yet emitted
        self.stopped_by: str | None = None  # the stop string that matched

    def push(self, token_id: int) -> str:
        """The text this token completes that may be sent now ('' while held back)."""
        if self._decoder is None or self.stopped_by is not None:
            return ""
        self._pending += self._decoder.push(token_id)
        hits = [(self._pending.find(s), s) for s in self._stops if s in self._pending]
        if hits:
            at, self.stopped_by = min(hits)
            out, self._pending = self._pending[:at], ""
            return out
        keep = self._partial_match()
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        return out

    def _partial_match(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        for n in range(min(len(self._pending), max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            tail = self._pending[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def finish(self) -> str:
        """Text still held back when the generation ends without a stop string, with the
        decoder's last incomplete bytes (as U+FFFD)."""
        if self._decoder is None or self.stopped_by is not None:
            return ""
        out, self._pending = self._pending + self._decoder.flush(), ""
        return out
