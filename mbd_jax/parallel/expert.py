"""Expert parallelism: the routed experts inside `jax.shard_map`.

Each device holds E / expert of the experts (and F / tensor of each expert's width) and the
tokens of its `data` shard. Between the attention and the MoE the residual stream is replicated
over `expert` and `tensor` (only rows split, on `data`), so every expert shard already holds all
of its data shard's tokens and no dispatch collective is needed:

    tokens x[N/data, D] (replicated over expert, tensor)
      -> each shard: the copies routed to its own experts, grouped matmul (the model's moe_impl),
         copies routed elsewhere get the id E_local and contribute nothing
      -> psum over (expert, tensor) of the partial outputs [N/data, D], float32
      -> out[N/data, D] (replicated over expert, tensor again)

Why an all-reduce and not an all-to-all: decode steps carry few tokens (rows x the block window,
tens to hundreds), so the step is bound by reading expert weights, which EP splits. A dropless
all-to-all with static shapes must reserve N*k rows per destination, moving more bytes than the
one [N, D] all-reduce here, which is the same collective tensor parallelism already needs after
the MLP. Nothing is dropped: every copy is computed by exactly one shard, whatever the routing.
(Large-N prefill and training would gain from an all-to-all dispatch; see docs/architecture.md.)
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mbd_jax.model import moe
from mbd_jax.model.quantize import Quantized
from mbd_jax.parallel.mesh import spec_for

ExpertFn = Callable[..., jax.Array]
TILES_PER_STEP = 4  # tiled path under EP: tiles per loop step (the skip granularity)


def sharded_experts(impl: ExpertFn, mesh: Mesh) -> ExpertFn:
    """`impl` (a moe.EXPERT_IMPLS path) run per shard under `mesh`; same contract as impl. The
    tiled path skips the tiles past the shard's own copies (moe.experts_tiled tiles_per_step)."""
    if impl is moe.experts_tiled and mesh.shape["expert"] > 1:
        impl = functools.partial(impl, tiles_per_step=TILES_PER_STEP)

    def run(x, ids, weights, w_gate, w_up, w_down):
        # x: [N, D]; ids, weights: [N, k]; w_gate, w_up: [E, D, F]; w_down: [E, F, D] (or
        # Quantized: values of those shapes, scales [E, 1, F] / [E, 1, D])
        w_in, w_out = _spec(w_gate, ("expert", "embed", "mlp")), _spec(w_down, ("expert", "mlp",
                                                                                  "embed"))
        values_in = w_in.q if isinstance(w_in, Quantized) else w_in
        rows = spec_for(("batch", None), x.shape, mesh)
        split_experts = values_in[0] == "expert"
        reduce_axes = tuple(a for a in ("expert", "tensor") if a in tuple(values_in))

        def local(x, ids, weights, w_gate, w_up, w_down):
            if rows[0] == "data":
                # The weights are the same on every data shard but meet different tokens there.
                # Marking them varying over `data` here puts the gradient's psum over `data` at
                # this point, outside the tiled path's per-shard lax.cond (a collective inside a
                # branch that some data shards skip would deadlock).
                w_gate, w_up, w_down = (
                    jax.tree.map(lambda a: jax.lax.pcast(a, ("data",), to="varying"), w)
                    for w in (w_gate, w_up, w_down))
            e_local = moe.num_experts(w_gate)
            first = jax.lax.axis_index("expert") * e_local if split_experts else 0
            here = (ids >= first) & (ids < first + e_local)
            out = impl(x, jnp.where(here, ids - first, e_local), weights, w_gate, w_up, w_down,
                       out_dtype=jnp.float32)
            if reduce_axes:
                out = jax.lax.psum(out, reduce_axes)
            return out.astype(x.dtype)

        return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, w_in, w_in, w_out),
                             out_specs=rows)(x, ids, weights, w_gate, w_up, w_down)

    def _spec(w, axes):  # the weight's PartitionSpec (a Quantized one: of values and scales)
        if isinstance(w, Quantized):
            return Quantized(spec_for(axes, w.q.shape, mesh),
                             spec_for((axes[0], None, axes[2]), w.scale.shape, mesh))
        return spec_for(axes, w.shape, mesh)

    return run
