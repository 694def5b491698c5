"""The preallocated KV buffer, in one of two forms the model's layer loop picks:

- unrolled layers: k and v are tuples of L arrays [B, S_max, K, Dh], one per layer;
- scanned layers: k and v are single [L, B, S_max, K, Dh] arrays (the scan carries them and
  indexes them with a traced layer number).

XLA:CPU updates a per-layer array in place but copied the stacked one for every layer of an
unrolled forward (half the batch-16 decode speed, docs/performance.md), hence two forms. Row b is
request slot b and index s holds absolute position s. The buffer is allocated once per engine and
donated to every jitted call. The layers reach it only through `write` and `layer`;
`load_blocks` / `gather_blocks` move whole blocks in and out (the prefix cache).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig

LOGICAL_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")  # of stacked k and v


@flax.struct.dataclass
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, S_max, K, Dh] or L x [B, S_max, K, Dh]
    v: jax.Array | tuple[jax.Array, ...]

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

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

    def layer(self, layer) -> tuple[jax.Array, jax.Array]:
        """One layer's k and v, [B, S_max, K, Dh] each (`layer` may be traced when stacked)."""
        if self.stacked:
            take = lambda buf: jax.lax.dynamic_index_in_dim(buf, layer, keepdims=False)  # noqa: E731
            return take(self.k), take(self.v)
        return self.k[layer], self.v[layer]

    def write(self, layer, k_new: jax.Array, v_new: jax.Array, offset: jax.Array) -> KVCache:
        """k_new[b], v_new[b] ([B, T, K, Dh]) go to positions [offset[b], offset[b] + T) of row b
        in `layer`. The caller guarantees offset + T <= S_max (dynamic_update_slice would clamp
        and silently overwrite earlier positions otherwise)."""
        if self.stacked:
            return KVCache(k=_write_stacked(self.k, layer, k_new, offset),
                           v=_write_stacked(self.v, layer, v_new, offset))
        k, v = list(self.k), list(self.v)
        k[layer] = _write_rows(k[layer], k_new, offset)
        v[layer] = _write_rows(v[layer], v_new, offset)
        return KVCache(k=tuple(k), v=tuple(v))


def _write_rows(buf: jax.Array, new: jax.Array, offset: jax.Array) -> jax.Array:
    """buf: [B, S, K, Dh]; new: [B, T, K, Dh]; offset: [B]."""
    def one(row_buf, row_new, off):
        return jax.lax.dynamic_update_slice(row_buf, row_new.astype(row_buf.dtype), (off, 0, 0))

    return jax.vmap(one)(buf, new, offset)


def _write_stacked(buf: jax.Array, layer, new: jax.Array, offset: jax.Array) -> jax.Array:
    """buf: [L, B, S, K, Dh]; new: [B, T, K, Dh]; offset: [B]."""
    def one(row_buf, row_new, off):  # row_buf: [L, S, K, Dh]; row_new: [T, K, Dh]
        return jax.lax.dynamic_update_slice(row_buf, row_new[None].astype(row_buf.dtype),
                                            (layer, off, 0, 0))

    return jax.vmap(one, in_axes=(1, 0, 0), out_axes=1)(buf, new, offset)


def kv_capacity(cfg: ModelConfig, extra_tokens: int) -> int:
    """S_max: room for max_seq_len plus `extra_tokens` (the engine's: one decode window past the
    last real position, and the scratch region), rounded up to the attention chunk so chunk
    slices never clamp."""
    need = cfg.max_seq_len + extra_tokens
    chunk = cfg.attention_chunk
    return -(-need // chunk) * chunk


def allocate(cfg: ModelConfig, batch: int, capacity: int, dtype=None) -> KVCache:
    """Zeros in the form `cfg`'s layer loop reads (model/layout.py)."""
    from mbd_jax.model import layout

    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    if capacity % cfg.attention_chunk:
        raise ValueError(f"KV capacity {capacity} must be a multiple of attention_chunk "
                         f"{cfg.attention_chunk}")
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    if layout.scanned(cfg):
        return KVCache(k=jnp.zeros((cfg.num_layers,) + shape, dtype),
                       v=jnp.zeros((cfg.num_layers,) + shape, dtype))
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
    return KVCache(k=zeros(), v=zeros())


def load_blocks(kv: KVCache, blocks: jax.Array, row: jax.Array, start: jax.Array) -> KVCache:
    """Writes cached KV into one row: blocks [L, 2, T, K, Dh] go to positions [start, start + T)."""
    if kv.stacked:
        def put(buf: jax.Array, new: jax.Array) -> jax.Array:  # new: [L, T, K, Dh]
            return jax.lax.dynamic_update_slice(buf, new[:, None].astype(buf.dtype),
                                                (0, row, start, 0, 0))

        return KVCache(k=put(kv.k, blocks[:, 0]), v=put(kv.v, blocks[:, 1]))

    def put_layer(buf: jax.Array, new: jax.Array) -> jax.Array:  # new: [T, K, Dh]
        return jax.lax.dynamic_update_slice(buf, new[None].astype(buf.dtype), (row, start, 0, 0))

    return KVCache(k=tuple(put_layer(k, blocks[i, 0]) for i, k in enumerate(kv.k)),
                   v=tuple(put_layer(v, blocks[i, 1]) for i, v in enumerate(kv.v)))


def gather_blocks(kv: KVCache, rows: jax.Array, starts: jax.Array, block_size: int) -> jax.Array:
    """The KV of n blocks, block i at positions [starts[i], starts[i] + blk) of row rows[i]:
    [n, L, 2, blk, K, Dh] (the offload staging buffer)."""
    n_layers = kv.k.shape[0] if kv.stacked else len(kv.k)

    def one(row, start):
        def take(buf):  # [B, S, K, Dh] -> [blk, K, Dh]
            return jax.lax.dynamic_slice(buf, (row, start, 0, 0),
                                         (1, block_size) + buf.shape[2:])[0]

        return jnp.stack([jnp.stack([take(k), take(v)])
                          for k, v in (kv.layer(i) for i in range(n_layers))])

    return jax.vmap(one)(rows, starts)
