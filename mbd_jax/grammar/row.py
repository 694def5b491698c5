"""One constrained row on the host: its matcher and its gate.

The gate is the row's first generated position the grammar has not accepted yet. Every position
before it holds text the matcher consumed, in order; positions after it may hold provisional
tokens the decode loop filled out of order. After each decode call the row's run of filled
positions from the gate is checked: the longest prefix the grammar accepts is consumed and the
gate moves past it; the first token it rejects is cleared back to MASK (the loop then refills
it under the mask). The token mask of the matcher's new state goes to the device, where it
applies exactly at the gate (decoding/block_buffer.py: a row never commits or ends past it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class RowGrammar:
    def __init__(self, matcher: Any, gate: int, words: int, mask_token_id: int,
                 eos_ids: Sequence[int]):
        """`matcher`: a fresh llguidance matcher; `gate`: the first generated position (the
        prompt's length); `words`: uint32 words of a token mask."""
        self.matcher, self.gate = matcher, gate
        self._words, self._mask_id, self._eos = words, mask_token_id, frozenset(eos_ids)
        self.mask = self._compute_mask()

    def advance(self, window: np.ndarray, start: int) -> bool:
        """Consumes the filled run at the gate from `window` (the row's tokens from absolute
        position `start`, which is at most the gate). Returns whether the token now at the gate is
        one the grammar rejects (to be cleared). `mask` is then the token mask at the gate."""
        run = window[self.gate - start:]
        filled = run != self._mask_id
        run = run[: len(run) if filled.all() else int(np.argmin(filled))].tolist()
        if not run:
            return False
        eos = next((i for i, t in enumerate(run) if t in self._eos), len(run))
        n = self.matcher.validate_tokens(run[:eos]) if eos else 0
        if n and not self.matcher.consume_tokens(run[:n]):
            raise RuntimeError(f"grammar matcher: {self.matcher.get_error()}")
        self.gate += n
        if n == eos < len(run) and self.matcher.is_accepting():
            self.gate += 1  # the EOS ends the text where the grammar may end: the row is done
            return False
        self.mask = self._compute_mask()
        return n < len(run)

    def _compute_mask(self) -> np.ndarray:
        """[words] uint32: bit t of word t // 32 set where token t may stand at the gate. A
        grammar that can go no further allows the end of the text (EOS) only."""
        mask = np.zeros(self._words, np.uint32)
        got = np.frombuffer(self.matcher.compute_bitmask(), np.uint32)[: self._words]
        mask[: len(got)] = got
        if not mask.any():  # only after an internal error of the matcher: end the text
            for t in self._eos:
                mask[t // 32] |= np.uint32(1 << (t % 32))
        return mask
