"""The engine's rows: what a driver asks for (`EngineRequest`), the one record the engine keeps per
busy row (`Row`, in the `RowTable`), and what one `Engine.step()` reports (`StepOutcome` with a
`RowEvent` per row that committed tokens or finished).

A driver (offline `generate`, the service's scheduler) hands `step()` the requests it would like
started, in order; the step takes the longest prefix of them that fits (free rows, free KV
pages, the shared-prefix rule) and says which it took. Everything the host knows about a
running request lives in its row's record, nowhere else.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mbd_jax.cache.offload import OffloadProgress
from mbd_jax.config import DecodeConfig
from mbd_jax.engine.prefix import PrefixHit
from mbd_jax.engine.results import GenerationResult
from mbd_jax.grammar.row import RowGrammar


@dataclasses.dataclass(eq=False)
class EngineRequest:
    """One generation a driver asks for. `tag` is the driver's own handle, carried through."""

    prompt: Sequence[int]
    decode: DecodeConfig
    id: int = dataclasses.field(default_factory=itertools.count().__next__)  # unique in a process
    logprobs: bool = False  # events and the result carry each token's log-probability
    stream: bool = True  # an event per decode call with new tokens (else only when it finishes)
    persist: bool = True  # with a prefix store, its committed blocks go there
    tag: Any = None
    prefix: PrefixHit | None = None  # a prefix-store hit prefetched while it waited
    prefetched: bool = False  # `prefix` was looked up (it may be None: nothing to prefetch)
    cached_tokens: int = 0  # set at admission: prompt tokens served from the prefix cache


@dataclasses.dataclass(eq=False)
class Row:
    """A busy row: its request and everything the host tracks for it."""

    request: EngineRequest
    pages: list[int] = dataclasses.field(default_factory=list)  # KV pool pages held, in order
    page_keys: list[bytes] = dataclasses.field(default_factory=list)  # its prompt pages' prefix
    # keys (pages.py), indexed in the pool once its prefill is done
    prefill_end: int = 0  # prompt positions [0, prefill_end) are prefilled: its full blocks
    prefilled: int = 0  # prompt positions [0, prefilled) are in the KV pool so far
    offload: OffloadProgress | None = None  # its blocks handed to the prefix store (None: not
    # persisted: no store, or the request asked not to)
    started: float = dataclasses.field(default_factory=time.monotonic)
    prefilling: bool = True  # its admission's prefill is not finished (not decoding yet)
    emitted: int = 0  # generated tokens handed out in events
    ending: str | None = None  # "cancel" (free it, no result) or "stop" (finish it as stopped)
    grammar: RowGrammar | None = None  # a constrained request's matcher and gate
    prompt: np.ndarray = dataclasses.field(init=False)  # request.prompt as int32, made once

    def __post_init__(self) -> None:
        self.prompt = np.asarray(self.request.prompt, np.int32)


@dataclasses.dataclass
class RowEvent:
    """A row's news after a decode call: tokens committed since its last event (final: they never
    change), and whether it finished; `result()` builds the finished row's result (voting may take
    a while: run it where it suits)."""

    request: EngineRequest
    tokens: list[int]
    logprobs: list[float] | None
    finished: bool = False
    result: Callable[[], GenerationResult] | None = None


@dataclasses.dataclass
class StepOutcome:
    """What one step did."""

    admitted: list[EngineRequest] = dataclasses.field(default_factory=list)
    events: list[RowEvent] = dataclasses.field(default_factory=list)
    decoded: bool = False  # a decode call ran and succeeded
    error: Exception | None = None  # the step failed; `failed` lists the requests it took down
    failed: list[EngineRequest] = dataclasses.field(default_factory=list)
    decode_failed: bool = False  # the failure was a decode call's (the whole batch's)


class RowTable:
    """Row index -> Row for the busy rows of an engine of `size` rows."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rows: dict[int, Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, index: int) -> bool:
        return index in self._rows

    def __getitem__(self, index: int) -> Row:
        return self._rows[index]

    def items(self) -> Iterator[tuple[int, Row]]:
        return iter(sorted(self._rows.items()))

    def free(self) -> list[int]:
        return [i for i in range(self.size) if i not in self._rows]

    def add(self, index: int, row: Row) -> None:
        if index in self._rows:
            raise RuntimeError(f"row {index} is busy")
        self._rows[index] = row

    def pop(self, index: int) -> Row:
        return self._rows.pop(index)

    def find(self, request: EngineRequest) -> int | None:
        """The row running `request` (matched by id: a follower process holds copies)."""
        return next((i for i, r in self._rows.items() if r.request.id == request.id), None)

    def decoding(self) -> list[int]:
        return [i for i, r in sorted(self._rows.items()) if not r.prefilling]

    def prefilling(self) -> list[int]:
        return [i for i, r in sorted(self._rows.items()) if r.prefilling]
