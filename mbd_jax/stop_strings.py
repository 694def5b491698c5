"""Stop strings over streamed text: release text as it comes, hold back what could still begin a
stop string, and cut at the first one found.

In block diffusion a whole block commits at once, so a stop string can start anywhere inside the
newest block (or straddle blocks); `push` takes each block's text delta and returns the part that
is final: never any of a stop string, never text after one.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]):
        if not stops or any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self._hold = max(map(len, stops)) - 1  # a stop string that has not completed starts here
        self._pending = ""  # text received and not yet released
        self.stopped = False  # a stop string was found; everything after it is dropped

    def push(self, text: str) -> str:
        """The text that is now final. Once `stopped`, always ""."""
        if self.stopped:
            return ""
        self._pending += text
        found = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self._pending, self.stopped = self._pending[: min(found)], "", True
            return out
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def finish(self) -> str:
        """The held-back tail, at the end of the output (it did not complete a stop string)."""
        out, self._pending = self._pending, ""
        return out
