"""Pure functions for the transformer's math: RMSNorm, rotary embedding, block-causal attention.

Shapes: B batch rows, T new tokens, S key positions, H query heads, K kv heads, G = H // K query
heads per kv head, Dh head dim. Positions are absolute (the KV pool maps them to pages: model/paged_kv.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mbd_jax.model.paged_kv import PagedKV

NEG_INF = -1e30  # finite "minus infinity": fully masked rows stay finite (no NaN from exp/div)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., D] normalised in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def block_causal(q_pos: jax.Array, k_pos: jax.Array, visible_len: jax.Array,
                 block_size: int) -> jax.Array:
    """The block-causal rule on absolute positions, elementwise (broadcast the operands as the
    caller's layout needs; the Pallas kernel applies it to one row's tile): the query at p sees
    the key at k iff k < (p // block + 1) * block and k < visible_len."""
    return (k_pos < (q_pos // block_size + 1) * block_size) & (k_pos < visible_len)


def block_causal_visible(q_pos: jax.Array, k_pos: jax.Array, visible_len: jax.Array,
                         block_size: int) -> jax.Array:
    """q_pos: [B, T]; k_pos: [S] or [B, S]; visible_len: [B]. Returns bool [B, T, S]: the
    block-causal rule (block_causal) for every query and key."""
    if k_pos.ndim == 1:
        k_pos = k_pos[None, :]
    return block_causal(q_pos[:, :, None], k_pos[:, None, :], visible_len[:, None, None],
                        block_size)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Reference attention over all S keys with an explicit mask.

    q: [B, T, H, Dh]; k, v: [B, S, K, Dh]; mask: bool [B, T, S]. Returns [B, T, H, Dh].
    """
    b, t, h, dh = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (dh ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(q.dtype)


def chunked_attention(q: jax.Array, kv: PagedKV, slot, q_pos: jax.Array,
                      visible_len: jax.Array, block_size: int, chunk: int,
                      rows: jax.Array | None = None, used: jax.Array | None = None) -> jax.Array:
    """Block-causal attention over one layer of the paged KV pool, reading only the used prefix.

    An online-softmax loop over `chunk`-sized key slices (one page per row each, through the
    page table); its trip count is ceil(max(visible_len) / chunk), a traced value, so the cost
    follows the longest visible row and not the pool's size, and one compiled program serves
    every length. The loop runs in two parts: first the key chunks every query of every used
    row sees whole (below the earliest query block and every visible length: no mask to build
    or apply), then the rest with the block-causal mask. A row whose output nobody reads (`used`
    False: a free or finished row in decode, a row outside a prefill) does not bound the first
    part; it may read keys past its visible length there, and its output is finite and unused.

    Inside the loop a kv head's G query heads are one [G * T] query axis, so each key chunk is
    two plain batched matmuls ([G * T, Dh] x [Dh, chunk], then [G * T, chunk] x [chunk, Dh]) per
    (row, kv head): with a 5-d "btkgd" layout XLA:CPU ran them 2-3x slower (docs/lab/performance-history.md).

    q: [B, T, H, Dh]; kv: the pool (chunk a whole number of pages); slot: the attention layer
    (int, may be traced);
    q_pos: [B, T]; visible_len: [B]; rows: [B] the cache row of each query row (None: row b);
    used: [B] bool, the rows whose output is read (None: every row). Returns [B, T, H, Dh].
    """
    b, t, h, dh = q.shape
    s_max, kh = kv.capacity, kv.kv_heads
    g = h // kh
    # qg: [B, K, G * T, Dh] (query heads of a kv head stacked along the query axis), pre-scaled
    qg = jnp.transpose(q.reshape(b, t, kh, g, dh), (0, 2, 3, 1, 4)).reshape(b, kh, g * t, dh)
    qg = (qg.astype(jnp.float32) * dh ** -0.5).astype(q.dtype)
    qg_pos = jnp.tile(q_pos, (1, g))  # [B, G * T], in qg's query order
    # Keys at or beyond the end of the last query's block are never visible.
    need = jnp.minimum(jnp.max(visible_len), jnp.max(q_pos // block_size + 1) * block_size)
    n_chunks = jnp.clip((need + chunk - 1) // chunk, 1, s_max // chunk)
    # Keys below this every query of every used row sees: the unmasked part of the loop.
    seen = jnp.minimum(jnp.min(q_pos // block_size, axis=1) * block_size, visible_len)  # [B]
    seen_by_all = jnp.min(seen if used is None else jnp.where(used, seen, s_max))
    n_unmasked = jnp.clip(seen_by_all // chunk, 0, n_chunks)

    # This layer's key and value pools, taken out once: the loop then carries one layer, not a
    # whole stacked pool (which XLA:CPU would copy into the loop for every layer).
    k_layer, v_layer = kv.layer(slot)  # [P, page, K, Dh]

    def step(i, carry, masked: bool):
        m, l, acc = carry  # m, l: [B, K, G * T]; acc: [B, K, G * T, Dh]
        start = i * chunk
        ks = kv.span(k_layer, rows, start, chunk).astype(q.dtype)  # [B, chunk, K, Dh]
        vs = kv.span(v_layer, rows, start, chunk).astype(q.dtype)
        s = jnp.einsum("bkqd,bskd->bkqs", qg, ks, preferred_element_type=jnp.float32)
        if masked:
            mask = block_causal_visible(qg_pos, start + jnp.arange(chunk), visible_len,
                                        block_size)[:, None]  # [B, 1, G * T, chunk]
            s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if masked:  # a query that has seen no key yet has m_new = NEG_INF: exp(0) for its masks
            p = jnp.where(mask, p, 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("bkqs,bskd->bkqd", p.astype(q.dtype), vs,
                                                 preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((b, kh, g * t), NEG_INF, jnp.float32), jnp.zeros((b, kh, g * t), jnp.float32),
            jnp.zeros((b, kh, g * t, dh), jnp.float32))
    carry = jax.lax.fori_loop(0, n_unmasked, lambda i, c: step(i, c, masked=False), init)
    _, l, acc = jax.lax.fori_loop(n_unmasked, n_chunks, lambda i, c: step(i, c, masked=True),
                                  carry)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # rows that see nothing (padding) stay finite
    out = jnp.transpose(out.reshape(b, kh, g, t, dh), (0, 3, 1, 2, 4))  # [B, T, K, G, Dh]
    return out.reshape(b, t, h, dh).astype(q.dtype)
