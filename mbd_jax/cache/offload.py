"""Double-buffered device-to-host persistence of committed KV blocks.

After every call that commits blocks (each decode call; a hybrid's prefill rounds) the engine
thread calls `after_commit`:

  1. it picks the blocks committed since the last call (at most `max_blocks` per call; the rest
     wait for the next call), keys them by their tokens, and gathers their KV on device into
     staging buffer s (of two; the buffer is donated, so the gather writes in place) and starts
     its device-to-host copy (`copy_to_host_async`);
  2. it hands the *other* staging buffer, filled one call earlier, to the drain thread. Its copy
     overlapped with the decode call that ran in between, so the drain thread (np.asarray, then
     the store's RAM and disk tiers) finds it ready.

A hybrid model's rows also stage a snapshot of their recurrent state (the one after their
committed blocks: a row has no other) when a prefill round or the call that finished the row
stages their blocks up to that boundary, into a second buffer of one snapshot per row that
travels with the first (`states`). Not after every decode call: at the tiny hybrid's sizes that
cost 6% of decode tokens/s (docs/lab/performance-history.md), and the boundaries a later prompt can hit are
where a prompt's chunks and a reply end.

When the engine goes idle (`idle`), the last staged buffer is handed over at once: no later call
would. The engine thread never waits: when the drain thread is still busy with the buffer the engine
would fill next, the call stages nothing (`deferred_calls`) and its blocks wait for a later call;
the store's own disk writes run on its writer thread. `blocking_waits` stays 0 for decode
calls (kept as a metric, so a regression shows); only a hybrid's prefill rounds wait, rather than
lose the state snapshot of their boundary. Transfers are issued only from the engine thread.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mbd_jax.cache.prefix_store import PrefixStore, state_key


@dataclasses.dataclass
class OffloadProgress:
    """One row's persistence so far (kept in the row's record, engine/rows.py)."""

    blocks: int = 0  # its leading committed blocks already staged (or already in the store)
    keys: list[str] = dataclasses.field(default_factory=list)  # its blocks' chained keys so far


@dataclasses.dataclass
class _Staged:
    call: int  # the decode call whose committed blocks it holds
    buffer: jax.Array | None  # [max_blocks, L, 2, blk, K, Dh] on device, host copy under way
    # (None: the call staged state snapshots only)
    keys: list[str]  # one per used slot
    states: jax.Array | None = None  # [B, *state entry] on device (hybrids), copy under way
    state_keys: list[str] = dataclasses.field(default_factory=list)  # one per used state slot
    handed: bool = False  # given to the drain thread
    drained: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class OffloadStats:
    staged_blocks: int = 0
    drained_blocks: int = 0
    staged_states: int = 0  # hybrids: recurrent state snapshots (drained with their buffer)
    blocking_waits: int = 0  # the engine thread waited for the drain thread (a hybrid's prefill only)
    deferred_calls: int = 0  # calls that staged nothing: both buffers were still being drained
    drains_not_ready: int = 0  # the drain thread found a copy still in flight
    settle_waits: int = 0  # lookups that waited for a staged buffer holding blocks they asked for
    queue_depth: int = 0  # staged buffers not yet drained


class KVOffloader:
    def __init__(self, store: PrefixStore, gather: Callable[..., jax.Array], empty: Callable[[], jax.Array],
                 max_blocks: int,
                 states: tuple[Callable[..., jax.Array], Callable[[], jax.Array]] | None = None):
        """gather(staging, kv, rows[n], starts[n]) -> staging (jitted, staging donated);
        empty() -> a zero staging buffer; `states` (a model with recurrent state):
        (gather_snapshots(staging, kv, rows[B]) -> staging, empty_snapshots()) for the state
        snapshots."""
        self.store = store
        self.block_size = store.block_size
        self.max_blocks = max_blocks
        self._gather = gather
        self._buffers = [empty(), empty()]
        self._gather_states = states[0] if states is not None else None
        self._state_buffers = [states[1](), states[1]()] if states is not None else [None, None]
        self._staged: list[_Staged | None] = [None, None]
        self._next = 0  # the staging buffer the next call fills
        self._last: _Staged | None = None  # the most recently staged
        self._calls = 0
        self.stats = OffloadStats()
        # (what, call, time) of the latest events: the overlap timeline (tests, debugging)
        self.events: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=4096)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: list[_Staged] = []
        self._closed = False
        self._thread = threading.Thread(target=self._drain_loop, name="kv-offload", daemon=True)
        self._thread.start()

    def _event(self, what: str, call: int) -> None:
        self.events.append((what, call, time.perf_counter()))

    def warmup(self, kv: Any) -> None:
        """Compiles the gather (engine warm-up)."""
        idx = np.zeros(self.max_blocks, np.int32)
        self._buffers[0] = self._gather(self._buffers[0], kv, idx, idx)
        jax.block_until_ready(self._buffers[0])
        if self._gather_states is not None:
            rows = np.zeros(self._state_buffers[0].shape[0], np.int32)
            self._state_buffers[0] = self._gather_states(self._state_buffers[0], kv, rows)
            jax.block_until_ready(self._state_buffers[0])

    def decode_issued(self) -> None:
        """The engine dispatched a decode call (for the overlap timeline)."""
        self._event("decode", self._calls)

    def after_commit(self, kv: Any, cached_len: np.ndarray, canvas: np.ndarray,
                     progress: Sequence[OffloadProgress | None],
                     finished: np.ndarray | None = None, prefill: bool = False) -> None:
        """Engine thread, right after a call that committed blocks (a decode call; a hybrid's
        prefill round, `prefill`): stage the blocks each row committed since its `progress`
        (advanced here; None: a free row, or one whose blocks are not persisted), then hand
        the previous staging buffer to the drain thread. A hybrid's state
        snapshots: every row of a prefill round, the `finished` rows ([B] bool) of a decode
        call. A prefill round waits for a staging buffer when both are still draining (counted
        in blocking_waits) instead of deferring: a later call could not take its snapshots."""
        self._calls += 1
        prev = self._last  # staged after the previous call: its copy overlapped this call
        if prev is not None and not prev.handed:
            self._hand_over(prev)
        old = self._staged[self._next]
        if old is not None and not old.drained.is_set():  # the drain thread still reads it
            if not prefill:
                self.stats.deferred_calls += 1  # this call's blocks wait for a later call
                return
            self.stats.blocking_waits += 1
            old.drained.wait()  # handed over already: it was staged before the last staging
        rows, starts, keys = [], [], []
        state_rows, state_keys = [], []
        # the rows that finished first: their blocks get no later call (the row is released)
        order = range(len(progress)) if finished is None else np.argsort(~finished, kind="stable")
        for row in map(int, order):
            done = progress[row]
            done_blocks = int(cached_len[row]) // self.block_size
            if done is None or done_blocks <= done.blocks:
                continue
            first = done.blocks
            row_keys = done.keys = self.store.keys(canvas[row, : done_blocks * self.block_size],
                                                    done.keys)
            take = min(done_blocks, first + self.max_blocks - len(rows))
            for b in range(first, take):
                if row_keys[b] in self.store:  # e.g. blocks another request already stored
                    continue
                rows.append(row)
                starts.append(b * self.block_size)
                keys.append(row_keys[b])
            done.blocks = take
            # the row's state is the one after its committed blocks: a snapshot of the boundary
            # this call stages up to, when that is where its blocks end (prompts, replies)
            if (self._gather_states is not None and take == done_blocks
                    and (prefill or (finished is not None and finished[row]))
                    and state_key(row_keys[take - 1]) not in self.store):
                state_rows.append(row)
                state_keys.append(state_key(row_keys[take - 1]))
            if len(rows) == self.max_blocks:
                break
        if rows or state_rows:
            self._stage(rows, starts, keys, kv, state_rows, state_keys)

    def _stage(self, rows: list[int], starts: list[int], keys: list[str], kv: Any,
               state_rows: list[int], state_keys: list[str]) -> None:
        s = self._next
        buf = None
        if rows:  # a call may stage only state snapshots (its blocks were stored already)
            pad = self.max_blocks - len(rows)
            buf = self._gather(self._buffers[s], kv, np.array(rows + [0] * pad, np.int32),
                               np.array(starts + [0] * pad, np.int32))
            buf.copy_to_host_async()
            self._buffers[s] = buf
        states = None
        if state_rows:
            states = self._state_buffers[s]
            pad = states.shape[0] - len(state_rows)
            states = self._gather_states(states, kv, np.array(state_rows + [0] * pad, np.int32))
            states.copy_to_host_async()
            self._state_buffers[s] = states
        self._staged[s] = self._last = _Staged(self._calls, buf, keys, states, state_keys)
        self._event("staged", self._calls)
        self.stats.staged_blocks += len(keys)
        self.stats.staged_states += len(state_keys)
        self._next = 1 - s

    def settle(self, keys: set[str]) -> bool:
        """Engine thread, before a prefix lookup: a staging buffer that holds any of `keys`
        (blocks or state snapshots that recent calls committed and the store does not hold yet)
        is handed to the drain thread now if it was not, and waited for, so the lookup finds
        what this engine already computed whatever the drain thread's timing. Returns whether
        it waited (counted in settle_waits)."""
        waited = False
        for staged in sorted((s for s in self._staged if s is not None), key=lambda s: s.call):
            if staged.drained.is_set() or (keys.isdisjoint(staged.keys)
                                           and keys.isdisjoint(staged.state_keys)):
                continue
            if not staged.handed:
                self._hand_over(staged)
            staged.drained.wait()
            waited = True
        self.stats.settle_waits += waited
        return waited

    def idle(self) -> None:
        """Engine thread, when no decode call follows for now (the batch ended, no row runs):
        hands the last staged buffer to the drain thread at once instead of at the next call,
        so a prompt sent again right after an idle reply finds its blocks in the store."""
        if self._last is not None and not self._last.handed:
            self._event("idle", self._calls)
            self._hand_over(self._last)

    def _hand_over(self, staged: _Staged) -> None:
        staged.handed = True
        with self._work:
            self._queue.append(staged)
            self.stats.queue_depth = len(self._queue)
            self._work.notify()

    def flush(self) -> None:
        """Hands over and drains everything staged, and waits for the store's disk writes
        (tests, shutdown)."""
        for staged in self._staged:
            if staged is not None and not staged.drained.is_set():
                if not staged.handed:
                    self._hand_over(staged)
                staged.drained.wait()
        self.store.flush()

    def close(self) -> None:
        self.flush()
        with self._work:
            self._closed = True
            self._work.notify()
        self._thread.join(timeout=10)
        self.store.close()

    def _drain_loop(self) -> None:
        while True:
            with self._work:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed and not self._queue:
                    return
                staged = self._queue[0]
            self._event("drain", staged.call)
            copies = [b for b in (staged.buffer, staged.states) if b is not None]
            if not all(b.is_ready() for b in copies):
                self.stats.drains_not_ready += 1
            if staged.keys:
                host = np.asarray(staged.buffer)
                for i, key in enumerate(staged.keys):
                    self.store.put(key, host[i].copy())
            if staged.state_keys:
                snapshots = np.asarray(staged.states)
                for i, key in enumerate(staged.state_keys):
                    self.store.put(key, snapshots[i].copy())
            self.stats.drained_blocks += len(staged.keys)
            with self._work:
                self._queue.pop(0)
                self.stats.queue_depth = len(self._queue)
            staged.drained.set()
