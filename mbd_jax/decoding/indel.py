"""Levenshtein editing (LLaDA2.2): a filled token may be deleted, or given a MASK before it.

A model with edit ops has two action ids (ModelConfig.delete_token_id, split_token_id). At a
filled generated position of an ACTIVE block, in sampling_mode "indel", the model's choice
among the text tokens, DELETE and SPLIT wins when it differs from the token there and its
probability exceeds edit_threshold (decoding/loop.py). An action id is never written: it acts
at once, inside its block, whose length is fixed:

    DELETE at i:  the block's generated tokens after i move one left; a MASK fills the end
    SPLIT at i:   a MASK is inserted before token i; the block's last generated token drops off

so a block holds text and MASK only, and it commits (becomes TO_CACHE) by the rule every block
does: no MASK left and settled (edit mode's rule, block_buffer.advance). Its KV is written by
the forward after that, from its final tokens: the cache stays exact.

Three rules keep a block from wandering (pure functions below; tests/test_indel.py):

- progress: a step that deletes or splits in a block with M masks keeps at most M - 1 of those
  ops (the most confident) and fills at least one more mask than the ops add (the most confident
  masks, beside what the unmasking policy picked). So every step with ops in a block that holds
  a mask ends with fewer masks: the masks drain; ops on a full block add masks that then drain.
- the final round: from a block's last allowed step on (block_size + max_post_edit_steps
  forwards) it takes no ops; its masks fill by the policy and it commits when full. No action id
  is ever on the canvas, so there is nothing else to scrub.
- anti-loop: each slot keeps the hashes of its last H block states; a forward that changes a
  block back into one of them stops ops in that block until it commits (substitutions and
  unmasking go on, bounded by the final round).

Shapes: B rows, N slots of blk positions, W = N * blk, H remembered states per slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mbd_jax.decoding import policy
from mbd_jax.decoding.block_buffer import DecodeState

OP_NONE, OP_DELETE, OP_SPLIT = 0, 1, 2
HISTORY = 8  # block states each slot remembers for the anti-loop rule

# odd per-position multipliers for the block hash (uint32 arithmetic wraps)
_HASH_MULT = 0x9E3779B1


def history_len(cfg) -> int:
    """H for a model: HISTORY with edit ops, else 0 (the state carries nothing for them)."""
    return HISTORY if cfg.edit_op_ids else 0


def choose(op_conf: jax.Array, text_conf: jax.Array, candidate: jax.Array,
           threshold: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Which op each position takes. op_conf: [B, W, 2] probabilities of DELETE and SPLIT;
    text_conf: [B, W] the proposed text token's; candidate: [B, W] positions that may take an
    op; threshold: [B]. Returns (op [B, W] OP_*, its probability [B, W])."""
    best = jnp.argmax(op_conf, axis=-1)
    conf = jnp.max(op_conf, axis=-1)
    wins = candidate & (conf > text_conf) & (conf > threshold[:, None])
    return jnp.where(wins, best + 1, OP_NONE).astype(jnp.int32), conf


def plan(op_conf: jax.Array, text_conf: jax.Array, candidate: jax.Array, maskable: jax.Array,
         threshold: jax.Array, n_slots: int) -> tuple[jax.Array, jax.Array]:
    """One step's ops under the progress rule: (op [B, W], the masks they oblige the step to
    fill [B, W] bool)."""
    op, conf = choose(op_conf, text_conf, candidate, threshold)
    op = limit_for_progress(op, conf, maskable, n_slots)
    return op, progress_fill(op, text_conf, maskable, n_slots)


def limit_for_progress(op: jax.Array, op_conf: jax.Array, maskable: jax.Array,
                       n_slots: int) -> jax.Array:
    """The progress rule's cap: in a block with M > 0 masks only its M - 1 most confident ops
    stay (a block with no mask keeps every op). op, op_conf, maskable: [B, W]."""
    b, w = op.shape
    blk = w // n_slots
    has = (op != OP_NONE).reshape(b, n_slots, blk)
    m = jnp.sum(maskable.reshape(b, n_slots, blk), axis=-1, keepdims=True)  # [B, N, 1]
    rank = policy.rank(jnp.where(has, op_conf.reshape(b, n_slots, blk), -1.0))
    keep = has & ((m == 0) | (rank < m - 1))
    return jnp.where(keep.reshape(b, w), op, OP_NONE)


def progress_fill(op: jax.Array, confidence: jax.Array, maskable: jax.Array,
                  n_slots: int) -> jax.Array:
    """The masks a block with O ops must fill this step: its O + 1 most confident (none where
    it has no op). [B, W] bool."""
    b, w = op.shape
    blk = w // n_slots
    n_ops = jnp.sum((op != OP_NONE).reshape(b, n_slots, blk), axis=-1, keepdims=True)
    need = jnp.where(n_ops > 0, n_ops + 1, 0)
    conf = jnp.where(maskable, confidence, -1.0).reshape(b, n_slots, blk)
    return (maskable.reshape(b, n_slots, blk) & (policy.rank(conf) < need)).reshape(b, w)


def apply(win: jax.Array, values: jax.Array, op: jax.Array, region: jax.Array, n_slots: int,
          mask_token_id: int) -> tuple[jax.Array, jax.Array]:
    """The window after its ops. win: [B, W] tokens; values: [B, W] float carried with each
    token (its log-probability; 0 where a MASK appears); op: [B, W] OP_*; region: [B, W] the
    positions that may move (a contiguous run per block: its generated positions before the
    row's limit; ops lie inside it). Returns (tokens, values) [B, W]."""
    b, w = win.shape
    blk = w // n_slots
    shape = (b, n_slots, blk)
    win, values, op, region = (x.reshape(shape) for x in (win, values, op, region))
    j = jnp.arange(blk)
    lo = jnp.min(jnp.where(region, j, blk), axis=-1, keepdims=True)  # [B, N, 1]
    hi = lo + jnp.sum(region, axis=-1, keepdims=True)
    split = (op == OP_SPLIT).astype(jnp.int32)
    length = jnp.where(region, split + (op != OP_DELETE), 0)  # output positions each one takes
    start = lo + jnp.cumsum(length, axis=-1) - length
    target = jnp.where(region, start + split, j)  # where each token lands
    lands = ~region | ((op != OP_DELETE) & (target < hi))
    hit = lands[..., :, None] & (target[..., :, None] == j)  # [B, N, src, dst]
    src = jnp.argmax(hit, axis=-2)
    has = jnp.any(hit, axis=-2)
    tokens = jnp.where(has, jnp.take_along_axis(win, src, axis=-1), mask_token_id)
    moved = jnp.where(has, jnp.take_along_axis(values, src, axis=-1), 0.0)
    return tokens.reshape(b, w), moved.reshape(b, w)


def block_hash(win: jax.Array, n_slots: int) -> jax.Array:
    """[B, N] uint32 hash of each block's tokens (never 0: 0 marks an empty history entry)."""
    b, w = win.shape
    blk = w // n_slots
    mult = (jnp.arange(1, blk + 1, dtype=jnp.uint32) * jnp.uint32(_HASH_MULT)) | jnp.uint32(1)
    h = jnp.sum((win.reshape(b, n_slots, blk).astype(jnp.uint32) + 1) * mult, axis=-1,
                dtype=jnp.uint32)
    return h | jnp.uint32(1)


def track_repeats(history: jax.Array, ops_off: jax.Array, new_hash: jax.Array,
                  changed: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The anti-loop rule. history: [B, N, H] uint32 (0: empty); ops_off: [B, N] bool;
    new_hash: [B, N] the blocks after this step; changed / active: [B, N]. An active block this
    step changed remembers its new state, and turns its ops off if it held that state before."""
    step = changed & active
    repeat = step & jnp.any(history == new_hash[..., None], axis=-1)
    pushed = jnp.concatenate([new_hash[..., None], history[..., :-1]], axis=-1)
    return jnp.where(step[..., None], pushed, history), ops_off | repeat


def remember(state: DecodeState, new_win: jax.Array, changed: jax.Array, n_slots: int
             ) -> DecodeState:
    """The anti-loop rule on the decode state: new_win [B, W] the window after this step,
    changed [B, W] the positions it filled, rewrote or took an op at."""
    b, w = new_win.shape
    slot = jnp.arange(n_slots)[None, :]
    active = ((slot >= state.n_to_cache[:, None]) & (slot < state.n_valid[:, None])
              & ~state.done[:, None])
    history, ops_off = track_repeats(
        state.block_history, state.ops_off, block_hash(new_win, n_slots),
        jnp.any(changed.reshape(b, n_slots, w // n_slots), axis=-1), active)
    return state.replace(block_history=history, ops_off=ops_off)

