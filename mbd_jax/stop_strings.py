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
        return self._release(final=False)

    def finish(self) -> str:
        """The held-back tail, at the end of the output, cut at a stop string it holds (which
        sets `stopped`: one that completed while an earlier-starting one was still open)."""
        if self.stopped:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        p = self._pending
        found = [i for i in (p.find(s) for s in self.stops) if i >= 0]
        first = min(found, default=len(p))
        # A stop string can still begin before the first one found, if the text from there on
        # is the start of a longer stop string whose rest has not come yet ('c' found in 'aac'
        # while 'aca' may follow from index 1): the cut waits for it. Such a start lies within
        # the last _hold characters.
        undecided = not final and any(
            len(p) - j < len(s) and s.startswith(p[j:])
            for j in range(max(0, len(p) - self._hold), first) for s in self.stops)
        if found and not undecided:
            out, self._pending, self.stopped = p[:first], "", True
            return out
        cut = len(p) if final else max(0, len(p) - self._hold)
        out, self._pending = p[:cut], p[cut:]
        return out
