"""The attention layers' cache: a preallocated KV buffer, the one cache type the model has today.

The model owns its cache layout (model/transformer.py's `cache_type`); everything outside the
model (the engine, the offloader, the prefix store, the mesh rules) reaches it only through this
class's interface:

- `allocate(cfg, batch, capacity)` and `logical_axes(cfg)`, a tree shaped like the cache whose
  leaves name each axis (the mesh rules shard the cache from it);
- `entry_shape(cfg, tokens)`: one row's entries for `tokens` consecutive positions as one host
  array (what the prefix store keeps per block); `gather` takes them out of the cache for several
  (row, start) pairs at once, `join` makes one span of consecutive stored ones, `load` puts a
  span into one row;
- `write(layer, k, v, meta)`, `layer(i)` and `rows_span(...)`: what the attention layer does with it,
  where `meta` (model/forward_meta.py) says which cache row each input row is, where its new
  entries go and which rows store them.

The buffer comes in one of two forms the model's layer loop picks:

- unrolled layers: k and v are tuples of L arrays [B, S_max, K, Dh], one per layer;
- scanned layers: k and v are single [L, B, S_max, K, Dh] arrays (the scan carries them and
  indexes them with a traced layer number).

XLA:CPU updates a per-layer array in place but copied the stacked one for every layer of an
unrolled forward (half the batch-16 decode speed, docs/performance.md), hence two forms. Row b is
request slot b and index s holds absolute position s. The buffer is allocated once per engine and
donated to every jitted call.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.config import ModelConfig
from mbd_jax.model.forward_meta import ForwardMeta

_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")  # of a stacked k or v


@flax.struct.dataclass
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, S_max, K, Dh] or L x [B, S_max, K, Dh]
    v: jax.Array | tuple[jax.Array, ...]

    # ------------------------------------------------------------ outside the model
    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> KVCache:
        """Zeros in the form `cfg`'s layer loop reads (model/layout.py)."""
        from mbd_jax.model import layout

        dtype = jnp.dtype(dtype or cfg.compute_dtype)
        if capacity % cfg.attention_chunk:
            raise ValueError(f"KV capacity {capacity} must be a multiple of attention_chunk "
                             f"{cfg.attention_chunk}")
        shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        if layout.scanned(cfg):
            return cls(k=jnp.zeros((cfg.num_layers,) + shape, dtype),
                       v=jnp.zeros((cfg.num_layers,) + shape, dtype))
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
        return cls(k=zeros(), v=zeros())

    @classmethod
    def logical_axes(cls, cfg: ModelConfig) -> KVCache:
        """The cache's tree with each leaf's logical axis names (parallel/mesh.py's rules)."""
        from mbd_jax.model import layout

        if layout.scanned(cfg):
            return cls(k=_AXES, v=_AXES)
        return cls(k=(_AXES[1:],) * cfg.num_layers, v=(_AXES[1:],) * cfg.num_layers)

    @staticmethod
    def capacity_for(cfg: ModelConfig, max_write: int) -> int:
        """S_max for positions [0, max_seq_len) plus `max_write` (the longest write a forward
        makes, which may start at the last position), rounded up to the attention chunk so chunk
        slices never clamp."""
        need = cfg.max_seq_len + max_write
        return -(-need // cfg.attention_chunk) * cfg.attention_chunk

    @staticmethod
    def entry_shape(cfg: ModelConfig, tokens: int) -> tuple[int, ...]:
        """One row's entries for `tokens` consecutive positions: [L, 2 (k, v), T, K, Dh]."""
        return (cfg.num_layers, 2, tokens, cfg.num_kv_heads, cfg.head_dim)

    @staticmethod
    def join(entries: Sequence[np.ndarray], tokens: int) -> np.ndarray:
        """Host entries of consecutive spans as one span of `tokens` positions (zeros after
        them): what `load` takes for a run of stored blocks."""
        span = np.concatenate(entries, axis=2)  # the token axis of entry_shape
        return np.pad(span, [(0, 0), (0, 0), (0, tokens - span.shape[2]), (0, 0), (0, 0)])

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0] if self.stacked else len(self.k)

    @property
    def capacity(self) -> int:
        return self.layer(0)[0].shape[1]

    @property
    def kv_heads(self) -> int:
        return self.layer(0)[0].shape[2]

    @property
    def dtype(self):
        return self.layer(0)[0].dtype

    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))

    def load(self, entries: jax.Array, row: jax.Array, start: jax.Array) -> KVCache:
        """Puts one row's entries (entry_shape(cfg, T)) at positions [start, start + T)."""
        if self.stacked:
            def put(buf: jax.Array, new: jax.Array) -> jax.Array:  # new: [L, T, K, Dh]
                return jax.lax.dynamic_update_slice(buf, new[:, None].astype(buf.dtype),
                                                    (0, row, start, 0, 0))

            return KVCache(k=put(self.k, entries[:, 0]), v=put(self.v, entries[:, 1]))

        def put_layer(buf: jax.Array, new: jax.Array) -> jax.Array:  # new: [T, K, Dh]
            return jax.lax.dynamic_update_slice(buf, new[None].astype(buf.dtype),
                                                (row, start, 0, 0))

        return KVCache(k=tuple(put_layer(k, entries[i, 0]) for i, k in enumerate(self.k)),
                       v=tuple(put_layer(v, entries[i, 1]) for i, v in enumerate(self.v)))

    def gather(self, rows: jax.Array, starts: jax.Array, tokens: int) -> jax.Array:
        """The entries of n spans: span i is positions [starts[i], starts[i] + tokens) of row
        rows[i]. Returns [n, *entry_shape(cfg, tokens)]."""
        def one(row, start):
            def take(buf):  # [B, S, K, Dh] -> [tokens, K, Dh]
                return jax.lax.dynamic_slice(buf, (row, start, 0, 0),
                                             (1, tokens) + buf.shape[2:])[0]

            return jnp.stack([jnp.stack([take(k), take(v)])
                              for k, v in (self.layer(i) for i in range(self.num_layers))])

        return jax.vmap(one)(rows, starts)

    # ------------------------------------------------------------ inside the model
    def layer(self, layer) -> tuple[jax.Array, jax.Array]:
        """One layer's k and v, [B, S_max, K, Dh] each (`layer` may be traced when stacked)."""
        if self.stacked:
            take = lambda buf: jax.lax.dynamic_index_in_dim(buf, layer, keepdims=False)  # noqa: E731
            return take(self.k), take(self.v)
        return self.k[layer], self.v[layer]

    def write(self, layer, k_new: jax.Array, v_new: jax.Array, meta: ForwardMeta) -> KVCache:
        """k_new[b], v_new[b] ([R, T, K, Dh]) go to positions [write_offset[b], + T) of cache row
        meta.rows[b] (row b without a row table) in `layer`, for the rows meta.write selects; the
        others keep what they had there. Positions past S_max are dropped, never clamped onto
        earlier ones (capacity_for leaves room for every real write)."""
        offset, keep = meta.write_offset, ~meta.write
        rows = meta.rows if meta.rows is not None else jnp.arange(k_new.shape[0])
        if self.stacked:
            return KVCache(k=_write_stacked(self.k, layer, k_new, rows, offset, keep),
                           v=_write_stacked(self.v, layer, v_new, rows, offset, keep))
        k, v = list(self.k), list(self.v)
        k[layer] = _write_rows(k[layer], k_new, rows, offset, keep)
        v[layer] = _write_rows(v[layer], v_new, rows, offset, keep)
        return KVCache(k=tuple(k), v=tuple(v))


def rows_span(buf: jax.Array, rows: jax.Array | None, start, length: int) -> jax.Array:
    """Positions [start, start + length) of one layer's k or v ([B, S, K, Dh]) for the cache rows
    `rows` ([R]; None: every row): [R, length, K, Dh]. What attention reads per key chunk."""
    if rows is None:
        return jax.lax.dynamic_slice_in_dim(buf, start, length, axis=1)
    size = (1, length) + buf.shape[2:]
    return jax.vmap(lambda r: jax.lax.dynamic_slice(buf, (r, start, 0, 0), size)[0])(rows)


def _write_rows(buf: jax.Array, new: jax.Array, rows: jax.Array, offset: jax.Array,
                keep: jax.Array) -> jax.Array:
    """buf: [B, S, K, Dh]; new: [R, T, K, Dh]; rows, offset, keep: [R]. One scatter: a kept
    row's positions point past the end, where mode="drop" discards them (no read of the old
    entries, which would make XLA copy the buffer to keep it for the read)."""
    pos = _positions(offset, keep, new.shape[1], buf.shape[1])
    return buf.at[rows[:, None], pos].set(new.astype(buf.dtype), mode="drop")


def _write_stacked(buf: jax.Array, layer, new: jax.Array, rows: jax.Array, offset: jax.Array,
                   keep: jax.Array) -> jax.Array:
    """buf: [L, B, S, K, Dh]; new: [R, T, K, Dh]; rows, offset, keep: [R]."""
    pos = _positions(offset, keep, new.shape[1], buf.shape[2])
    return buf.at[layer, rows[:, None], pos].set(new.astype(buf.dtype), mode="drop")


def _positions(offset: jax.Array, keep: jax.Array, t: int, capacity: int) -> jax.Array:
    """[B, T] buffer positions of each row's T new entries; `capacity` (out of range: dropped)
    for the rows that keep what they have."""
    pos = offset[:, None] + jnp.arange(t, dtype=offset.dtype)[None, :]
    return jnp.where(keep[:, None], capacity, pos)
