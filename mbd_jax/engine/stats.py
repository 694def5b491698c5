"""One snapshot of what an engine holds and has done: what metrics, benchmarks and tools read
(`Engine.stats()`), so none of them reaches into the engine's parts."""

from __future__ import annotations

import dataclasses

from mbd_jax.cache.offload import OffloadStats
from mbd_jax.cache.prefix_store import StoreStats

RECENT_CALLS = 1024  # decode calls whose (seconds, steps) a snapshot carries


@dataclasses.dataclass(frozen=True)
class EngineStats:
    rows: int  # the engine's batch size
    kv_bytes: int  # the KV pool's device bytes (the page table not counted)
    page_size: int  # positions per KV page
    pages: int  # KV pool pages, and how they are used now:
    pages_in_use: int  # held by some row
    pages_free: int  # a reservation may take them (free, or cached prefix pages no row holds)
    pages_cached: int  # prefix pages no row holds, still indexed
    pool_hit_tokens: int  # prompt tokens mapped from shared prefix pages in the pool
    prefix_hit_tokens: int  # prompt tokens not prefilled: the pool's pages or the prefix store
    prefill_seconds_per_token: float  # measured at warm-up (with a prefix store), else 0
    decode_calls: int  # decode calls since the engine was built
    decode_seconds: float  # wall time inside them: each waits for the device (and the prefill
    # calls dispatched before it), so its rate is the share of time the device is busy
    recent_calls: tuple[tuple[float, int], ...]  # (seconds, steps) of the latest, oldest first
    grammar_calls: int  # decode calls after which constrained rows' grammars ran (grammar/row.py)
    grammar_seconds: float  # host time of those grammar steps (fetch, matchers, write-back)
    store: StoreStats | None  # the prefix store's counters (None: no prefix cache)
    offload: OffloadStats | None  # the offloader's (None: no prefix cache)

    @property
    def kv_usage(self) -> float:
        """The share of the KV pool's pages rows hold."""
        return self.pages_in_use / self.pages

    def calls_since(self, earlier: EngineStats) -> tuple[tuple[float, int], ...]:
        """(seconds, steps) of the decode calls made after `earlier` was taken (at most
        RECENT_CALLS of them)."""
        n = self.decode_calls - earlier.decode_calls
        return self.recent_calls[len(self.recent_calls) - n:] if n else ()
