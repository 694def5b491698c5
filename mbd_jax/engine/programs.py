"""An engine's jitted programs, built once per process for each (model, mesh, shapes).

Every program here is a pure function of the model config, the mesh and the engine's static
shapes, never of an engine's state: two engines with the same key share the jitted functions,
so JAX's in-memory cache serves the second one (no tracing, no lowering, no compiling, not even
a read from the persistent cache). That is what an engine rebuilt in the same process (a fresh
pool, another test, a benchmark's next variant) costs: nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig
from mbd_jax.decoding import block_buffer, loop
from mbd_jax.decoding.block_buffer import DecodeState
from mbd_jax.engine import transfer
from mbd_jax.model import sharding
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.transformer import Transformer
from mbd_jax.parallel import mesh as meshlib

PROGRAM_SETS = 8  # distinct (model, mesh, shapes) keys kept per process, least recently used out


@dataclasses.dataclass(frozen=True)
class Programs:
    kv_sharding: Any  # the cache's shardings (a tree like the cache)
    allocate_kv: Callable  # () -> an empty cache
    prefill: Callable  # (params, kv, *host inputs) -> kv  (kv donated)
    decode: Callable  # (params, state, kv, max_steps) -> (state, kv, steps)  (state, kv donated)
    merge: Callable  # (old, new, rows [B] bool) -> old's rows replaced by new's where rows
    take_row: Callable  # (state, row) -> that row's state
    put_row: Callable  # (state, sub, row) -> state with row replaced by sub  (state donated)
    gate_view: Callable  # (state) -> (window [B, W], cached_len [B], done [B]): what grammars read
    set_gates: Callable  # (state, gate, allowed, clear, rows) -> state  (state donated)


def _merge_rows(old: DecodeState, new: DecodeState, rows: jax.Array) -> DecodeState:
    """Row b of the result is new's where rows[b], else old's (every leaf has batch first)."""
    def pick(a, b):
        return jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), b, a)

    return jax.tree.map(pick, old, new)


@functools.lru_cache(maxsize=PROGRAM_SETS)
def programs(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_size: int, capacity: int,
             n_pages: int, buffer_size: int, debug: bool) -> Programs:
    """The programs of an engine of `batch_size` rows, a cache of `capacity` positions per row
    in `n_pages` pages, and a compiled N_buf of `buffer_size`, on `mesh`."""
    replicated = meshlib.replicated(mesh)
    kv_sharding = sharding.cache_shardings(cfg, mesh, batch_size, capacity, n_pages)
    apply_fn = Transformer(cfg, mesh).apply
    return Programs(
        kv_sharding=kv_sharding,
        allocate_kv=jax.jit(lambda: ModelCache.allocate(cfg, batch_size, capacity, n_pages),
                            out_shardings=kv_sharding),
        prefill=jax.jit(functools.partial(loop.prefill, apply_fn=apply_fn),
                        donate_argnames=("kv",), out_shardings=kv_sharding),
        decode=jax.jit(functools.partial(loop.decode_loop, apply_fn=apply_fn, cfg=cfg,
                                         n_slots=buffer_size, debug=debug),
                       donate_argnames=("state", "kv"),
                       out_shardings=(replicated, kv_sharding, replicated)),
        merge=jax.jit(_merge_rows, donate_argnames=("old",), out_shardings=replicated),
        # One running row decodes alone: its state row taken out, decoded over its cache row
        # (ForwardMeta.rows), put back; the others would only be computed and discarded.
        take_row=jax.jit(lambda state, row: jax.tree.map(lambda a: a[row], state),
                         out_shardings=replicated),
        put_row=jax.jit(
            lambda state, sub, row: jax.tree.map(lambda a, b: a.at[row].set(b), state, sub),
            donate_argnums=0, out_shardings=replicated),
        # constrained rows, between decode calls (grammar/row.py)
        gate_view=jax.jit(lambda state: (block_buffer.window(state, buffer_size * cfg.block_size),
                                         state.cached_len, state.done),
                          out_shardings=replicated),
        set_gates=jax.jit(functools.partial(block_buffer.with_gates, block_size=cfg.block_size,
                                            n_slots=buffer_size, eos_ids=cfg.eos_token_ids,
                                            mask_token_id=cfg.mask_token_id),
                          donate_argnums=0, out_shardings=replicated),
    )


@dataclasses.dataclass(frozen=True)
class PrefixPrograms:
    """The prefix cache's programs (engine/prefix.py, cache/offload.py)."""

    load: Callable  # (kv, block entries [.., T, ..], row, start) -> kv  (kv donated)
    gather: Callable  # (staging, kv, rows [n], starts [n]) -> staging  (staging donated)
    empty: Callable  # () -> a zero staging buffer [blocks_per_call, *one block's entries]
    load_snapshot: Callable | None  # with snapshot kinds: (kv, snapshot, row) -> kv (donated)
    gather_snapshots: Callable | None  # with snapshot kinds: (staging, kv, rows [B]) -> staging
    empty_snapshots: Callable | None  # with snapshot kinds: () -> [B, *snapshot] zeros


@functools.lru_cache(maxsize=PROGRAM_SETS)
def prefix_programs(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_size: int, capacity: int,
                    n_pages: int, dtype: str, blocks_per_call: int) -> PrefixPrograms:
    """The prefix cache's programs for an engine of programs()' key, whose cache entries have
    `dtype` (a NumPy dtype name), staging `blocks_per_call` blocks per decode call."""
    replicated = meshlib.replicated(mesh)
    kv_sharding = sharding.cache_shardings(cfg, mesh, batch_size, capacity, n_pages)
    staging = (blocks_per_call, *ModelCache.block_shape(cfg, cfg.block_size))
    snapshot = ModelCache.snapshot_shape(cfg)
    snapshots = snapshot is not None
    return PrefixPrograms(
        load=jax.jit(lambda kv, entries, row, start: kv.load(entries, row, start),
                     donate_argnums=0, out_shardings=kv_sharding),
        gather=jax.jit(lambda staging, kv, rows, starts: kv.gather(rows, starts, cfg.block_size),
                       donate_argnums=0, out_shardings=replicated),
        empty=jax.jit(lambda: jnp.zeros(staging, dtype), out_shardings=replicated),
        load_snapshot=jax.jit(lambda kv, entry, row: kv.load_snapshot(entry, row),
                              donate_argnums=0, out_shardings=kv_sharding) if snapshots else None,
        gather_snapshots=jax.jit(lambda staging, kv, rows: kv.gather_snapshots(rows),
                                 donate_argnums=0, out_shardings=replicated) if snapshots else None,
        empty_snapshots=jax.jit(lambda: jnp.zeros((batch_size, *snapshot), jnp.float32),
                                out_shardings=replicated) if snapshots else None,
    )


def clear() -> None:
    """Forgets every shared program (and transfer.py's packers): the next engine builds and
    compiles its own, as in a fresh process (for tests that count compilations)."""
    programs.cache_clear()
    prefix_programs.cache_clear()
    transfer.clear()
