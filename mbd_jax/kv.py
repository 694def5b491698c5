"""The preallocated KV buffer: k and v, each one [L, B, S_max, K, Dh] array for all layers.

Row b is request slot b and index s holds absolute position s. The buffer is allocated once per
engine and donated to every jitted call, so writes happen in place. The layers reach it only
through `write` and `chunk` with a layer index that may be traced (the scanned layer loop carries
the whole buffer); `load_blocks` / `gather_blocks` move whole blocks in and out (the prefix cache).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig

LOGICAL_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")  # of k and v (parallel/mesh.py)


@flax.struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S_max, K, Dh]
    v: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer, k_new: jax.Array, v_new: jax.Array, offset: jax.Array) -> KVCache:
        """k_new[b], v_new[b] ([B, T, K, Dh]) go to positions [offset[b], offset[b] + T) of row b
        in `layer`. The caller guarantees offset + T <= S_max (dynamic_update_slice would clamp
        and silently overwrite earlier positions otherwise)."""
        return KVCache(k=_write_rows(self.k, layer, k_new, offset),
                       v=_write_rows(self.v, layer, v_new, offset))

    def chunk(self, layer, start, size: int) -> tuple[jax.Array, jax.Array]:
        """Positions [start, start + size) of every row in `layer`: k, v [B, size, K, Dh]."""
        def take(buf):
            b, _, kh, dh = buf.shape[1:]
            return jax.lax.dynamic_slice(buf, (layer, 0, start, 0, 0), (1, b, size, kh, dh))[0]

        return take(self.k), take(self.v)


def _write_rows(buf: jax.Array, layer, new: jax.Array, offset: jax.Array) -> jax.Array:
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
    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    if capacity % cfg.attention_chunk:
        raise ValueError(f"KV capacity {capacity} must be a multiple of attention_chunk "
                         f"{cfg.attention_chunk}")
    shape = (cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def load_blocks(kv: KVCache, blocks: jax.Array, row: jax.Array, start: jax.Array) -> KVCache:
    """Writes cached KV into one row: blocks [L, 2, T, K, Dh] go to positions [start, start + T)."""
    def put(buf: jax.Array, new: jax.Array) -> jax.Array:  # new: [L, T, K, Dh]
        return jax.lax.dynamic_update_slice(buf, new[:, None].astype(buf.dtype),
                                            (0, row, start, 0, 0))

    return KVCache(k=put(kv.k, blocks[:, 0]), v=put(kv.v, blocks[:, 1]))


def gather_blocks(kv: KVCache, rows: jax.Array, starts: jax.Array, block_size: int) -> jax.Array:
    """The KV of n blocks, block i at positions [starts[i], starts[i] + blk) of row rows[i]:
    [n, L, 2, blk, K, Dh] (the offload staging buffer)."""
    def one(row, start):
        take = lambda buf: jax.lax.dynamic_slice(  # noqa: E731
            buf, (0, row, start, 0, 0), (buf.shape[0], 1, block_size) + buf.shape[3:])[:, 0]
        return jnp.stack([take(kv.k), take(kv.v)], axis=1)  # [L, 2, blk, K, Dh]

    return jax.vmap(one)(rows, starts)
