"""The model's cache: the collection of the cache kinds its layer types keep
(model/layer_types.py), one entry per layer type present, each over every layer of that type.

A cache kind is a flax struct with

- `positional` (a class constant), `allocate(cfg, layers, batch, capacity, pages, dtype,
  stacked)`, `logical_axes(cfg, layers, stacked)` (a tree shaped like it whose leaves name each
  axis: the mesh rules shard the cache from it) and `nbytes()`;
- positional kinds (entries per position, in the engine's pages; model/paged_kv.py):
  `entry_shape(cfg, layers, tokens)`, `join(entries, tokens)`, `gather(rows, starts, tokens)`,
  `load(entries, row, start)`, `with_table(table)`, `table`, `dtype`;
- snapshot kinds (one state per row, after its committed positions; model/recurrent_state.py):
  `snapshot_size(cfg, layers)`, `snapshot(rows) -> [n, size] float32`, `restore(entry, row)`;

and whatever its mixer reads and writes inside the model (each layer's mixer gets its type's
instance, `entries[type]`, and its index among the layers of that type, `slot(layer)`, and hands
the instance back: `with_entry`).

Outside the model (the engine, the offloader, the prefix store, the mesh rules) the cache is this
class alone, with two families of host entries:

- blocks: the positional kind's entries for `tokens` consecutive positions of one row
  (`block_shape`, `gather`, `join`, `load`); a model without a positional kind has empty ones
  ([0, tokens]), which still mark a block as stored. At most one positional kind per model: they
  would share the page table and the block entries;
- snapshots: every snapshot kind's state of one row at its committed boundary, side by side in
  one float32 vector (`snapshot_shape`, None without snapshot kinds; `gather_snapshots`,
  `load_snapshot`). A pool page holds no snapshot, so the engine shares no pages for such a model.

A new layer type adds its kind and touches nothing outside the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.config import ModelConfig
from mbd_jax.model import layout
from mbd_jax.model.layer_types import LAYER_TYPES


def _layer_counts(cfg: ModelConfig) -> dict[str, int]:
    """Layers of each type, in the order the types first appear."""
    counts: dict[str, int] = {}
    for i in range(cfg.num_layers):
        counts[cfg.layer_type(i)] = counts.get(cfg.layer_type(i), 0) + 1
    return counts


def _slots(cfg: ModelConfig) -> tuple[int, ...]:
    """Each layer's index among the layers of its type."""
    seen: dict[str, int] = {}
    out = []
    for i in range(cfg.num_layers):
        out.append(seen.get(cfg.layer_type(i), 0))
        seen[cfg.layer_type(i)] = out[-1] + 1
    return tuple(out)


def _positional(cfg: ModelConfig) -> tuple[str, Any, int] | None:
    """(layer type, kind, layers) of the model's positional kind; None without one."""
    found = [(name, LAYER_TYPES[name].cache, n) for name, n in _layer_counts(cfg).items()
             if LAYER_TYPES[name].cache.positional]
    if len(found) > 1:
        raise ValueError(f"layer types {[f[0] for f in found]} all keep positional caches; a "
                         f"model has at most one (they would share the page table)")
    return found[0] if found else None


def _snapshots(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(layer type, floats per row) of each snapshot kind, in the order snapshots lay them out."""
    return tuple((name, LAYER_TYPES[name].cache.snapshot_size(cfg, n))
                 for name, n in sorted(_layer_counts(cfg).items())
                 if not LAYER_TYPES[name].cache.positional)


@flax.struct.dataclass
class ModelCache:
    entries: dict[str, Any]  # layer type -> its kind's cache over the layers of that type
    slots: tuple[int, ...] = flax.struct.field(pytree_node=False)  # per layer: index in its type
    snapshots: tuple[tuple[str, int], ...] = flax.struct.field(pytree_node=False)  # _snapshots

    # ------------------------------------------------------------ geometry
    @staticmethod
    def page_size(cfg: ModelConfig) -> int:
        """Positions per page: one attention chunk."""
        return cfg.attention_chunk

    @classmethod
    def capacity_for(cls, cfg: ModelConfig, max_write: int) -> int:
        """A row's positions: [0, max_seq_len) plus `max_write` (the longest write a forward
        makes, which may start at the last position), rounded up to whole pages so chunk
        reads never clamp."""
        need, page = cfg.max_seq_len + max_write, cls.page_size(cfg)
        return -(-need // page) * page

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, capacity: int, pages: int | None = None,
                 dtype=None) -> ModelCache:
        """Zero entries of every layer type for `batch` rows of `capacity` positions in `pages`
        pages (default batch x capacity / page: every row can hold `capacity` positions at
        once), in the form `cfg`'s layer loop reads (model/layout.py)."""
        page = cls.page_size(cfg)
        if capacity % page:
            raise ValueError(f"KV capacity {capacity} must be a multiple of the page size "
                             f"(attention_chunk) {page}")
        pages = batch * (capacity // page) if pages is None else pages
        dtype, stacked = jnp.dtype(dtype or cfg.compute_dtype), layout.scanned(cfg)
        return cls(entries={name: LAYER_TYPES[name].cache.allocate(cfg, n, batch, capacity, pages,
                                                                   dtype, stacked)
                            for name, n in _layer_counts(cfg).items()},
                   slots=_slots(cfg), snapshots=_snapshots(cfg))

    @classmethod
    def logical_axes(cls, cfg: ModelConfig) -> ModelCache:
        """The cache's tree with each leaf's logical axis names (parallel/mesh.py's rules)."""
        stacked = layout.scanned(cfg)
        return cls(entries={name: LAYER_TYPES[name].cache.logical_axes(cfg, n, stacked)
                            for name, n in _layer_counts(cfg).items()},
                   slots=_slots(cfg), snapshots=_snapshots(cfg))

    @property
    def positional(self) -> Any | None:
        """The positional kind's cache (attention's paged KV), None without one."""
        found = [e for e in self.entries.values() if e.positional]
        return found[0] if found else None

    @property
    def table(self) -> jax.Array | None:
        """The page table ([B, capacity / page] int32), None without a positional kind."""
        return None if self.positional is None else self.positional.table

    def with_table(self, table: jax.Array) -> ModelCache:
        """The same cache read through another page table."""
        return self.replace(entries={name: e.with_table(table) if e.positional else e
                                     for name, e in self.entries.items()})

    def nbytes(self) -> int:
        """Bytes of every kind's entries (the page table is not counted)."""
        return sum(e.nbytes() for e in self.entries.values())

    # ------------------------------------------------------------ blocks
    @classmethod
    def block_shape(cls, cfg: ModelConfig, tokens: int) -> tuple[int, ...]:
        """One row's entries for `tokens` consecutive positions."""
        found = _positional(cfg)
        return (0, tokens) if found is None else found[1].entry_shape(cfg, found[2], tokens)

    @property
    def block_dtype(self) -> Any:
        return jnp.float32 if self.positional is None else self.positional.entry_dtype

    @classmethod
    def join(cls, cfg: ModelConfig, entries: Sequence[np.ndarray], tokens: int) -> np.ndarray:
        """Host block entries of consecutive spans as one span of `tokens` positions (zeros
        after them): what `load` takes for a run of stored blocks."""
        found = _positional(cfg)
        if found is None:
            return np.zeros((0, tokens), entries[0].dtype if entries else np.float32)
        return found[1].join(entries, tokens)

    def gather(self, rows: jax.Array, starts: jax.Array, tokens: int) -> jax.Array:
        """The entries of n spans: span i is positions [starts[i], starts[i] + tokens) of row
        rows[i]. Returns [n, *block_shape(cfg, tokens)]."""
        if self.positional is None:
            return jnp.zeros((len(rows), 0, tokens), jnp.float32)
        return self.positional.gather(rows, starts, tokens)

    def load(self, entries: jax.Array, row: jax.Array, start: jax.Array) -> ModelCache:
        """Puts one row's block entries (block_shape(cfg, T)) at positions [start, start + T)."""
        return self.replace(entries={name: e.load(entries, row, start) if e.positional else e
                                     for name, e in self.entries.items()})

    # ------------------------------------------------------------ snapshots
    @classmethod
    def snapshot_shape(cls, cfg: ModelConfig) -> tuple[int, ...] | None:
        """One row's snapshot, [every snapshot kind's floats] float32; None without snapshot
        kinds."""
        sizes = _snapshots(cfg)
        return (sum(size for _, size in sizes),) if sizes else None

    def gather_snapshots(self, rows: jax.Array) -> jax.Array:
        """Rows `rows`' ([n]) snapshots: [n, *snapshot_shape(cfg)] float32."""
        return jnp.concatenate([self.entries[name].snapshot(rows) for name, _ in self.snapshots],
                               axis=1)

    def load_snapshot(self, entry: jax.Array, row: jax.Array) -> ModelCache:
        """Row `row` takes the snapshot `entry` ([*snapshot_shape(cfg)]) as its states."""
        entries, at = dict(self.entries), 0
        for name, size in self.snapshots:
            entries[name] = entries[name].restore(entry[at: at + size], row)
            at += size
        return self.replace(entries=entries)

    # ------------------------------------------------------------ inside the model
    def slot(self, layer):
        """Layer `layer`'s (an int, or traced when scanned) index among its type's layers."""
        if isinstance(layer, int):
            return self.slots[layer]
        if self.slots == tuple(range(len(self.slots))):  # one layer type: the layer itself
            return layer
        return jnp.asarray(self.slots, jnp.int32)[layer]

    def with_entry(self, layer_type: str, entry: Any) -> ModelCache:
        return self.replace(entries={**self.entries, layer_type: entry})
