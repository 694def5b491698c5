"""The Block Buffer: per-row decode state and its bookkeeping, as pure functions on device arrays.

Each row's text lives on a canvas [S_cap] (prompt, generated tokens, MASK elsewhere) whose index is
the absolute position. The buffer is the window canvas[cached_len : cached_len + N*blk], N slots of
one block each. Slot states are derived from two counters, which keeps the invariants structural:

    slot i is TO_CACHE  if i < n_to_cache      (final; its clean KV is written by the next forward)
              ACTIVE    if i < n_valid         (being unmasked, or edited)
              DUMMY     otherwise              (not started; all MASK)

so TO_CACHE slots always form a prefix and DUMMY slots a suffix. Committing n_to_cache blocks is
`cached_len += n_to_cache * blk`: the window moves, nothing is copied. N = 1 is SingleBD.

The next block becomes ACTIVE once the last valid one is tau_add full, one per forward (the
paper's rule); with eager activation every slot whose block starts before the row's limit is
ACTIVE at once, from the first forward and again after each commit.

A block is *final* when it has no MASK left and, in edit mode, the last forward changed nothing
in it (or it has been active for block_size + max_post_edit_steps steps). With edit_confirm
"context" a block is also final when the last forward only unmasked tokens in it and saw every
block before it complete and unedited: only a block written while an earlier one still had a MASK
(the MultiBD case: a later block guessing ahead) waits for a forward that confirms it. A final
block whose predecessors are final becomes TO_CACHE.
"""

from __future__ import annotations

import flax.struct
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.decoding import gate as grammar_gate
from mbd_jax.decoding.gate import NO_POSITION

FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_MAX_NFE = 0, 1, 2, 3  # state.finish values
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_MAX_NFE: "max_nfe"}


@flax.struct.dataclass
class RowParams:
    """Per-row decoding parameters, [B] each (see config.DecodeConfig)."""

    limit: jax.Array  # prompt_len + max_new_tokens: positions >= limit are never generated
    max_nfe: jax.Array
    buffer_size: jax.Array  # <= the compiled N
    policy: jax.Array  # policy.POLICY_*
    accept_threshold: jax.Array
    add_block_threshold: jax.Array
    eager: jax.Array  # bool: block_activation == "eager"
    semi_complete_threshold: jax.Array
    token_stability_threshold: jax.Array
    tokens_per_step: jax.Array
    factor: jax.Array
    edit: jax.Array  # bool: sampling_mode "edit" or "indel"
    indel: jax.Array  # bool: sampling_mode "indel" (decoding/indel.py)
    edit_threshold: jax.Array
    max_block_steps: jax.Array  # edit: block_size + max_post_edit_steps
    confirm_on_context: jax.Array  # bool: edit_confirm == "context"
    temperature: jax.Array
    top_k: jax.Array  # 0: no limit
    top_p: jax.Array
    seed: jax.Array
    ignore_eos: jax.Array  # bool: an EOS does not end the row (it runs to its limit)


@flax.struct.dataclass
class DecodeState:
    canvas: jax.Array  # [B, S_cap] int32
    logprob: jax.Array  # [B, S_cap] float32: log-probability of each generated token when it was
    #                     last written (its confidence then; 0 elsewhere)
    prompt_len: jax.Array  # [B]
    cached_len: jax.Array  # [B] positions whose clean KV is in the buffer; multiple of blk
    n_valid: jax.Array  # [B] non-DUMMY slots
    n_to_cache: jax.Array  # [B] TO_CACHE slots (a prefix)
    slot_steps: jax.Array  # [B, N] forwards each slot has been ACTIVE for
    done: jax.Array  # [B] bool
    finish: jax.Array  # [B] FINISH_*
    stop_pos: jax.Array  # [B] end of the output (exclusive) once done
    # [B] decode forwards while live. A row is done as soon as its text is complete, so the
    # storing forward of its last block is never run (SDAR-style loops run and count it); TPF
    # (GenerationResult.tpf) = output tokens incl. EOS / nfe.
    nfe: jax.Array
    n_unmasked: jax.Array  # [B] tokens unmasked by decode steps
    n_edits: jax.Array  # [B] filled tokens rewritten (edit mode)
    bubbles: jax.Array  # [B] forwards that unmasked nothing
    max_active: jax.Array  # [B] most ACTIVE slots seen at once
    violations: jax.Array  # [B] steps that broke an invariant (counted in debug mode only)
    trajectory: jax.Array  # [B, R, L] full prediction of the first L generated positions at each
    #                        step (ring buffer of R steps; R = L = 0 when not recorded)
    # Constrained rows (decoding/gate.py, set by the host between calls: grammar/row.py): the
    # first generated position the grammar has not accepted (NO_POSITION: no grammar), and the
    # token mask there. A row commits blocks and ends only before its validated end.
    gate: jax.Array  # [B] int32
    allowed: jax.Array  # [B, words] uint32
    # Levenshtein editing's anti-loop rule (decoding/indel.py; H = 0 for a model without edit
    # ops): each slot's last H block states (hashes, 0: none) and whether its ops are off.
    block_history: jax.Array  # [B, N, H] uint32
    ops_off: jax.Array  # [B, N] bool
    params: RowParams


def window(state: DecodeState, width: int, of: jax.Array | None = None) -> jax.Array:
    """The buffer's tokens: canvas[b, cached_len[b] : cached_len[b] + width] (or the same window
    of `of`, another [B, S_cap] array). [B, width]."""
    return jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (width,)))(
        state.canvas if of is None else of, state.cached_len)


def put_window(state: DecodeState, values: jax.Array, into: jax.Array) -> jax.Array:
    """`into` [B, S_cap] with each row's buffer window replaced by values [B, W]."""
    return jax.vmap(lambda row, win, start: jax.lax.dynamic_update_slice(row, win, (start,)))(
        into, values, state.cached_len)


def _shift_slots(x: jax.Array, c: jax.Array, fill) -> jax.Array:
    """Slot j takes slot j + c[b]'s value (the buffer shift on commit); `fill` past the end.
    x: [B, N, ...]."""
    n = x.shape[1]
    src = (jnp.arange(n)[None, :] + c[:, None]).reshape(c.shape[0], n, *([1] * (x.ndim - 2)))
    taken = jnp.take_along_axis(x, jnp.minimum(src, n - 1), axis=1)
    return jnp.where(src < n, taken, jnp.asarray(fill, x.dtype))


def advance(state: DecodeState, new_window: jax.Array, filled_now: jax.Array, edited: jax.Array,
            greedy: jax.Array, *, block_size: int, n_slots: int, eos_ids: tuple[int, ...],
            mask_token_id: int) -> DecodeState:
    """Bookkeeping after one forward + unmask: write the window back, stop rows, commit the blocks
    stored by this forward, mark newly TO_CACHE blocks, activate the next block.

    new_window: [B, W] after this step; filled_now / edited: [B, W] positions unmasked / rewritten
    this step; greedy: [B, W] the model's argmax (for the stability rule).
    """
    b, w = new_window.shape
    blk, n = block_size, n_slots
    p = state.params
    live = ~state.done
    canvas = put_window(state, new_window, state.canvas)

    pos = state.cached_len[:, None] + jnp.arange(w)  # [B, W] absolute positions
    generated = pos >= state.prompt_len[:, None]
    filled = new_window != mask_token_id
    slot = jnp.arange(n)[None, :]
    active = (slot >= state.n_to_cache[:, None]) & (slot < state.n_valid[:, None])  # [B, N]

    # Per-slot view of this step's result.
    filled_slots = filled.reshape(b, n, blk)
    fill = jnp.mean(filled_slots, axis=-1)  # [B, N]
    edited_slots = jnp.any(edited.reshape(b, n, blk), axis=-1)  # [B, N]
    changed = jnp.any(filled_now.reshape(b, n, blk), axis=-1) | edited_slots
    # Every block before slot i had no MASK when this forward ran (what it unmasked is all that
    # was masked before it) and was not edited by it.
    was_filled = (filled & ~filled_now).reshape(b, n, blk)
    clean = jnp.all(was_filled, axis=-1) & ~edited_slots
    clean_before = jnp.cumprod(jnp.concatenate([jnp.ones((b, 1), bool), clean[:, :-1]], axis=1),
                               axis=1).astype(bool)
    confirmed_by_context = p.confirm_on_context[:, None] & clean_before & ~edited_slots
    slot_steps = state.slot_steps + (active & live[:, None])
    settled = (~p.edit[:, None] | ~changed | confirmed_by_context
               | (slot_steps >= p.max_block_steps[:, None]))
    # a constrained row's blocks commit only inside the text its grammar accepted
    vend = grammar_gate.validated_end(state.gate, canvas, mask_token_id)
    inside = state.cached_len[:, None] + (slot + 1) * blk <= vend[:, None]
    final = jnp.all(filled_slots, axis=-1) & settled & inside  # [B, N]
    kept = filled_slots & (greedy.reshape(b, n, blk) == new_window.reshape(b, n, blk))
    stability = jnp.sum(kept, -1) / jnp.maximum(jnp.sum(filled_slots, -1), 1)

    # Stop: the output ends at the first EOS (inclusive) or at the limit; the row is done once every
    # position before that end is filled (later positions cannot change what came before) and, in
    # edit mode, the blocks holding it have settled.
    first_eos, stop_pos, gap = text_end(new_window, pos, generated, p, eos_ids, mask_token_id)
    stop_slot = (stop_pos - 1 - state.cached_len) // blk
    unsettled = jnp.any(~settled & (slot <= stop_slot[:, None]), axis=1)
    complete_text = (~jnp.any(gap, axis=1) & (stop_pos <= state.cached_len + w) & ~unsettled
                     & (stop_pos <= vend))
    # Where the text stops if the nfe budget runs out first: the first masked generated position
    # (everything before cached_len is filled, so it lies in the window), or a constrained
    # row's validated end.
    first_gap = jnp.min(jnp.where(~filled & generated, pos, state.cached_len[:, None] + w), axis=1)
    first_gap = jnp.minimum(first_gap, vend)
    nfe = state.nfe + live
    finish = jnp.where(complete_text, jnp.where(first_eos < p.limit, FINISH_STOP, FINISH_LENGTH),
                       FINISH_MAX_NFE)
    now_done = live & (complete_text | (nfe >= p.max_nfe))

    # Statistics (live rows only).
    n_filled = jnp.sum(filled_now, axis=1)
    n_edits = state.n_edits + jnp.where(live, jnp.sum(edited, axis=1), 0)
    n_unmasked = state.n_unmasked + jnp.where(live, n_filled, 0)
    bubbles = state.bubbles + (live & (n_filled == 0))

    # Commit: the TO_CACHE prefix was stored by this forward.
    keep_going = live & ~now_done
    c = jnp.where(keep_going, state.n_to_cache, 0)
    cached_len = state.cached_len + c * blk
    n_valid = state.n_valid - c
    slot_steps = _shift_slots(slot_steps, c, 0)
    leading = jnp.cumprod(_shift_slots(final, c, False) & (slot < n_valid[:, None]), axis=1)
    n_to_cache = jnp.where(keep_going, jnp.sum(leading, axis=1), state.n_to_cache)

    # Activate the next block: the buffer is empty, or the last valid block is far enough along
    # (eager activation: always), and no EOS has ended the text, and the new block starts before
    # the limit. Eager activation opens every such free slot at once.
    last = jnp.maximum(state.n_valid - 1, 0)[:, None]
    last_fill = jnp.take_along_axis(fill, last, axis=1)[:, 0]
    last_stable = jnp.take_along_axis(stability, last, axis=1)[:, 0]
    ready = p.eager | ((last_fill >= p.add_block_threshold)
                       & (last_stable >= p.token_stability_threshold))
    room = n_valid < jnp.minimum(p.buffer_size, n)
    starts_in_time = cached_len + n_valid * blk < p.limit
    activate = keep_going & room & starts_in_time & (first_eos == NO_POSITION) & (
        (n_valid == 0) | ready)
    n_valid = jnp.where(activate & p.eager, open_slots(p, cached_len, n, blk, jnp),
                        n_valid + activate)

    return state.replace(
        canvas=canvas,
        cached_len=cached_len,
        n_valid=n_valid,
        n_to_cache=n_to_cache,
        slot_steps=slot_steps,
        block_history=_shift_slots(state.block_history, c, 0),
        ops_off=_shift_slots(state.ops_off, c, False),
        done=state.done | now_done,
        finish=jnp.where(now_done, finish, state.finish),
        stop_pos=jnp.where(now_done, jnp.where(complete_text, stop_pos, first_gap), state.stop_pos),
        nfe=nfe,
        n_unmasked=n_unmasked,
        n_edits=n_edits,
        bubbles=bubbles,
        max_active=jnp.maximum(state.max_active, jnp.where(live, n_valid - n_to_cache, 0)),
    )


def text_end(win: jax.Array, pos: jax.Array, generated: jax.Array, p: RowParams,
             eos_ids: tuple[int, ...], mask_token_id: int
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each row's text ends in window `win` [B, W] (absolute positions `pos`, `generated`
    past the prompt): (the first EOS's position [B] (NO_POSITION: none), the end of the output
    [B] (past that EOS, or the limit), the masked generated positions before that end [B, W])."""
    filled = win != mask_token_id
    is_eos = jnp.isin(win, jnp.asarray(eos_ids)) & filled & generated & ~p.ignore_eos[:, None]
    first_eos = jnp.min(jnp.where(is_eos, pos, NO_POSITION), axis=1)
    stop_pos = jnp.minimum(first_eos + 1, p.limit)
    return first_eos, stop_pos, ~filled & generated & (pos < stop_pos[:, None])


def open_slots(p: RowParams, cached_len, n_slots: int, blk: int, xp=np):
    """[B] the slots a row holds under eager activation: every one whose block starts before the
    row's limit (`xp`: numpy on the host, jax.numpy in the loop)."""
    starting_in_time = (p.limit - cached_len + blk - 1) // blk
    return xp.minimum(xp.minimum(p.buffer_size, n_slots), starting_in_time).astype(np.int32)


def check_invariants(state: DecodeState, *, block_size: int, n_slots: int,
                     mask_token_id: int, op_ids: tuple[int, ...] = ()) -> jax.Array:
    """Debug mode: True per row where an invariant is broken. O(S_cap) per step.

    - cached_len is a multiple of the block size and the window fits the canvas;
    - 0 <= n_to_cache <= n_valid <= min(buffer_size, N) (TO_CACHE is a prefix of the valid slots);
    - no MASK was ever committed: canvas[prompt_len : cached_len] and the TO_CACHE slots are filled;
    - no edit action id (decoding/indel.py) is on the canvas past the prompt.
    """
    blk, n = block_size, n_slots
    s_cap = state.canvas.shape[1]
    pos = jnp.arange(s_cap)[None, :]
    masked = state.canvas == mask_token_id
    committed = (pos >= state.prompt_len[:, None]) & (pos < state.cached_len[:, None])
    to_cache = (pos >= state.cached_len[:, None]) & (
        pos < (state.cached_len + state.n_to_cache * blk)[:, None])
    bad = (state.cached_len % blk != 0) | (state.cached_len + n * blk > s_cap)
    bad |= (state.n_to_cache < 0) | (state.n_to_cache > state.n_valid)
    bad |= state.n_valid > jnp.minimum(state.params.buffer_size, n)
    bad |= jnp.any(masked & (committed | to_cache), axis=1)
    if op_ids:
        bad |= jnp.any(jnp.isin(state.canvas, jnp.asarray(op_ids))
                       & (pos >= state.prompt_len[:, None]), axis=1)
    # a constrained row's accepted text has no hole, and nothing past it is committed
    accepted = (pos >= state.prompt_len[:, None]) & (pos < state.gate[:, None])
    bad |= grammar_gate.constrained(state.gate) & (
        jnp.any(masked & accepted, axis=1)
        | (state.cached_len + state.n_to_cache * blk > grammar_gate.validated_end(
            state.gate, state.canvas, mask_token_id)))
    return bad


def with_gates(state: DecodeState, gate: jax.Array, allowed: jax.Array, clear: jax.Array,
               rows: jax.Array, *, block_size: int, n_slots: int, eos_ids: tuple[int, ...],
               mask_token_id: int) -> DecodeState:
    """The host's grammar step (grammar/row.py) written back: rows `rows` [B] bool take gate [B]
    and allowed [B, words], and where `clear` [B] the token at their new gate (one the grammar
    rejects) becomes MASK again. What `advance` would have decided had the text been accepted
    when it filled is decided now, so no forward is spent on it: blocks the check accepted whole
    become TO_CACHE (the next forward commits them), and a row whose accepted text is complete
    (through its EOS, or to its limit) is done (edit mode: both wait for `advance`'s settling
    rule)."""
    b, blk = state.canvas.shape[0], block_size
    new_gate = jnp.where(rows, gate, state.gate)
    at = jnp.minimum(new_gate, state.canvas.shape[1] - 1)
    current = state.canvas[jnp.arange(b), at]
    canvas = state.canvas.at[jnp.arange(b), at].set(
        jnp.where(rows & clear, mask_token_id, current))
    state = state.replace(canvas=canvas, gate=new_gate,
                          allowed=jnp.where(rows[:, None], allowed, state.allowed))
    vend = grammar_gate.validated_end(new_gate, canvas, mask_token_id)
    slot = jnp.arange(n_slots)[None, :]
    win = window(state, n_slots * blk)
    filled = jnp.all((win != mask_token_id).reshape(b, n_slots, blk), axis=-1)  # [B, N]
    ready = (filled & (state.cached_len[:, None] + (slot + 1) * blk <= vend[:, None])
             & (slot < state.n_valid[:, None]) & ~state.params.edit[:, None])
    accepted = jnp.sum(jnp.cumprod(ready, axis=1), axis=1)
    live = rows & ~state.done & ~state.params.edit
    n_to_cache = jnp.where(live, jnp.maximum(state.n_to_cache, accepted), state.n_to_cache)
    pos = state.cached_len[:, None] + jnp.arange(n_slots * blk)
    first_eos, stop_pos, gap = text_end(win, pos, pos >= state.prompt_len[:, None],
                                        state.params, eos_ids, mask_token_id)
    complete = (live & ~jnp.any(gap, axis=1) & (stop_pos <= state.cached_len + n_slots * blk)
                & (stop_pos <= vend))
    finish = jnp.where(first_eos < state.params.limit, FINISH_STOP, FINISH_LENGTH)
    return state.replace(n_to_cache=n_to_cache.astype(state.n_to_cache.dtype),
                         done=state.done | complete,
                         finish=jnp.where(complete, finish, state.finish),
                         stop_pos=jnp.where(complete, stop_pos, state.stop_pos))


def needs_host(state: DecodeState, mask_token_id: int) -> jax.Array:
    """[B] bool: live constrained rows whose gate the loop filled: the grammar must consume it
    (on the host) before they can go further."""
    vend = grammar_gate.validated_end(state.gate, state.canvas, mask_token_id)
    return ~state.done & grammar_gate.constrained(state.gate) & (vend > state.gate)


def record_prediction(state: DecodeState, window_prediction: jax.Array) -> DecodeState:
    """Stores this step's full prediction (committed tokens, and window_prediction [B, W] over the
    buffer) of the first L generated positions at trajectory[b, nfe % R]. O(L) per step."""
    _, r, length = state.trajectory.shape
    w = window_prediction.shape[1]
    pos = state.prompt_len[:, None] + jnp.arange(length)  # [B, L]
    committed = jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (length,)))(
        state.canvas, state.prompt_len)
    offset = pos - state.cached_len[:, None]
    in_window = (offset >= 0) & (offset < w)
    from_window = jnp.take_along_axis(window_prediction, jnp.clip(offset, 0, w - 1), axis=1)
    prediction = jnp.where(in_window, from_window, committed)
    slot = state.nfe % r
    updated = jax.vmap(lambda traj, pred, i: jax.lax.dynamic_update_slice(traj, pred[None], (i, 0)))(
        state.trajectory, prediction, slot)
    return state.replace(trajectory=jnp.where(state.done[:, None, None], state.trajectory, updated))


def initial_state(prompts: list[np.ndarray], capacity: int, block_size: int, n_slots: int,
                  mask_token_id: int, params: RowParams, record: tuple[int, int] = (0, 0),
                  put: Callable[[np.ndarray], jax.Array] = jax.device_put,
                  gate: np.ndarray | None = None, allowed: np.ndarray | None = None,
                  history: int = 0) -> DecodeState:
    """Rows start with their full prompt blocks cached (after prefill) and one ACTIVE block: the
    block holding the first generated position, with its prompt positions fixed (eager
    activation: every slot whose block starts before the row's limit). `put` moves a
    host array to the device(s) (the engine's: replicated over its mesh). `gate` [B] and
    `allowed` [B, words]: the constrained rows' gates and masks (default: no row has one).
    `history`: block states each slot remembers (indel.HISTORY for a model with edit ops)."""
    b = len(prompts)
    # The canvas is record[1] wider than the KV capacity so the recorded region of any row fits.
    canvas = np.full((b, capacity + record[1]), mask_token_id, np.int32)
    prompt_len = np.array([len(t) for t in prompts], np.int32)
    for i, t in enumerate(prompts):
        canvas[i, : len(t)] = t
    zeros, ones = np.zeros(b, np.int32), np.ones(b, np.int32)
    cached_len = prompt_len // block_size * block_size
    n_valid = np.where(params.eager, open_slots(params, cached_len, n_slots, block_size),
                       ones).astype(np.int32)
    return DecodeState(
        canvas=put(canvas),
        logprob=put(np.zeros(canvas.shape, np.float32)),
        prompt_len=put(prompt_len),
        cached_len=put(cached_len),
        n_valid=put(n_valid),
        n_to_cache=put(zeros),
        slot_steps=put(np.zeros((b, n_slots), np.int32)),
        done=put(np.zeros(b, bool)),
        finish=put(zeros),
        stop_pos=put(prompt_len),
        nfe=put(zeros),
        n_unmasked=put(zeros),
        n_edits=put(zeros),
        bubbles=put(zeros),
        max_active=put(n_valid),
        violations=put(zeros),
        trajectory=put(np.full((b, *record), mask_token_id, np.int32)),
        gate=put(np.full(b, NO_POSITION, np.int32) if gate is None else gate.astype(np.int32)),
        allowed=put(np.zeros((b, 1), np.uint32) if allowed is None else allowed.astype(np.uint32)),
        block_history=put(np.zeros((b, n_slots, history), np.uint32)),
        ops_off=put(np.zeros((b, n_slots), bool)),
        params=params,
    )
