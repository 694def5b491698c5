"""The Block Buffer: per-row decode state and its bookkeeping, as pure functions on device arrays.

Each row's text lives on a canvas [S_cap] (prompt, generated tokens, MASK elsewhere) whose index is
the absolute position. The buffer is the window canvas[cached_len : cached_len + N*blk], N slots of
one block each. Slot states are derived from two counters, which keeps the invariants structural:

    slot i is TO_CACHE  if i < n_to_cache      (complete; its clean KV is written by the next forward)
              ACTIVE    if i < n_valid         (being unmasked)
              DUMMY     otherwise              (not started; all MASK)

so TO_CACHE slots always form a prefix and DUMMY slots a suffix. Committing n_to_cache blocks is
`cached_len += n_to_cache * blk`: the window moves, nothing is copied. N = 1 is SingleBD.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_MAX_NFE = 0, 1, 2, 3
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_MAX_NFE: "max_nfe"}
NO_POSITION = 2**30


@flax.struct.dataclass
class RowParams:
    """Per-row decoding parameters, [B] each (see config.DecodeConfig)."""

    limit: jax.Array  # prompt_len + max_new_tokens: positions >= limit are never generated
    max_nfe: jax.Array
    buffer_size: jax.Array  # <= the compiled N
    policy: jax.Array
    accept_threshold: jax.Array
    add_block_threshold: jax.Array
    semi_complete_threshold: jax.Array
    token_stability_threshold: jax.Array
    tokens_per_step: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    seed: jax.Array


@flax.struct.dataclass
class DecodeState:
    canvas: jax.Array  # [B, S_cap] int32
    prompt_len: jax.Array  # [B]
    cached_len: jax.Array  # [B] positions whose clean KV is in the buffer; multiple of blk
    n_valid: jax.Array  # [B] non-DUMMY slots
    n_to_cache: jax.Array  # [B] TO_CACHE slots (a prefix)
    done: jax.Array  # [B] bool
    finish: jax.Array  # [B] FINISH_*
    stop_pos: jax.Array  # [B] end of the output (exclusive) once done
    nfe: jax.Array  # [B] decode forwards while live
    n_unmasked: jax.Array  # [B] tokens unmasked by decode steps
    bubbles: jax.Array  # [B] forwards that unmasked nothing
    max_active: jax.Array  # [B] most ACTIVE slots seen at once
    params: RowParams


def window(state: DecodeState, width: int) -> jax.Array:
    """The buffer's tokens: canvas[b, cached_len[b] : cached_len[b] + width]. [B, width]."""
    return jax.vmap(lambda row, start: jax.lax.dynamic_slice(row, (start,), (width,)))(
        state.canvas, state.cached_len)


def advance(state: DecodeState, old_window: jax.Array, new_window: jax.Array,
            accepted: jax.Array, greedy: jax.Array, *, block_size: int, n_slots: int,
            eos_ids: tuple[int, ...], mask_token_id: int) -> DecodeState:
    """Bookkeeping after one forward + unmask: write the window back, stop rows, commit the blocks
    stored by this forward, mark newly TO_CACHE blocks, activate the next block.

    old_window/new_window/accepted/greedy: [B, W] before/after unmasking, which positions were
    filled this step, and the model's argmax (for stability).
    """
    b, w = new_window.shape
    blk, n = block_size, n_slots
    p = state.params
    live = ~state.done
    canvas = jax.vmap(lambda row, win, start: jax.lax.dynamic_update_slice(row, win, (start,)))(
        state.canvas, new_window, state.cached_len)

    pos = state.cached_len[:, None] + jnp.arange(w)  # [B, W] absolute positions
    generated = pos >= state.prompt_len[:, None]
    filled = new_window != mask_token_id

    # Stop: the output ends at the first EOS (inclusive) or at the limit; the row is done once
    # every position before that end is filled (later positions cannot change what came before).
    is_eos = jnp.isin(new_window, jnp.asarray(eos_ids)) & filled & generated
    first_eos = jnp.min(jnp.where(is_eos, pos, NO_POSITION), axis=1)
    stop_pos = jnp.minimum(first_eos + 1, p.limit)
    gap = ~filled & generated & (pos < stop_pos[:, None])
    complete_text = ~jnp.any(gap, axis=1) & (stop_pos <= state.cached_len + w)
    # Where the text stops if the nfe budget runs out first: the first masked generated position
    # (everything before cached_len is filled, so it lies in the window).
    first_gap = jnp.min(jnp.where(~filled & generated, pos, state.cached_len[:, None] + w), axis=1)
    nfe = state.nfe + live
    finish = jnp.where(complete_text, jnp.where(first_eos < p.limit, FINISH_STOP, FINISH_LENGTH),
                       FINISH_MAX_NFE)
    now_done = live & (complete_text | (nfe >= p.max_nfe))

    # Statistics (live rows only).
    n_acc = jnp.sum(accepted, axis=1)
    n_unmasked = state.n_unmasked + jnp.where(live, n_acc, 0)
    bubbles = state.bubbles + (live & (n_acc == 0))

    # Per-slot view of this step's result.
    filled_slots = filled.reshape(b, n, blk)
    fill = jnp.mean(filled_slots, axis=-1)  # [B, N]
    complete = jnp.all(filled_slots, axis=-1)
    kept = filled_slots & (greedy.reshape(b, n, blk) == new_window.reshape(b, n, blk))
    stability = jnp.sum(kept, -1) / jnp.maximum(jnp.sum(filled_slots, -1), 1)

    # Commit: the TO_CACHE prefix was stored by this forward.
    keep_going = live & ~now_done
    c = jnp.where(keep_going, state.n_to_cache, 0)
    cached_len = state.cached_len + c * blk
    n_valid = state.n_valid - c
    slot = jnp.arange(n)[None, :]
    shifted = jnp.take_along_axis(complete, jnp.minimum(slot + c[:, None], n - 1), axis=1)
    leading = jnp.cumprod(shifted & (slot < n_valid[:, None]), axis=1)
    n_to_cache = jnp.where(keep_going, jnp.sum(leading, axis=1), state.n_to_cache)

    # Activate the next block: the buffer is empty, or the last valid block is far enough along,
    # and no EOS has ended the text, and the new block starts before the limit.
    last = jnp.maximum(state.n_valid - 1, 0)[:, None]
    last_fill = jnp.take_along_axis(fill, last, axis=1)[:, 0]
    last_stable = jnp.take_along_axis(stability, last, axis=1)[:, 0]
    ready = (last_fill >= p.add_block_threshold) & (last_stable >= p.token_stability_threshold)
    room = n_valid < jnp.minimum(p.buffer_size, n)
    starts_in_time = cached_len + n_valid * blk < p.limit
    activate = keep_going & room & starts_in_time & (first_eos == NO_POSITION) & (
        (n_valid == 0) | ready)
    n_valid = n_valid + activate

    return state.replace(
        canvas=canvas,
        cached_len=cached_len,
        n_valid=n_valid,
        n_to_cache=n_to_cache,
        done=state.done | now_done,
        finish=jnp.where(now_done, finish, state.finish),
        stop_pos=jnp.where(now_done, jnp.where(complete_text, stop_pos, first_gap), state.stop_pos),
        nfe=nfe,
        n_unmasked=n_unmasked,
        bubbles=bubbles,
        max_active=jnp.maximum(state.max_active, jnp.where(live, n_valid - n_to_cache, 0)),
    )


def initial_state(prompts: list[np.ndarray], capacity: int, block_size: int, mask_token_id: int,
                  params: RowParams) -> DecodeState:
    """Rows start with their full prompt blocks cached (after prefill) and one ACTIVE block: the
    block holding the first generated position, with its prompt positions fixed."""
    b = len(prompts)
    canvas = np.full((b, capacity), mask_token_id, np.int32)
    prompt_len = np.array([len(t) for t in prompts], np.int32)
    for i, t in enumerate(prompts):
        canvas[i, : len(t)] = t
    zeros, ones = np.zeros(b, np.int32), np.ones(b, np.int32)
    put = jax.device_put  # (jnp.asarray would compile a small program per new shape)
    return DecodeState(
        canvas=put(canvas),
        prompt_len=put(prompt_len),
        cached_len=put(prompt_len // block_size * block_size),
        n_valid=put(ones),
        n_to_cache=put(zeros),
        done=put(np.zeros(b, bool)),
        finish=put(zeros),
        stop_pos=put(prompt_len),
        nfe=put(zeros),
        n_unmasked=put(zeros),
        bubbles=put(zeros),
        max_active=put(ones),
        params=params,
    )
