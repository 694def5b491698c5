"""The attention kernel under a device mesh: a Pallas call is one opaque program that XLA's
partitioner cannot split, so it runs inside `jax.shard_map`, each device on its own shards.

    q [B, T, H, Dh]: rows on `data`, query heads on `tensor`
    k, v pools [P, page, K, Dh]: kv heads on `tensor` (pages replicated: any row's); an 8-bit
    pool's scales [P, page, K] with them
    page table [R, n], the query rows' cache rows and lengths: replicated / like the rows

A device's query heads are exactly the groups of its own kv heads (heads split on `tensor` only
when the kv heads are too), so no collective is needed: every output element is computed where
it lives.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from mbd_jax.parallel.mesh import spec_for


def sharded_attention(kernel: Callable[..., jax.Array], mesh: Mesh) -> Callable[..., jax.Array]:
    """`kernel(q, k_layer, v_layer, table, q_pos, visible_len, rows=) -> out [B, T, H, Dh]`
    (model/paged_attention_kernel.py's contract) run per shard under `mesh`."""

    def run(q, k_layer, v_layer, table, q_pos, visible_len, rows):
        values = k_layer[0] if isinstance(k_layer, tuple) else k_layer
        pool = spec_for(("pages", "page", "kv_heads", "head_dim"), values.shape, mesh)
        heads = pool[2]  # the query heads split with their kv heads, or not at all
        if isinstance(k_layer, tuple):  # an 8-bit pool: (values, scales)
            pool = (pool, P(*pool[:3]))
        batch = spec_for(("batch",), (q.shape[0],), mesh)[0]
        queries = P(batch, None, heads, None)
        local = lambda q, k, v, table, pos, vis, rows: kernel(  # noqa: E731
            q, k, v, table, pos, vis, rows=rows)
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(queries, pool, pool, P(), P(batch), P(batch), P(batch)),
                             out_specs=queries, check_vma=False)(q, k_layer, v_layer, table, q_pos, visible_len,
                                                rows)

    return run
