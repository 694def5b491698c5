"""Mixture of experts: routers (pure, float32) and two interchangeable expert paths.

Shapes: N tokens, D hidden, E experts, F expert width, k experts per token.

The expert paths share one contract: `ids` [N, k] in [0, E], where id E means "this copy is not
routed to any expert held here" and contributes nothing (expert parallelism, parallel/expert.py,
passes E for copies that another shard computes). `out_dtype` defaults to x's.

Expert weights (`Experts`) come stacked, [E, D, F], or as a tuple of E per-expert arrays: the
layout an engine keeps on one CPU device (model/layout.py, split_experts). XLA:CPU's GEMMs take
whole buffers, so a matmul reading one expert of a stacked array first copies that expert's
slice; on a batch-1 decode step those copies were a third of the time. The looped path reads
per-expert arrays in place; the other paths stack them (a copy). Quantized stacked weights
(model/quantize.py's Quantized: 8-bit values, scales [E, 1, out]): the ragged path feeds the
8-bit values to `ragged_dot` and scales each row's product by its expert's scales (XLA:GPU then
reads the 8-bit operand in its GEMM, no dequantized copy); the others dequantize first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from mbd_jax.config import resolve_auto
from mbd_jax.model.quantize import Quantized, dequantize

# [E, ...] stacked, one [...] array per expert, or stacked 8-bit values with their scales
Experts = jax.Array | tuple[jax.Array, ...] | Quantized

# The routed experts' weights, as the MoE layer names them (model/transformer.py).
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


def stacked(w: Experts) -> jax.Array:
    """[E, ...]: per-expert arrays stacked (a copy), quantized ones dequantized (in their scales'
    dtype: cast() gives it); a stacked array as it is."""
    if isinstance(w, Quantized):
        return dequantize(w.q, w.scale, w.scale.dtype)
    return jnp.stack(w) if isinstance(w, tuple) else w


def num_experts(w: Experts) -> int:
    if isinstance(w, Quantized):
        return w.q.shape[0]
    return len(w) if isinstance(w, tuple) else w.shape[0]


def cast(w: Experts, dtype) -> Experts:
    """The weights in `dtype` (quantized ones: their scales, the values staying 8-bit)."""
    if isinstance(w, Quantized):
        return Quantized(w.q, w.scale.astype(dtype))
    return tuple(v.astype(dtype) for v in w) if isinstance(w, tuple) else w.astype(dtype)


def block_pools(choice: jax.Array, positions: jax.Array, window: int, pool: int) -> jax.Array:
    """Block routing (LLaDA2.2): which experts each token may take. A row's tokens fall in
    windows of `window` consecutive positions (a new window also where positions restart: a
    second copy of a block); each expert scores its best token in the window, and the `pool`
    best experts are the window's pool. Rows never share a window.
    choice: [B, T, E] selection scores; positions: [B, T] -> allowed [B * T, E] bool."""
    b, t, e = choice.shape
    blk = positions // window
    new = jnp.concatenate([jnp.ones((b, 1), bool), (blk[:, 1:] != blk[:, :-1])
                           | (positions[:, 1:] <= positions[:, :-1])], axis=1)
    seg = (jnp.cumsum(new, axis=1) - 1 + jnp.arange(b)[:, None] * t).reshape(-1)  # [N]
    best = jax.ops.segment_max(choice.reshape(b * t, e), seg, num_segments=b * t)  # [S, E]
    _, members = jax.lax.top_k(best, pool)  # [S, pool]
    in_pool = jnp.zeros((b * t, e), bool).at[jnp.arange(b * t)[:, None], members].set(True)
    return in_pool[seg]


def route_softmax_topk(logits: jax.Array, k: int, norm_topk_prob: bool,
                       scaling: float = 1.0, allowed: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """Qwen3-MoE routing. logits: [N, E] float32 -> (expert ids [N, k], weights [N, k] float32);
    `allowed` [N, E]: the experts each token may take (block_pools; None: all)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if allowed is not None:
        probs = jnp.where(allowed, probs, 0.0)
    weights, ids = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights * scaling


def route_sigmoid_grouped(logits: jax.Array, bias: jax.Array, k: int, n_group: int,
                          topk_group: int, norm_topk_prob: bool, scaling: float,
                          allowed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """LLaDA2 / DeepSeek-V3 routing.

    s = sigmoid(logits); selection uses s + bias: each group scores the sum of its top-2, only the
    best `topk_group` groups stay eligible, and the top-k eligible experts are chosen. The weights
    are the unbiased s of the chosen experts, optionally normalised to sum 1, times `scaling`.
    logits: [N, E]; bias: [E]; `allowed` [N, E]: the experts each token may take (block_pools,
    from the same selection scores; None: all), in place of the group rule (a pool holds at
    least k experts; a group rule inside it could leave fewer).
    Returns (ids [N, k], weights [N, k] float32).
    """
    n, e = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = selection_scores(logits, bias)
    if allowed is not None:
        choice = jnp.where(allowed, choice, -jnp.inf)
    elif n_group > 1:
        grouped = choice.reshape(n, n_group, e // n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_group]
        _, top_groups = jax.lax.top_k(group_score, topk_group)  # [N, topk_group]
        keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        keep = jnp.repeat(keep, e // n_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids, weights * scaling


def selection_scores(logits: jax.Array, bias: jax.Array) -> jax.Array:
    """What sigmoid_grouped routing selects by: sigmoid(logits) + bias (float32)."""
    return jax.nn.sigmoid(logits.astype(jnp.float32)) + bias.astype(jnp.float32)


def expert_load(ids: jax.Array, num_experts: int) -> jax.Array:
    """How many (token, slot) assignments each expert got. ids: [N, k] -> [E] float32."""
    return jnp.zeros((num_experts,), jnp.float32).at[ids.reshape(-1)].add(1.0)


def balance_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """The auxiliary-loss-free balancing step (DeepSeek-V3): each expert's routing bias moves by
    `rate` toward balance, down for experts above the mean load and up for those below.
    bias, load: [..., E] (a scanned run stacks its layers on a leading axis)."""
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load).astype(bias.dtype)


def experts_dense(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: Experts,
                  w_up: Experts, w_down: Experts, out_dtype=None, act=jax.nn.silu) -> jax.Array:
    """Every expert on every token, combined with the routing weights (the reference, and the
    fastest path when there are few tokens per expert, as in decoding). `act`: the gate's
    activation (SiLU; DiffusionGemma's experts take tanh-approximated GELU).

    x: [N, D]; ids, weights: [N, k]; w_gate, w_up: [E, D, F]; w_down: [E, F, D]. Returns [N, D].
    Laid out for plain GEMMs: gate/up as one batched matmul over experts, the routing weights
    applied to the hidden activations, then the down projection and the sum over experts as one
    [N, E*F] x [E*F, D] matmul (w_down is already contiguous that way). The einsum forms of the
    same sums ran 4-10x slower on XLA:CPU at decode sizes.
    """
    w_gate, w_up, w_down = stacked(w_gate), stacked(w_up), stacked(w_down)
    e, _, f = w_gate.shape
    n = x.shape[0]
    # [N, E]; one_hot of the id E is all zeros, so such copies drop out
    combine = jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32) * weights[..., None], axis=1)
    xs = jnp.broadcast_to(x, (e,) + x.shape)  # [E, N, D]
    # The barrier keeps XLA:CPU from fusing both matmuls and the gating into one loop nest,
    # which it then runs without its GEMM kernel (2.6x slower at decode sizes).
    gate, up = jax.lax.optimization_barrier((jnp.matmul(xs, w_gate), jnp.matmul(xs, w_up)))
    h = act(gate) * up * combine.T.astype(gate.dtype)[:, :, None]  # [E, N, F]
    h = jax.lax.optimization_barrier(jnp.transpose(h, (1, 0, 2)).reshape(n, e * f))  # [N, E*F]
    out = jnp.matmul(h, w_down.reshape(e * f, -1), preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def experts_ragged(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: Experts,
                   w_up: Experts, w_down: Experts, out_dtype=None, act=jax.nn.silu) -> jax.Array:
    """Grouped matmul: token copies sorted by expert, one `jax.lax.ragged_dot` per projection.

    Dropless and static-shape (N * k rows). Copies with id E sort last, outside every group
    (ragged_dot leaves rows past the groups zero; they are masked anyway). Same contract as
    `experts_dense` (`act` too).
    """
    n, k = ids.shape
    e = num_experts(w_gate)
    flat_ids = ids.reshape(-1)  # [N*k]
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)  # drops the id E
    row_expert = jnp.minimum(flat_ids[order], e - 1)  # [N*k]: each sorted row's expert

    def grouped(lhs, w, **kwargs):  # lhs [N*k, in] x each row's expert's [in, out]
        if not isinstance(w, Quantized):
            return jax.lax.ragged_dot(lhs, stacked(w), group_sizes, **kwargs)
        out = jax.lax.ragged_dot(lhs, w.q.astype(lhs.dtype), group_sizes, **kwargs)
        return out * w.scale[row_expert, 0].astype(out.dtype)  # [N*k, out]

    xs = x[token_of]  # [N*k, D]
    h = act(grouped(xs, w_gate)) * grouped(xs, w_up)
    out = grouped(h, w_down, preferred_element_type=jnp.float32)
    routed = (flat_ids[order] < e)[:, None]
    out = jnp.where(routed, out * weights.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(out).astype(
        out_dtype or x.dtype)


def experts_tiled(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: Experts,
                  w_up: Experts, w_down: Experts, out_dtype=None, tile: int = 16,
                  tiles_per_step: int | None = None) -> jax.Array:
    """Grouped matmul by tiles: token copies sorted by expert, each expert's group padded to a
    multiple of `tile` rows, then one batched matmul over the tiles with each tile's expert weights.

    Dropless and static-shape: N*k copies need at most N*k + E*(tile-1) padded rows. Only the
    routed experts' work is done (dense does all E), at the price of gathering a weight matrix per
    tile. Occupied tiles come first; with `tiles_per_step`, the tiles are computed that many at a
    time in a loop that skips every step past the last occupied tile (expert parallelism, where
    most copies belong to other shards; a `lax.cond` per step, differentiable). Same contract as
    `experts_dense`.
    """
    w_gate, w_up, w_down = stacked(w_gate), stacked(w_up), stacked(w_down)
    n, k = ids.shape
    e, d, _ = w_gate.shape
    a = n * k
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted copy i is copy order[i]
    sorted_e = flat[order]
    counts = jnp.bincount(flat, length=e)  # drops the id E
    padded = (counts + tile - 1) // tile * tile
    pad_end = jnp.cumsum(padded)
    # Padded slot of each sorted copy: its expert's padded start + its rank within the expert.
    dest = (pad_end - padded)[sorted_e] + jnp.arange(a) - (jnp.cumsum(counts) - counts)[sorted_e]
    rows = -(-(a + e * (tile - 1)) // tile) * tile
    dest = jnp.where(sorted_e < e, dest, rows)  # copies routed elsewhere get no slot
    slot = jnp.full((rows,), a, jnp.int32).at[dest].set(jnp.arange(a, dtype=jnp.int32),
                                                         mode="drop")
    valid = slot < a  # padding slots hold no copy
    copy = order[jnp.minimum(slot, a - 1)]
    token = copy // k
    xs = jnp.where(valid[:, None], x[token], 0).reshape(rows // tile, tile, d)
    tile_expert = jnp.minimum(jnp.searchsorted(pad_end, jnp.arange(rows // tile) * tile,
                                               side="right"), e - 1)

    def matmuls(xs, tile_expert):  # xs: [T, tile, D]; tile_expert: [T] -> [T, tile, D] float32
        h = jax.nn.silu(jnp.einsum("tmd,tdf->tmf", xs, w_gate[tile_expert])) * jnp.einsum(
            "tmd,tdf->tmf", xs, w_up[tile_expert])
        return jnp.einsum("tmf,tfd->tmd", h, w_down[tile_expert], preferred_element_type=jnp.float32)

    if tiles_per_step is None:
        out = matmuls(xs, tile_expert).reshape(rows, d)
    else:
        g = tiles_per_step
        steps = -(-(rows // tile) // g)
        extra = steps * g - rows // tile  # pad the tiles to whole steps (zero rows, skipped)
        xs = jnp.concatenate([xs, jnp.zeros((extra, tile, d), xs.dtype)]).reshape(steps, g, tile, d)
        tile_expert = jnp.pad(tile_expert, (0, extra)).reshape(steps, g)
        occupied = pad_end[-1] // tile  # tiles holding copies routed here

        def step(args):
            i, xs_i, te_i = args
            return jax.lax.cond(i * g < occupied, matmuls, skip, xs_i, te_i)

        def skip(xs, tile_expert):
            # Zeros built from the operands, so that inside shard_map they vary over the same mesh
            # axes as the matmuls' result (cond requires equal types).
            return xs[..., :1].astype(jnp.float32) * 0.0 + w_down[0, :1].astype(jnp.float32) * 0.0

        out = jax.lax.map(step, (jnp.arange(steps), xs, tile_expert))
        out = out.reshape(steps * g * tile, d)[:rows]
    w = jnp.where(valid, weights.reshape(-1)[copy], 0.0)
    return jnp.zeros((n, d), jnp.float32).at[token].add(out * w[:, None]).astype(
        out_dtype or x.dtype)


def experts_looped(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: Experts,
                   w_up: Experts, w_down: Experts, out_dtype=None) -> jax.Array:
    """A loop over tiles of token copies: copies sorted by expert, each expert's rows cut into
    tiles of `m`, and each tile run through three plain GEMMs with its own expert's weights.

    Reads only the hit experts' weights and does only the routed FLOPs (plus tile padding), which
    is what decoding on a CPU needs: at a few tokens per call the step is bound by reading weights
    (a 4-token block with top-4 of 16 experts touches ~10 of them). The loop's trip count is
    traced (the tiles of this routing), so one program serves every routing. With per-expert
    weights (a tuple) one flat loop over the tiles picks each tile's expert arrays through a
    `lax.switch`, one branch per expert, and reads them in place; from stacked weights a loop over
    the hit experts slices each out once (XLA:CPU copies the slice) and loops over its tiles. The
    loops are not reverse-differentiable, so the gradient is the dense path's (the same
    function). Same contract as `experts_dense`.
    """
    w_gate, w_up, w_down = (stacked(w) if isinstance(w, Quantized) else w
                            for w in (w_gate, w_up, w_down))
    return _looped(x, ids, weights, w_gate, w_up, w_down).astype(out_dtype or x.dtype)


def _loop_tile(copies: int, experts: int) -> int:
    """Rows per GEMM: the power of two at or above the mean copies per expert, in [4, 32]."""
    return min(32, max(4, 1 << math.ceil(math.log2(max(1.0, copies / experts)))))


def _ffn(wg, wu, wd, xt):  # xt: [M, D] -> [M, D] float32
    return jnp.matmul(jax.nn.silu(xt @ wg) * (xt @ wu), wd, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _looped(x, ids, weights, w_gate, w_up, w_down):  # -> [N, D] float32
    n, k = ids.shape
    e, d = num_experts(w_gate), x.shape[-1]
    a = n * k
    m = _loop_tile(a, e)
    flat = ids.reshape(-1)  # [A]
    order = jnp.argsort(flat, stable=True)  # sorted copy i is copy order[i]; id E sorts last
    counts = jnp.bincount(flat, length=e)  # drops the id E
    starts = jnp.cumsum(counts) - counts  # [E]: each expert's first sorted copy
    tiles = (counts + m - 1) // m  # [E]
    tiles_end = jnp.cumsum(tiles)  # [E]: expert i owns tiles [tiles_end[i] - tiles[i], tiles_end[i])
    xs = jnp.concatenate([x[order // k], jnp.zeros((m, d), x.dtype)])  # [A + M, D]: no clamping

    def run_tile(acc, i, r, ffn):  # acc: [A + M, D] float32, row = sorted copy's expert output
        start = starts[i] + r * m  # expert i's tile r
        out = ffn(jax.lax.dynamic_slice_in_dim(xs, start, m))  # [M, D]
        mine = start + jnp.arange(m) < starts[i] + counts[i]  # the tail is the next expert's
        old = jax.lax.dynamic_slice_in_dim(acc, start, m)
        return jax.lax.dynamic_update_slice_in_dim(acc, jnp.where(mine[:, None], out, old),
                                                   start, 0)

    # Zeros typed like the tiles' results: inside shard_map those vary over the mesh axes of
    # the operands, and a loop carry must keep its type.
    operands = sum(v[(0,) * v.ndim].astype(jnp.float32)
                   for v in jax.tree.leaves((xs, w_gate, w_up, w_down)))
    init = jnp.where(True, jnp.zeros((a + m, d), jnp.float32), operands)
    if isinstance(w_gate, tuple):
        # One flat loop over every tile; a tile's switch branch reads its expert's arrays in place.
        branches = [functools.partial(_ffn, *w) for w in zip(w_gate, w_up, w_down)]

        def tile(t, acc):
            i = jnp.searchsorted(tiles_end, t, side="right")  # the tile's expert
            return run_tile(acc, i, t - tiles_end[i] + tiles[i],
                            lambda xt: jax.lax.switch(i, branches, xt))

        acc = jax.lax.fori_loop(0, tiles_end[-1], tile, init)
    else:
        # A loop over the hit experts, each sliced out once (a copy on XLA:CPU), then a loop
        # over its tiles: slicing per tile would copy an expert once per tile.
        hit = jnp.nonzero(counts, size=e, fill_value=0)[0]  # [E]: the hit experts first

        def expert(j, acc):
            i = hit[j]
            ffn = functools.partial(_ffn, w_gate[i], w_up[i], w_down[i])
            return jax.lax.fori_loop(0, tiles[i], lambda r, acc: run_tile(acc, i, r, ffn), acc)

        acc = jax.lax.fori_loop(0, jnp.count_nonzero(counts), expert, init)
    w = jnp.where(flat[order] < e, weights.reshape(-1)[order], 0.0)
    return jnp.zeros((n, d), jnp.float32).at[order // k].add(acc[:a] * w[:, None])


def _looped_fwd(x, ids, weights, w_gate, w_up, w_down):
    return _looped(x, ids, weights, w_gate, w_up, w_down), (x, ids, weights, w_gate, w_up, w_down)


def _looped_bwd(saved, g):
    x, ids, weights, w_gate, w_up, w_down = saved
    dense = lambda x, w, wg, wu, wd: experts_dense(x, ids, w, wg, wu, wd,  # noqa: E731
                                                   out_dtype=jnp.float32)
    _, vjp = jax.vjp(dense, x, weights, w_gate, w_up, w_down)
    dx, dw, dg, du, dd = vjp(g)
    return dx, None, dw, dg, du, dd


_looped.defvjp(_looped_fwd, _looped_bwd)


EXPERT_IMPLS = {"dense": experts_dense, "ragged": experts_ragged, "tiled": experts_tiled,
                "looped": experts_looped}


def resolve_impl(name: str, backend: str | None = None) -> str:
    """The expert path `name` stands for on `backend` (config.AUTO)."""
    return resolve_auto("moe_impl", name, backend)
