"""Unmasking rules: what to predict at each masked position, and which predictions to accept.

Pure functions over one decode window. Shapes: B rows, W = N_buf * blk window tokens, V vocab,
N buffer slots, blk block size. Per-row decoding parameters are [B] arrays, so rows with
different settings share one compiled step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mbd_jax.model.layers import NEG_INF

POLICY_THRESHOLD = 0
POLICY_FIXED_STEPS = 1
POLICY_FACTOR = 2
POLICY_IDS = {"threshold": POLICY_THRESHOLD, "fixed_steps": POLICY_FIXED_STEPS, "factor": POLICY_FACTOR}


def _float_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats reversed, then all shifted)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
    return jax.lax.bitcast_convert_type(i ^ jnp.int32(-(2**31)), jnp.uint32)


def _key_float(k: jax.Array) -> jax.Array:
    """The inverse of _float_key."""
    i = jax.lax.bitcast_convert_type(k, jnp.int32) ^ jnp.int32(-(2**31))
    return jax.lax.bitcast_convert_type(jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i), jnp.float32)


def _largest_thresholds(logits: jax.Array, holds) -> jax.Array:
    """For each of the two conditions holds(t) -> [2, B, W] (each true at every position's min
    logit, and only turning false as t grows), the largest value t with it true: [2, B, W]. A
    binary search over the ordered float keys between each position's min and max logit, both
    conditions in one loop (each halving reads the logits once): 32 halvings pin one float, each
    a reduction over the vocabulary, so a tensor-split vocabulary stays on its shards."""
    lo = jnp.broadcast_to(_float_key(jnp.min(logits, axis=-1)), (2, *logits.shape[:-1]))
    hi = jnp.broadcast_to(_float_key(jnp.max(logits, axis=-1)), lo.shape)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2
        ok = holds(_key_float(mid)) & (lo < hi)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo >= hi), hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return _key_float(lo)


def _truncate(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keeps the smallest set of tokens whose probability reaches top_p, and at most top_k of
    them (top_k 0: no limit); tokens tied with the last one kept are kept too. logits: [B, W, V];
    top_k, top_p: [B].

    No sort: the top-k cutoff is the largest value with at least k logits at or above it, the
    top-p cutoff the largest value whose logits at or above it hold at least top_p of the
    probability, both found by one binary search of [B, W] reductions (_largest_thresholds);
    the kept set is every logit at or above the higher cutoff (the same set as sorting and
    cutting at rank min(k, n_p) - 1, ties included). 32 reads of the logits where a sort would
    sort them."""
    probs = jax.nn.softmax(logits, axis=-1)
    k, p = top_k[:, None], top_p[:, None]

    def holds(t):  # t: [2, B, W] candidate cutoffs for top-k, top-p
        at_least = logits[None] >= t[..., None]  # [2, B, W, V]
        count = jnp.sum(at_least[0], axis=-1)
        mass = jnp.sum(jnp.where(at_least[1], probs, 0.0), axis=-1)
        return jnp.stack([count >= k, mass >= p])

    by_k, by_p = _largest_thresholds(logits, holds)
    no_limit = jnp.full_like(by_k, -jnp.inf)
    cutoff = jnp.maximum(jnp.where(k > 0, by_k, no_limit), jnp.where(p < 1.0, by_p, no_limit))
    return jnp.where(logits >= cutoff[..., None], logits, NEG_INF)


def max_and_argmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max, argmax) over the last axis (ties: the lowest index) as two plain reductions, the
    max and then the least index holding it: on a tensor-split vocabulary each is an all-reduce
    of one value per position, where a variadic (value, index) reduce gathers a pair from every
    shard."""
    top = jnp.max(x, axis=-1)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == top[..., None], index, x.shape[-1]), axis=-1)
    return top, first.astype(jnp.int32)


def predict(logits: jax.Array, mask_token_id: int, temperature: jax.Array, top_k: jax.Array,
            top_p: jax.Array, keys: jax.Array, op_ids: tuple[int, ...] = ()
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Proposes a token and its confidence at every window position.

    logits: [B, W, V] float32; temperature, top_k, top_p: [B]; keys: [B] PRNG keys (one per row, so a
    row's samples do not depend on its batch neighbours); op_ids: the model's edit-action ids
    (decoding/indel.py), never proposed as text. Returns (token [B, W], confidence [B, W] =
    softmax probability of that token, mask excluded; greedy [B, W] argmax; op_conf [B, W, ops]
    each action's probability under the same softmax).

    Every quantity is a reduction over the vocabulary: with the LM head split on the tensor
    axis, a greedy step moves three values per position (the max, the argmax, the softmax's
    sum: all-reduces), never a logit row; sampling adds the drawn token's logit, and top-k / top-p
    their binary searches' sums (tests/test_mesh.py reads the compiled program).
    """
    logits = logits.at[..., mask_token_id].set(NEG_INF)
    text = logits.at[..., list(op_ids)].set(NEG_INF) if op_ids else logits
    top, greedy = max_and_argmax(text)  # [B, W]
    op_logits = logits[..., list(op_ids)]  # [B, W, ops]
    m = jnp.maximum(top, jnp.max(op_logits, axis=-1)) if op_ids else top
    # log-probability of x at a position = (x - m) - log_z, as jax.nn.log_softmax computes it
    log_z = jnp.log(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1))  # [B, W]
    op_conf = jnp.exp((op_logits - m[..., None]) - log_z[..., None])

    def sample():
        scaled = text / jnp.maximum(temperature, 1e-6)[:, None, None]
        # Temperature sampling draws by Gumbel-max and top-k / top-p cut by binary searches
        # (_truncate, only when some row asks): reductions over the vocabulary only.
        truncate = jnp.any((top_k > 0) | (top_p < 1.0))
        scaled = jax.lax.cond(truncate, lambda: _truncate(scaled, top_k, top_p), lambda: scaled)
        # jax.random.categorical's Gumbel-max draw (the same noise), its argmax as all-reduces
        drawn = jax.vmap(lambda k, lg: max_and_argmax(
            jax.random.gumbel(k, lg.shape, lg.dtype) + lg)[1])(keys, scaled)
        token = jnp.where((temperature > 0)[:, None], drawn.astype(jnp.int32), greedy)
        return token, jnp.take_along_axis(text, token[..., None], axis=-1)[..., 0]

    token, chosen = jax.lax.cond(jnp.any(temperature > 0), sample, lambda: (greedy, top))
    return token, jnp.exp((chosen - m) - log_z), greedy, op_conf


def rank(score: jax.Array) -> jax.Array:
    """0 for the highest score along the last axis, 1 for the next, ... (ties: lower index
    first)."""
    return jnp.argsort(jnp.argsort(-score, axis=-1, stable=True), axis=-1, stable=True)


def select(confidence: jax.Array, maskable: jax.Array, prev_fill: jax.Array, policy: jax.Array,
           accept_threshold: jax.Array, tokens_per_step: jax.Array, factor: jax.Array,
           semi_complete_threshold: jax.Array, n_slots: int) -> jax.Array:
    """Which masked positions to fill this step. Returns bool [B, W].

    confidence, maskable: [B, W] (maskable = masked and in an ACTIVE block of a live row);
    prev_fill: [B, N] filled share of each slot's predecessor block (1 for the first slot, whose
    predecessor is cached); per-row [B]: policy, accept_threshold, tokens_per_step, factor,
    semi_complete_threshold.

    threshold:   accept every position with confidence > accept_threshold; a block that accepts
                 none takes its single most confident position, if its predecessor is at least
                 semi_complete_threshold filled.
    fixed_steps: each block takes its tokens_per_step most confident positions, with the same
                 predecessor gate.
    factor:      (Fast-dLLM) with a block's masked confidences sorted c_0 >= c_1 >= ..., accept
                 the largest prefix whose every m has (m + 1) * (1 - c_m) <= factor; the product
                 grows with m, so that is each position with (rank + 1) * (1 - c) <= factor. A
                 block that accepts none takes its top-1, with the same predecessor gate.
    """
    b, w = confidence.shape
    blk = w // n_slots
    conf = jnp.where(maskable, confidence, -1.0).reshape(b, n_slots, blk)
    can = maskable.reshape(b, n_slots, blk)
    order = rank(conf)
    gate = (prev_fill >= semi_complete_threshold[:, None])[..., None]  # [B, N, 1]

    by_factor = can & ((order + 1) * (1.0 - conf) <= factor[:, None, None])
    confident = jnp.where((policy == POLICY_FACTOR)[:, None, None], by_factor,
                          can & (conf > accept_threshold[:, None, None]))
    fallback = can & (order == 0) & ~jnp.any(confident, axis=-1, keepdims=True) & gate
    by_steps = can & (order < tokens_per_step[:, None, None]) & gate
    fixed = (policy == POLICY_FIXED_STEPS)[:, None, None]
    return jnp.where(fixed, by_steps, confident | fallback).reshape(b, w)
