"""The preallocated KV buffer: one [B, S_max, K, Dh] array per layer for k and for v.

Row b is request slot b and index s holds absolute position s. The buffer is allocated once per
engine and donated to every jitted call, so writes (`layers.write_rows`) happen in place.
`load_blocks` / `gather_blocks` move whole blocks in and out (the prefix cache).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # num_layers x [B, S_max, K, Dh]
    v: tuple[jax.Array, ...]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)


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
    shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
    return KVCache(k=zeros(), v=zeros())


def load_blocks(kv: KVCache, blocks: jax.Array, row: jax.Array, start: jax.Array) -> KVCache:
    """Writes cached KV into one row: blocks [L, 2, T, K, Dh] go to positions [start, start + T)."""
    def put(buf: jax.Array, new: jax.Array) -> jax.Array:  # buf: [B, S, K, Dh]; new: [T, K, Dh]
        return jax.lax.dynamic_update_slice(buf, new[None].astype(buf.dtype), (row, start, 0, 0))

    return KVCache(k=tuple(put(k, blocks[i, 0]) for i, k in enumerate(kv.k)),
                   v=tuple(put(v, blocks[i, 1]) for i, v in enumerate(kv.v)))


def gather_blocks(kv: KVCache, rows: jax.Array, starts: jax.Array, block_size: int) -> jax.Array:
    """The KV of n blocks, block i at positions [starts[i], starts[i] + blk) of row rows[i]:
    [n, L, 2, blk, K, Dh] (the offload staging buffer)."""
    def one(row, start):
        take = lambda buf: jax.lax.dynamic_slice(  # noqa: E731
            buf, (row, start, 0, 0), (1, block_size) + buf.shape[2:])[0]
        return jnp.stack([jnp.stack([take(k), take(v)]) for k, v in zip(kv.k, kv.v)])

    return jax.vmap(one)(rows, starts)
