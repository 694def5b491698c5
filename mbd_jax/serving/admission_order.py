"""Which waiting requests an engine step is offered, in what order (`scheduler:` in the serve
config). The engine admits the longest prefix of the offer that fits its rows and KV pages, so
the order is the policy:

- fifo: normal requests in arrival order, then thinking ones within their row cap. Under steady
  normal load a thinking request may wait until its queue timeout.
- dynamic: every request that has waited `max_wait_ms` (at most half the queue timeout) first,
  oldest first, thinking or not; then the oldest other request and those of its length class
  (prompts under `min_segment_len` tokens are one class: short segments merged into the same
  prefill calls; longer ones by prefill bucket, block_size * 2^k), then the rest by age. Rows
  admitted together then pad their shared prefill calls less, and grouping never holds a
  request back past its wait limit.

Pure functions of the queues: tested by simulation (tests/test_admission_order.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from mbd_jax.config import SchedulerConfig


class Waiting(Protocol):
    prompt: Sequence[int]
    arrived: float  # time.monotonic() when it arrived
    thinking: bool


def length_class(tokens: int, min_segment_len: int) -> int:
    """0 for a short segment (< min_segment_len tokens); else 1 + log2 of its size in units of
    min_segment_len, rounded up (the prefill buckets' doubling)."""
    if tokens < min_segment_len:
        return 0
    return 1 + math.ceil(math.log2(tokens / min_segment_len))


def offer(normal: Sequence[Waiting], thinking: Sequence[Waiting], free: int, thinking_room: int,
          cfg: SchedulerConfig, queue_timeout_s: float, now: float) -> list[Waiting]:
    """At most `free` requests (`thinking_room` of them thinking) for the engine to admit, in
    the order it should try them. `normal` and `thinking` are the queues (any iterables, such
    as deques), oldest first."""
    if free <= 0:  # no row to fill: nothing to order (the engine steps its running rows)
        return []
    if cfg.type == "fifo":
        return list(normal)[:free] + list(thinking)[: max(0, min(thinking_room, free))]
    waiting = sorted([*normal, *thinking], key=lambda r: r.arrived)
    patience = min(cfg.max_wait_ms / 1e3, queue_timeout_s / 2)
    aged = [r for r in waiting if now - r.arrived >= patience]
    rest = [r for r in waiting if now - r.arrived < patience]
    if rest:
        anchor = length_class(len(rest[0].prompt), cfg.min_segment_len)
        rest.sort(key=lambda r: (length_class(len(r.prompt), cfg.min_segment_len) != anchor,
                                 r.arrived))
    out: list[Waiting] = []
    for r in [*aged, *rest]:
        if len(out) == free:
            break
        if r.thinking:
            if thinking_room <= 0:
                continue
            thinking_room -= 1
        out.append(r)
    return out
