"""The jitted decoding programs: prefill, one decode step, and the while-loop of steps.

All three call the same model forward. The engine jits them with the KV pool (and the decode
state) donated, so the buffer is updated in place and never copied.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig
from mbd_jax.decoding import block_buffer, gate, indel, policy
from mbd_jax.decoding.block_buffer import DecodeState
from mbd_jax.model.forward_meta import ForwardMeta

Cache = Any  # the model's cache (model/cache.py's ModelCache): the loop never looks in
ApplyFn = Callable[..., tuple[jax.Array, Cache]]


def prefill(params: Any, kv: Cache, tokens: jax.Array, start: jax.Array, full_len: jax.Array,
            write: jax.Array, rows: jax.Array | None = None, *, apply_fn: ApplyFn) -> Cache:
    """Writes the cache entries of prompt positions [start, start + T) of the selected rows.

    tokens: [R, T]; rows: [R] the cache row each belongs to (None: all B cache rows, in order);
    start: [R] where each row's chunk begins (rows whose first blocks came from the prefix cache
    start later); full_len: [R] length of each row's full prompt blocks; write: [R] bool, rows to
    prefill. The others store nothing, so a running row's cache is untouched (this lets the engine
    admit a request while others decode). With a row table the forward computes only its R rows.
    """
    t = tokens.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    visible = jnp.where(write, jnp.minimum(full_len, start + t), 1).astype(jnp.int32)
    # the chunk's full prompt blocks are final: committed (its padding past them is not)
    meta = ForwardMeta.cached(positions, start.astype(jnp.int32), visible, write=write, rows=rows,
                              commit=jnp.maximum(visible - start, 0).astype(jnp.int32))
    _, kv = apply_fn({"params": params}, tokens, meta, kv)
    return kv


def decode_meta(state: DecodeState, w: int, blk: int,
                rows: jax.Array | None = None) -> ForwardMeta:
    """The forward over every row's W-token window: it sits right after the row's committed
    prefix and stores there unless the row is done. Done rows (finished, free) read one position:
    the attention loop runs to the longest visible row, so a finished long request would
    otherwise keep every other row's steps that long until its row is reused. The TO_CACHE
    blocks at the window's start are committed by this forward (block_buffer.advance moves
    cached_len past them after it). `rows`: the cache row of each state row (None: state row b
    is cache row b)."""
    positions = state.cached_len[:, None] + jnp.arange(w, dtype=jnp.int32)  # [B, W]
    visible = jnp.where(state.done, 1, jnp.maximum(state.cached_len + state.n_valid * blk, 1))
    return ForwardMeta.cached(positions, state.cached_len, visible, write=~state.done, rows=rows,
                              commit=jnp.where(state.done, 0, state.n_to_cache * blk))


def slots_in_use(state: DecodeState) -> jax.Array:
    """The most valid slots any live row has (at least 1). The buffer's later slots are DUMMY
    for every row, all MASK and past every row's visible length, so nothing reads them: a step
    may forward the first `slots_in_use` blocks alone. It is 1 on a request's first step, on its
    last block after an EOS and on every step of SingleBD."""
    return jnp.maximum(jnp.max(jnp.where(state.done, 1, state.n_valid)), 1)


def decode_step(params: Any, state: DecodeState, kv: Cache, rows: jax.Array | None = None, *,
                apply_fn: ApplyFn, cfg: ModelConfig, n_slots: int, debug: bool = False,
                compute_slots: int | None = None) -> tuple[DecodeState, Cache]:
    """One forward over every row's buffer (N * blk tokens), unmasking, and the bookkeeping.
    Finished and free rows store nothing in the cache, so a row whose next request is being
    prefilled between decode calls is never overwritten. With `debug`, the Block Buffer
    invariants are checked after the step (state.violations).

    `compute_slots` (static; only where `slots_in_use(state) <= compute_slots`): the forward
    computes the window's first `compute_slots` blocks alone and its logits are padded back to W
    with zeros; the DUMMY positions they stand for are not maskable, so no rule selects them. The
    result is the full window's (up to float rounding of the narrower matmuls)."""
    blk = cfg.block_size
    w = n_slots * blk
    p = state.params
    win = block_buffer.window(state, w)  # [B, W]
    meta = decode_meta(state, w, blk, rows)
    positions = meta.positions
    if compute_slots is not None and compute_slots < n_slots:
        c = compute_slots * blk
        logits, kv = apply_fn({"params": params}, win[:, :c],
                              meta.replace(positions=positions[:, :c]), kv)
        logits = jnp.pad(logits, ((0, 0), (0, w - c), (0, 0)))
    else:
        logits, kv = apply_fn({"params": params}, win, meta, kv)

    # a constrained row's gate position takes only what its grammar allows there
    logits = gate.mask_logits(logits, state.gate - state.cached_len, state.allowed)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(p.seed, state.nfe)
    token, confidence, greedy, op_conf = policy.predict(
        logits, cfg.mask_token_id, p.temperature, p.top_k, p.top_p, keys, cfg.edit_op_ids)
    slot = jnp.arange(w) // blk
    active = (slot[None] >= state.n_to_cache[:, None]) & (slot[None] < state.n_valid[:, None])
    active &= ~state.done[:, None]
    masked = win == cfg.mask_token_id
    in_limit = positions < p.limit[:, None]  # positions past max_new_tokens are never generated
    maskable = masked & active & in_limit

    # Filled share of each slot's predecessor (slot 0's predecessor is cached: complete).
    fill = jnp.mean(~masked.reshape(-1, n_slots, blk), axis=-1)
    prev_fill = jnp.concatenate([jnp.ones_like(fill[:, :1]), fill[:, :-1]], axis=1)
    filled_now = policy.select(confidence, maskable, prev_fill, p.policy, p.accept_threshold,
                               p.tokens_per_step, p.factor, p.semi_complete_threshold, n_slots)
    # Edit mode: a generated token in an ACTIVE block is rewritten when the model now prefers
    # another token with confidence above edit_threshold (not text a grammar has accepted);
    # indel mode may delete it or insert a MASK before it instead (decoding/indel.py).
    generated = positions >= state.prompt_len[:, None]
    editable = generated & ~(gate.constrained(state.gate)[:, None] & (positions < state.gate[:, None]))
    editable &= ~masked & active & p.edit[:, None]
    op = jnp.zeros_like(win)
    if cfg.edit_op_ids:  # static: a model with edit actions
        ops_on = ~state.ops_off & (state.slot_steps + 1 < p.max_block_steps[:, None])  # [B, N]
        candidate = editable & p.indel[:, None] & jnp.repeat(ops_on, blk, axis=1)
        op, forced = indel.plan(op_conf, confidence, candidate, maskable, p.edit_threshold, n_slots)
        filled_now |= forced
    edited = (editable & (op == indel.OP_NONE) & (token != win)
              & (confidence > p.edit_threshold[:, None]))
    new_win = jnp.where(filled_now | edited, token, win)
    written = jnp.where(filled_now | edited, jnp.log(jnp.maximum(confidence, 1e-30)),
                        block_buffer.window(state, w, of=state.logprob))
    if cfg.edit_op_ids:
        new_win, written = indel.apply(new_win, written, op, active & generated & in_limit,
                                       n_slots, cfg.mask_token_id)
        edited |= op != indel.OP_NONE
        state = indel.remember(state, new_win, filled_now | edited, n_slots)
    state = state.replace(logprob=block_buffer.put_window(state, written, state.logprob))
    if state.trajectory.shape[1] > 0:  # static: voting needs every step's full prediction
        state = block_buffer.record_prediction(
            state, jnp.where(new_win == cfg.mask_token_id, greedy, new_win))
    state = block_buffer.advance(state, new_win, filled_now, edited, greedy, block_size=blk,
                                 n_slots=n_slots, eos_ids=cfg.eos_token_ids,
                                 mask_token_id=cfg.mask_token_id)
    if debug:
        bad = block_buffer.check_invariants(state, block_size=blk, n_slots=n_slots,
                                            mask_token_id=cfg.mask_token_id,
                                            op_ids=cfg.edit_op_ids)
        state = state.replace(violations=state.violations + bad)
    return state, kv


def decode_loop(params: Any, state: DecodeState, kv: Cache, max_steps: jax.Array,
                rows: jax.Array | None = None, *, apply_fn: ApplyFn, cfg: ModelConfig,
                n_slots: int, debug: bool = False) -> tuple[DecodeState, Cache, jax.Array]:
    """Runs decode steps on device until `max_steps` forwards ran, some row finished (so the
    host can refill it, or return it) or a constrained row's gate was filled (its grammar, on
    the host, must consume it: block_buffer.needs_host). Returns the steps run. `rows`: the cache row of each
    state row (a state of a few of the cache's rows: only those compute).

    With a buffer of several blocks, each step forwards only the slots some live row uses
    (decode_step's `compute_slots` = `slots_in_use`): on a CPU a step costs about its FLOPs even
    at batch 1, and steps with DUMMY slots (every request's first, its last blocks after the EOS,
    a row whose next block has not opened yet) would spend them on MASK tokens nobody reads.
    Each width is its own inner while-loop, run in turn, not a `lax.switch`: XLA copies a cache
    that the branches of a conditional capture, every step, where a while-loop updates its carry
    in place. Voting's recording needs every position's prediction, so a recording loop keeps
    the full window."""

    def running(carry):
        st, _, steps, event = carry
        return (steps < max_steps) & ~jnp.all(st.done) & ~event

    def step(compute_slots):
        def body(carry):
            st, cache, steps, _ = carry
            new_st, cache = decode_step(params, st, cache, rows, apply_fn=apply_fn, cfg=cfg,
                                        n_slots=n_slots, debug=debug, compute_slots=compute_slots)
            event = jnp.any(new_st.done & ~st.done) | jnp.any(
                block_buffer.needs_host(new_st, cfg.mask_token_id))
            return new_st, cache, steps + 1, event
        return body

    carry = (state, kv, jnp.asarray(0, jnp.int32), jnp.asarray(False))
    if n_slots == 1 or state.trajectory.shape[1] > 0:
        state, kv, steps, _ = jax.lax.while_loop(running, step(None), carry)
        return state, kv, steps

    def each_width(carry):  # a pass runs at least one step: the loop of the width in use does
        for k in range(1, n_slots + 1):
            carry = jax.lax.while_loop(
                lambda c, k=k: running(c) & (slots_in_use(c[0]) == k), step(k), carry)
        return carry

    state, kv, steps, _ = jax.lax.while_loop(running, each_width, carry)
    return state, kv, steps
