"""The engine's prefix-cache glue: stored leading blocks of a prompt looked up, sent to the
device and loaded into the admitted row; committed blocks staged for the store after each decode
call (cache/offload.py, double-buffered). Reaches the cache only through the model's cache
interface (model/cache.py: block entries, and snapshots for a model with recurrent state)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mbd_jax.cache.offload import KVOffloader
from mbd_jax.cache.prefix_store import PrefixStore, state_key
from mbd_jax.config import ModelConfig
from mbd_jax.engine.programs import PrefixPrograms
from mbd_jax.errors import UserError
from mbd_jax.model.cache import ModelCache


@dataclasses.dataclass
class PrefixHit:
    """A prompt's leading blocks found in the prefix store, already on their way to the device."""

    after: int  # the store's blocks start here (the positions before it are the pool's pages)
    tokens: int  # prompt positions [0, tokens) are covered (`after`: nothing found)
    chunks: list[tuple[int, jax.Array]]  # (start, cache entries of T positions), T a prefill bucket
    asked: int = 0  # blocks looked up (found: (tokens - after) / block size)
    snapshot: jax.Array | None = None  # the rows' states after the found blocks (snapshot kinds)


class PrefixGlue:
    def __init__(self, store: PrefixStore, cfg: ModelConfig, dtype: Any, progs: PrefixPrograms, put: Callable[[np.ndarray], jax.Array],
                 blocks_per_call: int, bucket_of: Callable[[int], int]):
        """`dtype`: the cache's block entries'; `progs`: the jitted loads and
        gathers (programs.py); `put`: a host array onto the mesh; `bucket_of`: the prefill
        bucket of a token count (at most the longest one compiled so far)."""
        if store.block_size != cfg.block_size:
            raise UserError(f"prefix store block size {store.block_size} != the model's "
                            f"{cfg.block_size}")
        if jax.process_count() > 1:
            raise UserError("the prefix cache runs on one process; disable cache.enabled for "
                            "a multi-process launch")
        self.store, self.cfg = store, cfg
        self._put, self._bucket_of = put, bucket_of
        self.dtype = dtype
        store.expect(ModelCache.block_shape(cfg, cfg.block_size), self.dtype)  # one block's
        self._load, self._load_snapshot = progs.load, progs.load_snapshot
        # A model with recurrent state also needs its rows' states at the boundary a hit ends
        # on: the store keeps snapshots beside the blocks (one per row and staging, at most).
        snapshot = ModelCache.snapshot_shape(cfg)
        self.snapshots = snapshot is not None
        if self.snapshots:
            store.expect(snapshot, np.float32, kind="state")
        states = (progs.gather_snapshots, progs.empty_snapshots) if self.snapshots else None
        self.offloader = KVOffloader(store, progs.gather, progs.empty,
                                     blocks_per_call, states)

    def prefetch(self, prompt: Sequence[int], after: int = 0) -> PrefixHit:
        """Looks a prompt's leading full blocks up and starts the transfer of those from position
        `after` on (a multiple of the block size: what the KV pool already maps) to the device.
        Not counted in the store's stats: `load` counts the lookup it uses."""
        blk = self.cfg.block_size
        first, last = after // blk, len(prompt) // blk
        # blocks (and snapshots) this engine committed lately may still be on their
        # way to the store: the lookup waits for them rather than miss them
        keys = self.store.keys(np.asarray(prompt[: last * blk]))
        wanted = set(keys)
        if self.snapshots:
            wanted |= {state_key(k) for k in keys}
        self.offloader.settle(wanted)
        state = None
        if self.snapshots:
            # From the first block (the pool shares no pages for such a model: they hold no
            # state) to the last one found that has a snapshot.
            if after:
                raise ValueError(f"a prefix lookup with snapshots starts at 0, not {after}")
            entries, state = self.store.lookup_with_state(prompt, max_blocks=last, count=False,
                                                          known=keys)
        else:
            entries = self.store.lookup(prompt, max_blocks=last, first=first, count=False,
                                        known=keys)
        # blocks per load: the whole prompt's bucket, or the longest bucket compiled so far
        per_chunk = self._bucket_of(len(prompt)) // blk
        chunks = []
        for start in range(0, len(entries), per_chunk):
            part = entries[start: start + per_chunk]
            span = ModelCache.join(self.cfg, part, self._bucket_of(len(part) * blk))  # a bucket
            chunks.append((after + start * blk, self._put(span)))
        return PrefixHit(after=after, tokens=after + len(entries) * blk, chunks=chunks,
                         asked=max(last - first, 0),
                         snapshot=None if state is None else self._put(state))

    def load(self, kv: Any, row: int, prompt: np.ndarray, hit: PrefixHit | None,
             after: int = 0) -> tuple[Any, int]:
        """Copies the prompt's stored blocks from position `after` on into `row` (looked up now
        unless `hit` was prefetched from the same position); returns the buffer and how many
        prompt tokens the row then holds. Positions below `after` are the pool's shared prefix
        pages: their blocks were persisted when first prefilled, and nothing is written there.
        The lookup used is the one counted in the store's stats, once."""
        if hit is None or hit.after != after:  # the pool changed while the request waited
            hit = self.prefetch(prompt, after)
        found = (hit.tokens - hit.after) // self.cfg.block_size
        self.store.record(found, hit.asked - found)
        for chunk_start, blocks in hit.chunks:
            kv = self._load(kv, blocks, np.int32(row), np.int32(chunk_start))
        if hit.snapshot is not None:
            kv = self._load_snapshot(kv, hit.snapshot, np.int32(row))
        return kv, hit.tokens

    def warm_load(self, kv: Any, tokens: int) -> Any:
        """Compiles loading `tokens` cached positions (a bucket) into a row (row 0, before any
        request)."""
        entries = np.zeros(ModelCache.block_shape(self.cfg, tokens), self.dtype)
        kv = self._load(kv, self._put(entries), np.int32(0), np.int32(0))
        if self.snapshots:
            snapshot = np.zeros(ModelCache.snapshot_shape(self.cfg), np.float32)
            kv = self._load_snapshot(kv, self._put(snapshot), np.int32(0))
        return kv

    def compile_load(self, compile: Callable[..., None], kv: Any, tokens: int) -> None:
        """Compiles (Runner.compile) loading `tokens` cached positions into a row of a cache
        shaped like `kv`, without running it (a background warm-up's bucket)."""
        entries = np.zeros(ModelCache.block_shape(self.cfg, tokens), self.dtype)  # never touched
        compile(self._load, kv, entries, np.int32(0), np.int32(0))
