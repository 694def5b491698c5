"""Per-token log-probabilities in the OpenAI response shapes.

A token's log-probability is its confidence when it was written (committed, or rewritten in edit
mode): the model's probability of that token at that step, given the context visible then. In
block diffusion that context is the prompt plus the block's partly unmasked tokens, not every
earlier token as in an autoregressive model. Token texts come from incremental detokenization,
so they concatenate to the choice's text (a multi-byte character split over tokens belongs to
the token that completes it).
"""

from __future__ import annotations

from collections.abc import Sequence

from mbd_jax.detokenizer import IncrementalDetokenizer
from mbd_jax.tokenizer import Tokenizer


class TokenLogprobs:
    """One choice's tokens as they arrive; `block` gives each arriving block's logprobs object."""

    def __init__(self, tokenizer: Tokenizer, chat_format: bool):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._chat = chat_format
        self._offset = 0  # characters of the completion before the next token

    def block(self, ids: Sequence[int], logprobs: Sequence[float], last: bool = False) -> dict:
        texts = [self._detok.push([t]) for t in ids]
        if last and texts:
            texts[-1] += self._detok.finish()
        if self._chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                                 "top_logprobs": []} for s, lp in zip(texts, logprobs)]}
        offsets = []
        for s in texts:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": None,
                "text_offset": offsets}
