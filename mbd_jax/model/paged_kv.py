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

Quantized pools (cfg.kv_quantization: int8 or fp8 e4m3): k and v hold 8-bit values and
`k_scale` / `v_scale` ([..., P, page, K] float32, the same forms) one scale per position and kv
head: each written vector is quantized on its own (absmax over Dh, model/quantize.py), so a
write never reads or requantizes what a page already holds, and a rewritten position (a block's
later denoising step) simply replaces its scale. Attention reads them back through `span`.

Entries (what the prefix store keeps per block): one row's k and v for T consecutive positions,
[La, 2, T, K, Dh] (`entry_shape`); a quantized pool's entries are bytes, [La, 2, T, K, Dh + 4]
uint8, each vector's 8-bit values followed by its float32 scale, so the store and the offload
keep the quantized form (about half a 16-bit entry's bytes) and need not know about it; `gather` takes them out for several (row, start) pairs at
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
from mbd_jax.model import quantize
from mbd_jax.model.forward_meta import ForwardMeta

_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")  # of a stacked k or v
_SCALE_AXES = _AXES[:-1]  # of a stacked k_scale or v_scale
_SCALE_BYTES = 4  # a float32 scale, after its vector's values in a quantized pool's entries


def _quantize(x: jax.Array, scheme: str) -> tuple[jax.Array, jax.Array]:
    """x: [..., Dh] -> (8-bit values [..., Dh], float32 scales [...]): one per vector."""
    q, scale = quantize.quantize(x, scheme, (x.ndim - 1,))
    return q, scale[..., 0]


def _dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """(values [..., Dh], scales [...]) -> float32 [..., Dh]."""
    return q.astype(jnp.float32) * scale[..., None]


def _to_bytes(q: jax.Array, scale: jax.Array) -> jax.Array:
    """(values [..., Dh], scales [...]) -> [..., Dh + 4] uint8 (an entry's form)."""
    return jnp.concatenate([jax.lax.bitcast_convert_type(q, jnp.uint8),
                            jax.lax.bitcast_convert_type(scale, jnp.uint8)], axis=-1)


def _from_bytes(entries: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The inverse of _to_bytes: [..., Dh + 4] uint8 -> (values of `dtype`, float32 scales)."""
    values, scale = entries[..., :-_SCALE_BYTES], entries[..., -_SCALE_BYTES:]
    return (jax.lax.bitcast_convert_type(values, dtype),
            jax.lax.bitcast_convert_type(scale, jnp.float32))
_TABLE_AXES = (None, None)  # the page table is replicated: every device reads every row's pages
# what layer() gives per k or v: a pool [P, page, K, Dh], or a quantized one's (values, scales)
Pool = jax.Array | tuple[jax.Array, jax.Array]


@flax.struct.dataclass
class PagedKV:
    k: jax.Array | tuple[jax.Array, ...]  # [La, P, page, K, Dh] or La x [P, page, K, Dh]
    v: jax.Array | tuple[jax.Array, ...]  # (La: the attention layers)
    table: jax.Array  # [B, capacity / page] int32: the pool page of each row's logical page
    # a quantized pool's scales ([La, P, page, K] float32 or La x [P, page, K]); None: float
    k_scale: jax.Array | tuple[jax.Array, ...] | None = None
    v_scale: jax.Array | tuple[jax.Array, ...] | None = None
    scheme: str = flax.struct.field(pytree_node=False, default="none")  # cfg.kv_quantization

    positional: ClassVar[bool] = True  # entries per position, in pages (model/cache.py)

    # ------------------------------------------------------------ outside the model
    @classmethod
    def allocate(cls, cfg: ModelConfig, layers: int, batch: int, capacity: int, pages: int,
                 dtype, stacked: bool) -> PagedKV:
        """A zero pool of `pages` pages for `layers` attention layers in the form the layer loop
        reads (`stacked`), of `dtype`, or 8-bit with scales when cfg.kv_quantization says. The
        table starts as the identity (row b's pages [b * n, (b + 1) * n)) when the pool has
        room for it, else maps nothing."""
        page = cfg.attention_chunk
        per_row = capacity // page
        identity = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
        table = identity if pages >= batch * per_row else jnp.full((batch, per_row), pages, jnp.int32)
        shape = (pages, page, cfg.num_kv_heads, cfg.head_dim)
        scheme = cfg.kv_quantization

        def zeros(shape, dtype):  # one layer's, or the stacked layers'
            if stacked:
                return jnp.zeros((layers,) + shape, dtype)
            return tuple(jnp.zeros(shape, dtype) for _ in range(layers))

        if scheme == "none":
            return cls(k=zeros(shape, dtype), v=zeros(shape, dtype), table=table)
        values = quantize.SCHEMES[scheme].dtype
        return cls(k=zeros(shape, values), v=zeros(shape, values), table=table,
                   k_scale=zeros(shape[:-1], jnp.float32), v_scale=zeros(shape[:-1], jnp.float32),
                   scheme=scheme)

    @classmethod
    def logical_axes(cls, cfg: ModelConfig, layers: int, stacked: bool) -> PagedKV:
        """The tree with each leaf's logical axis names (parallel/mesh.py's rules)."""
        quantized = cfg.kv_quantization != "none"
        if stacked:
            values, scales = _AXES, _SCALE_AXES
        else:
            values, scales = (_AXES[1:],) * layers, (_SCALE_AXES[1:],) * layers
        return cls(k=values, v=values, table=_TABLE_AXES, k_scale=scales if quantized else None,
                   v_scale=scales if quantized else None, scheme=cfg.kv_quantization)

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
        """One row's entries for `tokens` consecutive positions: [La, 2 (k, v), T, K, Dh]
        (Dh + 4 bytes per vector for a quantized pool)."""
        width = cfg.head_dim + (_SCALE_BYTES if cfg.kv_quantization != "none" else 0)
        return (layers, 2, tokens, cfg.num_kv_heads, width)

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

    @property
    def entry_dtype(self):
        """The dtype of gather's entries (uint8: a quantized pool's bytes)."""
        return self.dtype if self.scheme == "none" else jnp.dtype(jnp.uint8)

    def nbytes(self) -> int:
        """Bytes of the pool (k and v of every layer, their scales; the table is not counted)."""
        return sum(a.nbytes for a in jax.tree.leaves((self.k, self.v, self.k_scale, self.v_scale)))

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
        scales = None
        if self.scheme != "none":
            entries, scales = _from_bytes(entries, self.dtype)  # [L, 2, T, K, Dh], [L, 2, T, K]

        def put(pool, scale_pool, which):  # the stacked pool, or a tuple of layers
            new = entries[:, which]  # [L, T, K, Dh]
            if self.stacked:
                pool = pool.at[:, page, slot].set(new.astype(pool.dtype), mode="drop")
                if scales is not None:
                    scale_pool = scale_pool.at[:, page, slot].set(scales[:, which], mode="drop")
                return pool, scale_pool
            pool = tuple(b.at[page, slot].set(new[i].astype(b.dtype), mode="drop")
                         for i, b in enumerate(pool))
            if scales is not None:
                scale_pool = tuple(b.at[page, slot].set(scales[i, which], mode="drop")
                                   for i, b in enumerate(scale_pool))
            return pool, scale_pool

        k, k_scale = put(self.k, self.k_scale, 0)
        v, v_scale = put(self.v, self.v_scale, 1)
        return self.replace(k=k, v=v, k_scale=k_scale, v_scale=v_scale)

    def gather(self, rows: jax.Array, starts: jax.Array, tokens: int) -> jax.Array:
        """The entries of n spans: span i is positions [starts[i], starts[i] + tokens) of row
        rows[i]. Returns [n, *entry_shape(cfg, La, tokens)]."""
        page, slot = self._where(rows, starts[:, None] + jnp.arange(tokens)[None])  # [n, T]

        def take(pool):  # [P, page, K, Dh] (with its scales) -> [n, T, K, Dh or Dh + 4]
            if self.scheme == "none":
                return pool.at[page, slot].get(mode="fill", fill_value=0)
            values, scales = pool
            return _to_bytes(values.at[page, slot].get(mode="fill", fill_value=0),
                             scales.at[page, slot].get(mode="fill", fill_value=0))

        layers = [jnp.stack([take(k), take(v)], axis=1)  # [n, 2, T, K, Dh]
                  for k, v in (self.layer(i) for i in range(self.num_layers))]
        return jnp.stack(layers, axis=1)

    def rows_view(self) -> tuple[jax.Array, jax.Array]:
        """Every row's positions as dense [La, B, capacity, K, Dh] k and v (tests, debugging;
        float32 from a quantized pool)."""
        rows = jnp.arange(self.table.shape[0])
        k = jnp.stack([self.span(self.layer(i)[0], rows, 0, self.capacity)
                       for i in range(self.num_layers)])
        v = jnp.stack([self.span(self.layer(i)[1], rows, 0, self.capacity)
                       for i in range(self.num_layers)])
        return k, v

    # ------------------------------------------------------------ inside the model
    def layer(self, slot) -> tuple[Pool, Pool]:
        """The k and v pools of the `slot`-th attention layer (an int, or traced when stacked):
        [P, page, K, Dh] each, or for a quantized pool its (values, scales [P, page, K])."""
        if self.stacked:
            take = lambda buf: jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)  # noqa: E731
        else:
            take = lambda bufs: bufs[slot]  # noqa: E731
        if self.scheme == "none":
            return take(self.k), take(self.v)
        return (take(self.k), take(self.k_scale)), (take(self.v), take(self.v_scale))

    def span(self, pool: Pool, rows: jax.Array | None, start, length: int) -> jax.Array:
        """Positions [start, start + length) of cache rows `rows` ([R]; None: every row) from
        one layer's k or v pool (layer()); start and length are whole pages. Returns
        [R, length, K, Dh] (float32 from a quantized pool): what attention reads per key chunk
        (one page per row when the chunk is a page)."""
        n = length // self.page
        table = self.table if rows is None else self.table[rows]  # [R, capacity / page]
        pages = jax.lax.dynamic_slice_in_dim(table, start // self.page, n, axis=1)  # [R, n]

        def take(buf):  # [P, page, ...] -> [R, length, ...]
            got = buf.at[pages].get(mode="fill", fill_value=0)  # [R, n, page, ...]
            return got.reshape(got.shape[0], length, *got.shape[3:])

        if self.scheme == "none":
            return take(pool)
        return _dequantize(take(pool[0]), take(pool[1]))

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
        def put(bufs, new):  # the stacked pool or a tuple of layers; new: [R, T, K, ...]
            if self.stacked:
                return bufs.at[slot, page, where].set(new.astype(bufs.dtype), mode="drop")
            bufs = list(bufs)
            bufs[slot] = bufs[slot].at[page, where].set(new.astype(bufs[slot].dtype), mode="drop")
            return tuple(bufs)

        if self.scheme == "none":
            return self.replace(k=put(self.k, k_new), v=put(self.v, v_new))
        (k_q, k_s), (v_q, v_s) = _quantize(k_new, self.scheme), _quantize(v_new, self.scheme)
        return self.replace(k=put(self.k, k_q), v=put(self.v, v_q),
                            k_scale=put(self.k_scale, k_s), v_scale=put(self.v_scale, v_s))
