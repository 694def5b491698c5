"""Block-causal attention over the paged KV pool as a Pallas kernel (the Triton backend on GPU,
Pallas' interpreter elsewhere): `attention_impl: pallas`. The pure-JAX online-softmax loop
(layers.chunked_attention) is its reference.

One kernel instance per (query row, kv head, tile of queries): it holds its tile of queries
([TQ, Dh], the G query heads of the kv head stacked along the query axis) and walks the row's
pages through the page table, one tile of keys ([KT, Dh] of K and of V, KT = 64 or the page) per
loop step, with an online softmax in float32 (a whole 512-position page of K and V at head_dim
128 would ask 528 KiB of shared memory, over an H200's 227). Each row reads only the pages its own queries can see (below its visible
length and the end of its latest query block), not the longest row's, and a free row reads none.

Why Triton and not Mosaic GPU: the kernel's work is a gather of whole pages by a table read
inside the loop and two small matmuls per page; Triton lowers data-dependent loads and dynamic
trip counts directly and runs on every NVIDIA GPU jaxlib supports, where Mosaic GPU targets
Hopper's TMA and warpgroup pipelines (worth it for large prefill tiles, not for a decode window of
tens of queries). Triton needs power-of-two load shapes and matmul sides of at least 16: the
query tile is padded to a power of two; `page` and `head_dim` must be powers of two >= 16 on GPU
(`check_shapes`).

An 8-bit pool (model/paged_kv.py: values and a float32 scale per position and kv head) is read
as it is stored: each key tile's 8-bit values enter the score matmul (cast to the query's dtype)
and their scales multiply the scores' columns; the value scales multiply the probabilities'
columns before the second matmul. No dequantized copy of a page is made.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mbd_jax.model.layers import NEG_INF, block_causal
from mbd_jax.model.paged_kv import Pool

MAX_QUERY_TILE = 64  # queries per kernel instance (a prefill chunk's are split into tiles)
KEY_TILE = 64  # keys per loop step, when it divides the page (else the whole page)
NUM_WARPS, NUM_STAGES = 4, 2  # Triton launch settings (untuned: no GPU has timed them yet)


def check_shapes(page: int, head_dim: int) -> str | None:
    """Why the GPU kernel cannot take these shapes (None: it can)."""
    for name, n in (("page (attention_chunk)", page), ("head_dim", head_dim)):
        if n < 16 or n & (n - 1):
            return f"{name} is {n}; the Triton kernel needs a power of two >= 16"
    return None


def _kernel(rows_ref, visible_ref, table_ref, pos_ref, q_ref, k_ref, v_ref, *refs,
            block_size: int, page: int, keys: int):
    # rows, visible: [B]; table: [B, pages per row]; pos: [TQ]; q: [TQ, Dh];
    # k, v: [P, page, K, Dh] (the whole layer pool); refs: (k scales, v scales: [P, page, K],
    # of an 8-bit pool), then o: [TQ, Dh]
    *scale_refs, o_ref = refs
    b, head = pl.program_id(0), pl.program_id(1)
    row, vis = rows_ref[b], visible_ref[b]
    q, pos = q_ref[...], pos_ref[...]
    # the keys this tile can see: below the row's visible length and its last block's end
    need = jnp.minimum(vis, jnp.max((pos // block_size + 1) * block_size))
    n_tiles = (jnp.maximum(need, 0) + keys - 1) // keys
    per_page = jnp.int32(page // keys)

    def step(i, carry):  # key tile i: positions [i * keys, (i + 1) * keys)
        m, l, acc = carry  # [TQ], [TQ], [TQ, Dh] float32
        # (lax.rem: jnp's % lowers to Triton with mismatched operand types)
        where, first = table_ref[row, i // per_page], jax.lax.rem(i, per_page) * keys
        # a table entry past the pool maps nothing (a released row's stale length may reach
        # one): its keys are masked, and the load stays inside the pool (Triton does not check)
        held = where < k_ref.shape[0]
        where = jnp.minimum(where, k_ref.shape[0] - 1)
        k = k_ref[where, pl.ds(first, keys), head, :].astype(q.dtype)  # [keys, Dh]
        v = v_ref[where, pl.ds(first, keys), head, :].astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32)  # [TQ, keys]
        if scale_refs:  # each key's scale multiplies its column of scores
            k_scale, v_scale = (r[where, pl.ds(first, keys), head] for r in scale_refs)  # [keys]
            s = s * k_scale[None, :]
        # [TQ, keys]: the block-causal rule, and nothing from an unmapped page
        mask = block_causal(pos[:, None], i * keys + jnp.arange(keys)[None, :], vis,
                            block_size) & held
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # a query with nothing seen: 0
        corr = jnp.exp(m - m_new)
        pv = p * v_scale[None, :] if scale_refs else p  # each value's scale, on its column
        acc = acc * corr[:, None] + plgpu.dot(pv.astype(v.dtype), v).astype(jnp.float32)
        return m_new, l * corr + jnp.sum(p, axis=1), acc

    tq, dh = q.shape
    init = (jnp.full((tq,), NEG_INF, jnp.float32), jnp.zeros((tq,), jnp.float32),
            jnp.zeros((tq, dh), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_tiles, step, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def paged_attention(q: jax.Array, k_layer: Pool, v_layer: Pool, table: jax.Array,
                    q_pos: jax.Array, visible_len: jax.Array, block_size: int,
                    rows: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """Block-causal attention of q over one layer's paged pool (the contract of
    layers.chunked_attention).

    q: [B, T, H, Dh]; k_layer, v_layer: [P, page, K, Dh], or an 8-bit pool's (values, scales
    [P, page, K]) (PagedKV.layer); table: [R, pages per row] (the pool
    page of each cache row's logical page); q_pos: [B, T]; visible_len: [B]; rows: [B] the cache
    row of each query row (None: row b). `interpret`: run in Pallas' interpreter (any platform;
    the GPU kernel otherwise). Returns [B, T, H, Dh].
    """
    b, t, h, dh = q.shape
    scales = ()
    if isinstance(k_layer, tuple):  # an 8-bit pool
        (k_layer, k_scale), (v_layer, v_scale) = k_layer, v_layer
        scales = (k_scale, v_scale)
    page, kh = k_layer.shape[1], k_layer.shape[2]
    g = h // kh
    # [B, K, G * T, Dh]: a kv head's query heads stacked along the query axis, pre-scaled
    qg = jnp.transpose(q.reshape(b, t, kh, g, dh), (0, 2, 3, 1, 4)).reshape(b, kh, g * t, dh)
    qg = (qg.astype(jnp.float32) * dh ** -0.5).astype(q.dtype)
    pos = jnp.tile(q_pos, (1, g)).astype(jnp.int32)  # [B, G * T]
    tile = min(pl.next_power_of_2(g * t), MAX_QUERY_TILE)
    padded = pl.cdiv(g * t, tile) * tile
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded - g * t), (0, 0)))
    pos = jnp.pad(pos, ((0, 0), (0, padded - g * t)), constant_values=-1)  # sees nothing
    rows = jnp.arange(b, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, block_size=block_size, page=page,
                          keys=KEY_TILE if page % KEY_TILE == 0 else page),
        grid=(b, kh, padded // tile),
        in_specs=[whole(rows.shape), whole(visible_len.shape), whole(table.shape),
                  pl.BlockSpec((None, tile), lambda r, k, i: (r, i)),
                  pl.BlockSpec((None, None, tile, dh), lambda r, k, i: (r, k, i, 0)),
                  whole(k_layer.shape), whole(v_layer.shape),
                  *(whole(s.shape) for s in scales)],
        out_specs=pl.BlockSpec((None, None, tile, dh), lambda r, k, i: (r, k, i, 0)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        # Triton params select the Triton backend (jax 0.10's default GPU backend is Mosaic GPU)
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        name="paged_block_causal_attention",
    )(rows, visible_len.astype(jnp.int32), table.astype(jnp.int32), pos, qg, k_layer, v_layer,
      *scales)
    out = out[:, :, : g * t].reshape(b, kh, g, t, dh)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, dh)
