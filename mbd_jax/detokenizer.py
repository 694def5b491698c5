"""Incremental detokenization: the text of a growing token stream as deltas, each final.

Decoding the whole output again for every streamed block costs O(n) per block and O(n^2) per
request. Here each `push` decodes only a short window: the tokens since the previous emission
(`read`) plus the ones before it back to `prefix`, and emits what the new tokens add to that
window's text. The window starts at an earlier emission boundary, so a piece whose text depends
on its neighbour (a sentencepiece word-start "▁" that decodes without its space at the start of a
text) is decoded with the same neighbour the full text gives it.

A trailing partial UTF-8 character (byte-fallback or byte-level pieces decode to U+FFFD until
the character is complete) is held back until more tokens come, or `finish`. Tokens that decode
to no text on their own (control pieces, a lone sentencepiece "▁", whose space a text's start
drops) never start a window: the next piece's leading space would be decided without its real
neighbour.

`finish` decodes the whole output once and returns what is missing, so the concatenated deltas
always equal `tokenizer.decode(ids)` (tests/test_detokenizer.py checks every prefix of random
streams, byte pieces and multi-byte characters included).
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

from mbd_jax.tokenizer import Tokenizer

log = logging.getLogger("mbd_jax.detokenizer")

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window starts here: an emission boundary (or 0)
        self.read = 0  # tokens [0, read) are in the emitted text
        self.text = ""  # everything emitted so far

    def push(self, ids: Sequence[int]) -> str:
        """Appends tokens; returns the text they add that can no longer change (maybe "")."""
        self.ids.extend(int(i) for i in ids)
        if len(self.ids) == self.read:
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix: self.read])
        window = decode(self.ids[self.prefix:])
        if len(window) <= len(before) or not window.startswith(before) or window.endswith(REPLACEMENT):
            return ""
        delta = window[len(before):]
        # The next window starts at this emission's start unless these tokens decode to nothing
        # on their own (then the older start keeps a visible neighbour in the window).
        if decode(self.ids[self.read:]):
            self.prefix = self.read
        self.read = len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text once the stream has ended (one full decode)."""
        full = self.tokenizer.decode(self.ids)
        if not full.startswith(self.text):  # a tokenizer whose pieces depend on far context
            log.warning("streamed text diverged from the full decode after %d characters",
                        len(os.path.commonprefix([full, self.text])))
        delta = full[len(self.text):]
        self.text, self.read = full, len(self.ids)
        return delta
