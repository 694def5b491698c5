"""One request of the service: its prompt and decoding, the engine's record of it, the asyncio
queue its events go to, and its streamed text (the detokenizer and stop strings live here, with
the request, not in the scheduler)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from mbd_jax.config import DecodeConfig
from mbd_jax.detokenizer import IncrementalDetokenizer
from mbd_jax.engine.rows import EngineRequest
from mbd_jax.stop_strings import StopStrings
from mbd_jax.tokenizer import Tokenizer


@dataclasses.dataclass(eq=False)
class Request:
    """One generation. Events on `events` (read by the HTTP handler, on its event loop):
    ("tokens", ids, text_delta, logprobs or None) for every committed block, then ("done",
    GenerationResult) or ("error", http_status, message)."""

    id: str
    prompt: list[int]
    decode: DecodeConfig
    loop: asyncio.AbstractEventLoop
    thinking: bool = False
    logprobs: bool = False  # report each token's log-probability
    stops: StopStrings | None = None  # stop strings: the row ends at the first one
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the HTTP side (client went away)
    started: float | None = None
    first_block: float | None = None
    last_block: float | None = None  # when its latest block was streamed
    sent_tokens: int = 0
    detokenizer: IncrementalDetokenizer | None = None  # the streamed text (engine thread)
    released: list[str] = dataclasses.field(default_factory=list)  # text sent (with stop strings)
    job: EngineRequest = dataclasses.field(init=False)  # what the engine runs

    def __post_init__(self) -> None:
        self.job = EngineRequest(self.prompt, self.decode, logprobs=self.logprobs, tag=self)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return self.job.cached_tokens

    @property
    def stopped(self) -> bool:
        return self.stops is not None and self.stops.stopped

    def push(self, tokens: list[int], tokenizer: Tokenizer | None, done: bool) -> str:
        """The text these newly committed tokens add (all of it held back by the detokenizer and
        the stop strings is released when `done`)."""
        text = ""
        if tokenizer is not None:
            self.detokenizer = self.detokenizer or IncrementalDetokenizer(tokenizer)
            text = self.detokenizer.push(tokens) + (self.detokenizer.finish() if done else "")
        if self.stops is not None:
            text = self.stops.push(text)
            if done:  # the held-back tail (or the text before a stop string it holds)
                text += self.stops.finish()
            self.released.append(text)
        return text

    def emit(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)
