"""The attention layers' cache: a paged KV pool, the one cache type the model has today.

The model owns its cache layout (model/transformer.py's `cache_type`); everything outside the
model (the engine, the offloader, the prefix store, the mesh rules) reaches it only through this
class's interface:

- `allocate(cfg, batch, capacity, pages)` and `logical_axes(cfg)`, a tree shaped like the cache
  whose leaves name each axis (the mesh rules shard the cache from it);
- `page_size(cfg)`, `with_table(table)`: the engine's page allocator (engine/pages.py) decides
  which pool pages hold each row's positions and hands the table in;
- `entry_shape(cfg, tokens)`: one row's entries for `tokens` consecutive positions as one host
  array (what the prefix store keeps per block); `gather` takes them out of the cache for several
  (row, start) pairs at once, `join` makes one span of consecutive stored ones, `load` puts a
  span into one row;
- `state_entry_shape(cfg)` (None without linear layers): one row's recurrent state at its
  committed boundary as one float32 host array (the prefix store's state snapshot);
  `gather_states` takes it out for several rows, `load_state` puts one into a row;
- `write(layer, k, v, meta)`, `layer(i)` and `span(...)`: what the attention layer does with it,
  where `meta` (model/forward_meta.py) says which cache row each input row is, where its new
  entries go and which rows store them.

Layout. Every layer has a pool of P pages of `page` positions ([P, page, K, Dh] for k and for v);
the page table ([B, capacity / page] int32) maps row b's logical page i (positions
[i * page, (i + 1) * page)) to a pool page. A table entry of P or more maps nothing: writes there
are dropped and reads give zeros (attention never reads past a row's visible length, and the
engine gives a row pages for every position it can write). A page is one attention chunk, so the
attention loop reads one page per row per step. The pool holds what requests need, not rows x
the longest context: memory follows the tokens in flight.

The pool comes in one of two forms the model's layer loop picks:

- unrolled layers: k and v are tuples of L arrays [P, page, K, Dh], one per layer;
- scanned layers: k and v are single [L, P, page, K, Dh] arrays (the scan carries them and
  indexes them with a traced layer number).

XLA:CPU updates a per-layer array in place but copied the stacked one for every layer of an
unrolled forward (half the batch-16 decode speed, docs/lab/performance-history.md), hence two forms. The pool
is allocated once per engine and donated to every jitted call.

A hybrid model's linear-attention layers (model/gated_deltanet.py) keep, per cache row, their
recurrent state after the row's committed positions instead: `state` [B, Hv, Dk, Dv] float32 and
the convolution's input `tail` [B, W - 1, C] per layer, in the same two forms
(`recurrent(layer)`, `write_recurrent(...)`). Each kind holds entries for its own layers only:
`layer(i)` and `recurrent(i)` take the model's layer index and find its slot (`kv_slots`,
`state_slots`: static, per layer; a traced index looks its slot up). A row whose committed length
is 0 reads zeros, so a reused row never sees its last request's state. For the prefix store a
row's states flatten to one [Ll, Hv * Dk * Dv + (W - 1) * C] float32 snapshot (the tail cast up
and back exactly); shared prefix pages of the pool hold no state, so the engine does not share
them for a hybrid.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.config import ModelConfig
from mbd_jax.model.forward_meta import ForwardMeta

_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")  # of a stacked k or v
_TABLE_AXES = (None, None)  # the page table is replicated: every device reads every row's pages
_STATE_AXES = ("layers", None, "heads", "head_dim", None)  # a stacked recurrent state
_TAIL_AXES = ("layers", None, None, None)  # conv tail: q, k, v channels side by side


def layer_slots(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(KV slot, state slot) of every layer: its index among the layers of its kind (-1 in the
    other kind's)."""
    kv, state, n_kv, n_state = [], [], 0, 0
    for i in range(cfg.num_layers):
        linear = cfg.layer_type(i) == "linear_attention"
        kv.append(-1 if linear else n_kv)
        state.append(n_state if linear else -1)
        n_kv, n_state = n_kv + (not linear), n_state + linear
    return tuple(kv), tuple(state)


@flax.struct.dataclass
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [La, P, page, K, Dh] or La x [P, page, K, Dh]
    v: jax.Array | tuple[jax.Array, ...]  # (La: the attention layers)
    table: jax.Array  # [B, capacity / page] int32: the pool page of each row's logical page
    state: jax.Array | tuple[jax.Array, ...] | None = None  # [Ll, B, Hv, Dk, Dv] or Ll x [B, ...]
    tail: jax.Array | tuple[jax.Array, ...] | None = None  # [Ll, B, W - 1, C] (Ll: linear layers)
    # per model layer: its slot in k / v and in state / tail (-1: the other kind); () = identity
    kv_slots: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    state_slots: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

    # ------------------------------------------------------------ outside the model
    @staticmethod
    def page_size(cfg: ModelConfig) -> int:
        """Positions per page: one attention chunk."""
        return cfg.attention_chunk

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, capacity: int, pages: int | None = None,
                 dtype=None) -> KVCache:
        """A zero pool of `pages` pages (default batch x capacity / page: every row can hold
        `capacity` positions at once) in the form `cfg`'s layer loop reads (model/layout.py).
        The table starts as the identity (row b's pages [b * n, (b + 1) * n)) when the pool has
        room for it, else maps nothing."""
        from mbd_jax.model import layout

        page = cls.page_size(cfg)
        dtype = jnp.dtype(dtype or cfg.compute_dtype)
        if capacity % page:
            raise ValueError(f"KV capacity {capacity} must be a multiple of the page size "
                             f"(attention_chunk) {page}")
        per_row = capacity // page
        pages = batch * per_row if pages is None else pages
        identity = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
        table = identity if pages >= batch * per_row else jnp.full((batch, per_row), pages, jnp.int32)
        shape = (pages, page, cfg.num_kv_heads, cfg.head_dim)
        kv_slots, state_slots = layer_slots(cfg)
        n_kv, n_state = sum(s >= 0 for s in kv_slots), sum(s >= 0 for s in state_slots)
        recurrent = {}
        sm = cfg.sequence_module
        if sm is not None:  # the linear layers' states: float32 (a sum over the whole context)
            channels = 2 * sm.num_key_heads * sm.key_head_dim + sm.num_value_heads * sm.value_head_dim
            recurrent = {"state": ((batch, sm.num_value_heads, sm.key_head_dim, sm.value_head_dim),
                                   jnp.float32),
                         "tail": ((batch, sm.conv_kernel - 1, channels), dtype)}
        slots = {"kv_slots": kv_slots, "state_slots": state_slots} if sm is not None else {}
        zeros = lambda n, shp, dt: tuple(jnp.zeros(shp, dt) for _ in range(n))  # noqa: E731
        if layout.scanned(cfg):
            return cls(k=jnp.zeros((n_kv,) + shape, dtype),
                       v=jnp.zeros((n_kv,) + shape, dtype), table=table,
                       **{name: jnp.zeros((n_state,) + shp, dt)
                          for name, (shp, dt) in recurrent.items()}, **slots)
        # unrolled: one array per layer (no attention layer: an empty stacked pool)
        kv = {"k": jnp.zeros((0,) + shape, dtype), "v": jnp.zeros((0,) + shape, dtype)} if \
            n_kv == 0 else {"k": zeros(n_kv, shape, dtype), "v": zeros(n_kv, shape, dtype)}
        return cls(**kv, table=table,
                   **{name: zeros(n_state, shp, dt) for name, (shp, dt) in recurrent.items()},
                   **slots)

    @classmethod
    def from_rows(cls, k, v, page: int) -> KVCache:
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

    @classmethod
    def logical_axes(cls, cfg: ModelConfig) -> KVCache:
        """The cache's tree with each leaf's logical axis names (parallel/mesh.py's rules)."""
        from mbd_jax.model import layout

        recurrent, slots = {}, {}
        kv_slots, state_slots = layer_slots(cfg)
        n_kv, n_state = sum(s >= 0 for s in kv_slots), sum(s >= 0 for s in state_slots)
        if cfg.sequence_module is not None:  # rows on every data shard, like the pool's pages
            recurrent = {"state": _STATE_AXES, "tail": _TAIL_AXES}
            slots = {"kv_slots": kv_slots, "state_slots": state_slots}
        if layout.scanned(cfg):
            return cls(k=_AXES, v=_AXES, table=_TABLE_AXES, **recurrent, **slots)
        if n_kv == 0:  # an empty stacked pool beside per-layer states
            return cls(k=_AXES, v=_AXES, table=_TABLE_AXES,
                       **{name: (axes[1:],) * n_state for name, axes in recurrent.items()}, **slots)
        return cls(k=(_AXES[1:],) * n_kv, v=(_AXES[1:],) * n_kv, table=_TABLE_AXES,
                   **{name: (axes[1:],) * n_state for name, axes in recurrent.items()}, **slots)

    @classmethod
    def capacity_for(cls, cfg: ModelConfig, max_write: int) -> int:
        """A row's positions: [0, max_seq_len) plus `max_write` (the longest write a forward
        makes, which may start at the last position), rounded up to whole pages so chunk
        reads never clamp."""
        need, page = cfg.max_seq_len + max_write, cls.page_size(cfg)
        return -(-need // page) * page

    @staticmethod
    def entry_shape(cfg: ModelConfig, tokens: int) -> tuple[int, ...]:
        """One row's entries for `tokens` consecutive positions: [La, 2 (k, v), T, K, Dh] (La:
        the attention layers)."""
        return (sum(s >= 0 for s in layer_slots(cfg)[0]), 2, tokens, cfg.num_kv_heads, cfg.head_dim)

    @staticmethod
    def join(entries: Sequence[np.ndarray], tokens: int) -> np.ndarray:
        """Host entries of consecutive spans as one span of `tokens` positions (zeros after
        them): what `load` takes for a run of stored blocks."""
        span = np.concatenate(entries, axis=2)  # the token axis of entry_shape
        return np.pad(span, [(0, 0), (0, 0), (0, tokens - span.shape[2]), (0, 0), (0, 0)])

    @staticmethod
    def state_entry_shape(cfg: ModelConfig) -> tuple[int, ...] | None:
        """One row's recurrent state snapshot, [Ll, Hv * Dk * Dv + (W - 1) * C] float32 (Ll: the
        linear layers); None for a model without them."""
        sm = cfg.sequence_module
        if sm is None:
            return None
        channels = 2 * sm.num_key_heads * sm.key_head_dim + sm.num_value_heads * sm.value_head_dim
        size = sm.num_value_heads * sm.key_head_dim * sm.value_head_dim + (sm.conv_kernel - 1) * channels
        return (sum(s >= 0 for s in layer_slots(cfg)[1]), size)

    def _state_layers(self) -> list[tuple[jax.Array, jax.Array]]:
        """(state [B, Hv, Dk, Dv], tail [B, W - 1, C]) of every linear layer, in slot order."""
        if isinstance(self.state, tuple):
            return list(zip(self.state, self.tail))
        return [(self.state[i], self.tail[i]) for i in range(self.state.shape[0])]

    def gather_states(self, rows: jax.Array) -> jax.Array:
        """Rows `rows`' ([n]) snapshots: [n, *state_entry_shape(cfg)] float32."""
        flat = [jnp.concatenate([s[rows].reshape(len(rows), -1),
                                 t[rows].reshape(len(rows), -1).astype(jnp.float32)], axis=1)
                for s, t in self._state_layers()]
        return jnp.stack(flat, axis=1)

    def load_state(self, entry: jax.Array, row: jax.Array) -> KVCache:
        """Row `row` takes the snapshot `entry` ([*state_entry_shape(cfg)]) as its state."""
        if not isinstance(self.state, tuple):  # stacked: [Ll, B, ...]
            n = int(np.prod(self.state.shape[2:]))
            return self.replace(
                state=self.state.at[:, row].set(
                    entry[:, :n].reshape(-1, *self.state.shape[2:]).astype(self.state.dtype)),
                tail=self.tail.at[:, row].set(
                    entry[:, n:].reshape(-1, *self.tail.shape[2:]).astype(self.tail.dtype)))
        states, tails = [], []
        for i, (s, t) in enumerate(self._state_layers()):
            n = int(np.prod(s.shape[1:]))
            states.append(s.at[row].set(entry[i, :n].reshape(s.shape[1:]).astype(s.dtype)))
            tails.append(t.at[row].set(entry[i, n:].reshape(t.shape[1:]).astype(t.dtype)))
        return self.replace(state=tuple(states), tail=tuple(tails))

    def with_table(self, table: jax.Array) -> KVCache:
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

    def load(self, entries: jax.Array, row: jax.Array, start: jax.Array) -> KVCache:
        """Puts one row's entries (entry_shape(cfg, T)) at positions [start, start + T)."""
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
        rows[i]. Returns [n, *entry_shape(cfg, tokens)]."""
        page, slot = self._where(rows, starts[:, None] + jnp.arange(tokens)[None])  # [n, T]

        def take(buf):  # [P, page, K, Dh] -> [n, T, K, Dh]
            return buf.at[page, slot].get(mode="fill", fill_value=0)

        layers = [jnp.stack([take(k), take(v)], axis=1)  # [n, 2, T, K, Dh]
                  for k, v in (self._pools(i) for i in range(self.num_layers))]
        return jnp.stack(layers, axis=1)

    def rows_view(self) -> tuple[jax.Array, jax.Array]:
        """Every row's positions as dense [L, B, capacity, K, Dh] k and v (tests, debugging)."""
        rows = jnp.arange(self.table.shape[0])
        k = jnp.stack([self.span(self._pools(i)[0], rows, 0, self.capacity)
                       for i in range(self.num_layers)])
        v = jnp.stack([self.span(self._pools(i)[1], rows, 0, self.capacity)
                       for i in range(self.num_layers)])
        return k, v

    # ------------------------------------------------------------ inside the model
    @staticmethod
    def _slot(slots: tuple[int, ...], layer):
        """The slot of model layer `layer` (an int, or traced when stacked) in one kind's arrays."""
        if not slots:
            return layer
        return slots[layer] if isinstance(layer, int) else jnp.asarray(slots, jnp.int32)[layer]

    def recurrent(self, layer) -> tuple[jax.Array, jax.Array]:
        """One linear-attention layer's (state [B, Hv, Dk, Dv], conv tail [B, W - 1, C]) of
        every cache row (`layer`: the model's layer index; traced when stacked)."""
        if self.state is None:
            raise ValueError("this cache holds no recurrent state (an attention-only model's)")
        slot = self._slot(self.state_slots, layer)
        if not isinstance(self.state, tuple):
            take = lambda buf: jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)  # noqa: E731
            return take(self.state), take(self.tail)
        return self.state[slot], self.tail[slot]

    def write_recurrent(self, layer, rows: jax.Array, state: jax.Array, tail: jax.Array,
                        keep: jax.Array) -> KVCache:
        """Cache rows `rows` ([R]) of `layer` take state [R, Hv, Dk, Dv] and tail [R, W - 1, C]
        where `keep` ([R] bool) is False; where True they keep theirs."""
        index = jnp.where(keep, self._rows(), rows)  # out of range: dropped
        slot = self._slot(self.state_slots, layer)
        if not isinstance(self.state, tuple):
            return self.replace(
                state=self.state.at[slot, index].set(state.astype(self.state.dtype), mode="drop"),
                tail=self.tail.at[slot, index].set(tail.astype(self.tail.dtype), mode="drop"))
        st, tl = list(self.state), list(self.tail)
        st[slot] = st[slot].at[index].set(state.astype(st[slot].dtype), mode="drop")
        tl[slot] = tl[slot].at[index].set(tail.astype(tl[slot].dtype), mode="drop")
        return self.replace(state=tuple(st), tail=tuple(tl))

    def _rows(self) -> int:
        return self.table.shape[0]

    def layer(self, layer) -> tuple[jax.Array, jax.Array]:
        """One attention layer's k and v pools, [P, page, K, Dh] each (`layer`: the model's
        layer index; traced when stacked)."""
        return self._pools(self._slot(self.kv_slots, layer))

    def _pools(self, slot) -> tuple[jax.Array, jax.Array]:
        """The k and v pools in KV slot `slot` (the i-th attention layer)."""
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

    def write(self, layer, k_new: jax.Array, v_new: jax.Array, meta: ForwardMeta) -> KVCache:
        """k_new[b], v_new[b] ([R, T, K, Dh]) go to positions [write_offset[b], + T) of cache row
        meta.rows[b] (row b without a row table) in `layer`, for the rows meta.write selects; the
        others keep what they had there. Positions without a page are dropped, never clamped
        onto others (the engine gives every row pages for each position it can write)."""
        rows = meta.rows if meta.rows is not None else jnp.arange(k_new.shape[0])
        positions = meta.write_offset[:, None] + jnp.arange(k_new.shape[1], dtype=jnp.int32)[None]
        page, slot = self._where(rows, positions)  # [R, T]
        page = jnp.where(meta.write[:, None], page, self.num_pages)  # kept rows: dropped
        # One scatter per pool with mode="drop": no read of the old entries (a read would make
        # XLA copy the pool to keep it for the read).
        i = self._slot(self.kv_slots, layer)
        if self.stacked:
            def put(buf, new):
                return buf.at[i, page, slot].set(new.astype(buf.dtype), mode="drop")

            return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))
        k, v = list(self.k), list(self.v)
        k[i] = k[i].at[page, slot].set(k_new.astype(k[i].dtype), mode="drop")
        v[i] = v[i].at[page, slot].set(v_new.astype(v[i].dtype), mode="drop")
        return self.replace(k=tuple(k), v=tuple(v))
