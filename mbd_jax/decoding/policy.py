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


def _truncate(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keeps the smallest set of tokens whose probability reaches top_p, and at most top_k of
    them (top_k 0: no limit). logits: [B, W, V]; top_k, top_p: [B]."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None, None], axis=-1), 1)  # [B, W]
    n_keep = jnp.where(top_k[:, None] > 0, jnp.minimum(n_keep, top_k[:, None]), n_keep)
    cutoff = jnp.take_along_axis(sorted_logits, (n_keep - 1)[..., None], axis=-1)
    return jnp.where(logits >= cutoff, logits, NEG_INF)


def predict(logits: jax.Array, mask_token_id: int, temperature: jax.Array, top_k: jax.Array,
            top_p: jax.Array, keys: jax.Array, op_ids: tuple[int, ...] = ()
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Proposes a token and its confidence at every window position.

    logits: [B, W, V] float32; temperature, top_k, top_p: [B]; keys: [B] PRNG keys (one per row, so a
    row's samples do not depend on its batch neighbours); op_ids: the model's edit-action ids
    (decoding/indel.py), never proposed as text. Returns (token [B, W], confidence [B, W] =
    softmax probability of that token, mask excluded; greedy [B, W] argmax; op_conf [B, W, ops]
    each action's probability under the same softmax).
    """
    logits = logits.at[..., mask_token_id].set(NEG_INF)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    op_conf = jnp.exp(log_probs[..., list(op_ids)])
    if op_ids:
        logits = logits.at[..., list(op_ids)].set(NEG_INF)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample():
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None, None]
        # top-k / top-p sort the whole vocabulary: only when some row asks. Plain temperature
        # sampling draws by Gumbel-max, reductions over the vocabulary only, so logits split
        # over tensor shards stay there (tests/test_mesh.py checks the compiled program).
        truncate = jnp.any((top_k > 0) | (top_p < 1.0))
        scaled = jax.lax.cond(truncate, lambda: _truncate(scaled, top_k, top_p), lambda: scaled)
        drawn = jax.vmap(lambda k, lg: jax.random.categorical(k, lg, axis=-1))(keys, scaled)
        return jnp.where((temperature > 0)[:, None], drawn.astype(jnp.int32), greedy)

    token = jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)
    confidence = jnp.exp(jnp.take_along_axis(log_probs, token[..., None], axis=-1)[..., 0])
    return token, confidence, greedy, op_conf


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
