"""The attention layers' cache kind: a paged KV pool (model/cache.py names the protocol every
cache kind follows; this is its positional kind).

Layout. Every attention layer has a pool of P pages of `page` positions ([P, page, K, Dh] for k
and for v); the page table ([B, capacity / page] int32) maps row b's logical page i (positions
[i * page, (i + 1) * page)) to a pool page. A table entry of P or more maps nothing: writes there
are dropped and reads give zeros (attention never reads past a row's visible length, and the
engine gives a row pages for every position it can write). A page is one attention chunk, so the
attention loop reads one page per row per step. The pool holds what requests need, not rows x
the longest context: memory follows the tokens in flight. The engine's page allocator
(engine/pages.py) decides which pool pages hold each row's positions and hands the table in
(`with_table`).

The pool comes in one of two forms the model's layer loop picks:

- unrolled layers: k and v are tuples of La arrays [P, page, K, Dh], one per attention layer;
- scanned layers: k and v are single [La, P, page, K, Dh] arrays (the scan carries them and
  indexes them with a traced slot).

XLA:CPU updates a per-layer array in place but copied the stacked one for every layer of an
unrolled forward (half the batch-16 decode speed, docs/lab/performance-history.md), hence two
forms. The pool is allocated once per engine and donated to every jitted call.

Entries (what the prefix store keeps per block): one row's k and v for T consecutive positions,
[La, 2, T, K, Dh] (`entry_shape`); `gather` takes them out for several (row, start) pairs at
once, `join` makes one span of consecutive stored ones, `load` puts a span into one row. Inside
the model an attention layer reads its pools (`layer(slot)`, `span`) and `write`s its new
entries, where `meta` (model/forward_meta.py) says which cache row each input row is, where its
new entries go and which rows store them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.config import ModelConfig
from mbd_jax.model.forward_meta import ForwardMeta

_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")  # of a stacked k or v
_TABLE_AXES = (None, None)  # the page table is replicated: every device reads every row's pages


@flax.struct.dataclass
class PagedKV:
    k: jax.Array | tuple[jax.Array, ...]  # [La, P, page, K, Dh] or La x [P, page, K, Dh]
    v: jax.Array | tuple[jax.Array, ...]  # (La: the attention layers)
    table: jax.Array  # [B, capacity / page] int32: the pool page of each row's logical page

    positional: ClassVar[bool] = True  # entries per position, in pages (model/cache.py)

    # ------------------------------------------------------------ outside the model
    @classmethod
    def allocate(cls, cfg: ModelConfig, layers: int, batch: int, capacity: int, pages: int,
                 dtype, stacked: bool) -> PagedKV:
        """A zero pool of `pages` pages for `layers` attention layers in the form the layer loop
        reads (`stacked`). The table starts as the identity (row b's pages [b * n, (b + 1) * n))
        when the pool has room for it, else maps nothing."""
        page = cfg.attention_chunk
        per_row = capacity // page
        identity = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
        table = identity if pages >= batch * per_row else jnp.full((batch, per_row), pages, jnp.int32)
        shape = (pages, page, cfg.num_kv_heads, cfg.head_dim)
        if stacked:
            return cls(k=jnp.zeros((layers,) + shape, dtype), v=jnp.zeros((layers,) + shape, dtype),
                       table=table)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(layers)), table=table)

    @classmethod
    def logical_axes(cls, cfg: ModelConfig, layers: int, stacked: bool) -> PagedKV:
        """The tree with each leaf's logical axis names (parallel/mesh.py's rules)."""
        if stacked:
            return cls(k=_AXES, v=_AXES, table=_TABLE_AXES)
        return cls(k=(_AXES[1:],) * layers, v=(_AXES[1:],) * layers, table=_TABLE_AXES)

    @classmethod
    def from_rows(cls, k, v, page: int) -> PagedKV:
        """A cache holding dense per-row buffers ([..., B, S, K, Dh], stacked or a tuple of
        layers) with the identity table: row b, position s at page b * S / page + s // page."""
        def to_pages(a):
            *lead, b, s, kh, dh = a.shape
            return a.reshape(*lead, b * s // page, page, kh, dh)

        first = k if not isinstance(k, tuple) else k[0]
        b, s = first.shape[-4], first.shape[-3]
        table = jnp.arange(b * s // page, dtype=jnp.int32).reshape(b, s // page)
        if isinstance(k, tuple):
            return cls(k=tuple(map(to_pages, k)), v=tuple(map(to_pages, v)), table=table)
        return cls(k=to_pages(k), v=to_pages(v), table=table)

    @staticmethod
    def entry_shape(cfg: ModelConfig, layers: int, tokens: int) -> tuple[int, ...]:
        """One row's entries for `tokens` consecutive positions: [La, 2 (k, v), T, K, Dh]."""
        return (layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim)

    @staticmethod
    def join(entries: Sequence[np.ndarray], tokens: int) -> np.ndarray:
        """Host entries of consecutive spans as one span of `tokens` positions (zeros after
        them): what `load` takes for a run of stored blocks."""
        span = np.concatenate(entries, axis=2)  # the token axis of entry_shape
        return np.pad(span, [(0, 0), (0, 0), (0, tokens - span.shape[2]), (0, 0), (0, 0)])

    def with_table(self, table: jax.Array) -> PagedKV:
        """The same pool read through another page table ([B, capacity / page] int32)."""
        return self.replace(table=table)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def num_layers(self) -> int:
        """Layers with KV entries (the attention layers)."""
        return self.k.shape[0] if self.stacked else len(self.k)

    @property
    def _pool_shape(self) -> tuple[int, ...]:
        """[P, page, K, Dh] of one layer's k pool."""
        return self.k.shape[1:] if self.stacked else self.k[0].shape

    @property
    def page(self) -> int:
        return self._pool_shape[1]

    @property
    def num_pages(self) -> int:
        return self._pool_shape[0]

    @property
    def capacity(self) -> int:
        """Positions per row: the logical length every row's page table covers."""
        return self.table.shape[1] * self.page

    @property
    def kv_heads(self) -> int:
        return self._pool_shape[2]

    @property
    def dtype(self):
        return (self.k if self.stacked else self.k[0]).dtype

    def nbytes(self) -> int:
        """Bytes of the pool (k and v of every layer; the table is not counted)."""
        return sum(a.nbytes for a in jax.tree.leaves((self.k, self.v)))

    def _where(self, rows: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(pool page, slot in it) of positions [R, T] of cache rows [R]; a position without a
        page (or past the capacity) gets page num_pages: out of range, so dropped or zero."""
        logical = positions // self.page
        inside = logical < self.table.shape[1]
        page = jnp.where(inside, self.table[rows[:, None], jnp.minimum(logical, self.table.shape[1] - 1)],
                         self.num_pages)
        return page, positions % self.page

    def load(self, entries: jax.Array, row: jax.Array, start: jax.Array) -> PagedKV:
        """Puts one row's entries (entry_shape(cfg, La, T)) at positions [start, start + T)."""
        t = entries.shape[2]
        page, slot = self._where(jnp.reshape(row, (1,)), start + jnp.arange(t)[None])
        page, slot = page[0], slot[0]  # [T]
        if self.stacked:
            def put(buf, new):  # new: [L, T, K, Dh]
                return buf.at[:, page, slot].set(new.astype(buf.dtype), mode="drop")

            return self.replace(k=put(self.k, entries[:, 0]), v=put(self.v, entries[:, 1]))
        return self.replace(
            k=tuple(b.at[page, slot].set(entries[i, 0].astype(b.dtype), mode="drop")
                    for i, b in enumerate(self.k)),
            v=tuple(b.at[page, slot].set(entries[i, 1].astype(b.dtype), mode="drop")
                    for i, b in enumerate(self.v)))

    def gather(self, rows: jax.Array, starts: jax.Array, tokens: int) -> jax.Array:
        """The entries of n spans: span i is positions [starts[i], starts[i] + tokens) of row
        rows[i]. Returns [n, *entry_shape(cfg, La, tokens)]."""
        page, slot = self._where(rows, starts[:, None] + jnp.arange(tokens)[None])  # [n, T]

        def take(buf):  # [P, page, K, Dh] -> [n, T, K, Dh]
            return buf.at[page, slot].get(mode="fill", fill_value=0)

        layers = [jnp.stack([take(k), take(v)], axis=1)  # [n, 2, T, K, Dh]
                  for k, v in (self.layer(i) for i in range(self.num_layers))]
        return jnp.stack(layers, axis=1)

    def rows_view(self) -> tuple[jax.Array, jax.Array]:
        """Every row's positions as dense [La, B, capacity, K, Dh] k and v (tests, debugging)."""
        rows = jnp.arange(self.table.shape[0])
        k = jnp.stack([self.span(self.layer(i)[0], rows, 0, self.capacity)
                       for i in range(self.num_layers)])
        v = jnp.stack([self.span(self.layer(i)[1], rows, 0, self.capacity)
                       for i in range(self.num_layers)])
        return k, v

    # ------------------------------------------------------------ inside the model
    def layer(self, slot) -> tuple[jax.Array, jax.Array]:
        """The k and v pools, [P, page, K, Dh] each, of the `slot`-th attention layer (an int,
        or traced when stacked)."""
        if self.stacked:
            take = lambda buf: jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)  # noqa: E731
            return take(self.k), take(self.v)
        return self.k[slot], self.v[slot]

    def span(self, pool: jax.Array, rows: jax.Array | None, start, length: int) -> jax.Array:
        """Positions [start, start + length) of cache rows `rows` ([R]; None: every row) from
        one layer's k or v pool ([P, page, K, Dh]); start and length are whole pages. Returns
        [R, length, K, Dh]: what attention reads per key chunk (one page per row when the
        chunk is a page)."""
        n = length // self.page
        table = self.table if rows is None else self.table[rows]  # [R, capacity / page]
        pages = jax.lax.dynamic_slice_in_dim(table, start // self.page, n, axis=1)  # [R, n]
        got = pool.at[pages].get(mode="fill", fill_value=0)  # [R, n, page, K, Dh]
        return got.reshape(got.shape[0], length, *got.shape[3:])

    def write(self, slot, k_new: jax.Array, v_new: jax.Array, meta: ForwardMeta) -> PagedKV:
        """k_new[b], v_new[b] ([R, T, K, Dh]) go to positions [write_offset[b], + T) of cache row
        meta.rows[b] (row b without a row table) in attention layer `slot`, for the rows
        meta.write selects; the others keep what they had there. Positions without a page are
        dropped, never clamped onto others (the engine gives every row pages for each position
        it can write)."""
        rows = meta.rows if meta.rows is not None else jnp.arange(k_new.shape[0])
        positions = meta.write_offset[:, None] + jnp.arange(k_new.shape[1], dtype=jnp.int32)[None]
        page, where = self._where(rows, positions)  # [R, T]
        page = jnp.where(meta.write[:, None], page, self.num_pages)  # kept rows: dropped
        # One scatter per pool with mode="drop": no read of the old entries (a read would make
        # XLA copy the pool to keep it for the read).
        if self.stacked:
            def put(buf, new):
                return buf.at[slot, page, where].set(new.astype(buf.dtype), mode="drop")

            return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))
        k, v = list(self.k), list(self.v)
        k[slot] = k[slot].at[page, where].set(k_new.astype(k[slot].dtype), mode="drop")
        v[slot] = v[slot].at[page, where].set(v_new.astype(v[slot].dtype), mode="drop")
        return self.replace(k=tuple(k), v=tuple(v))
