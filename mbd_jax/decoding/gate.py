"""The grammar gate of constrained rows, on device (grammar/row.py is the host's half).

A constrained row has a gate: its first generated position the grammar has not accepted yet,
with the token mask of the grammar's state there (`allowed`, one bit per token, packed in
uint32 words). Unconstrained rows have gate NO_POSITION and are untouched. Pure functions over
one decode window: B rows, W window positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mbd_jax.model.layers import NEG_INF

NO_POSITION = 2**30  # an unconstrained row's gate (also block_buffer.NO_POSITION)


def mask_words(vocab_size: int) -> int:
    """uint32 words of a token mask: one bit per token."""
    return (vocab_size + 31) // 32


def constrained(gate: jax.Array) -> jax.Array:
    """[B] bool: rows with a grammar."""
    return gate < NO_POSITION


def token_bits(allowed: jax.Array, vocab: int) -> jax.Array:
    """[B, words] uint32 -> [B, vocab] bool (tokens past 32 * words: not allowed)."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = ((allowed[:, :, None] >> shifts) & 1).reshape(allowed.shape[0], -1).astype(bool)
    if bits.shape[1] < vocab:
        bits = jnp.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return bits[:, :vocab]


def mask_logits(logits: jax.Array, offset: jax.Array, allowed: jax.Array) -> jax.Array:
    """Logits [B, W, V] with each row's position `offset` [B] (the gate's place in the window;
    outside [0, W): no gate in the window, nothing changes) limited to its allowed tokens. One
    [B, V] row is read and written back per row, so an unconstrained row's logits come back
    bit for bit."""
    b, w, v = logits.shape
    idx = jnp.clip(offset, 0, w - 1)
    row = jnp.take_along_axis(logits, idx[:, None, None], axis=1)[:, 0]  # [B, V]
    inside = (offset >= 0) & (offset < w)
    row = jnp.where(token_bits(allowed, v) | ~inside[:, None], row, NEG_INF)
    return logits.at[jnp.arange(b), idx].set(row)


def validated_end(gate: jax.Array, canvas: jax.Array, mask_token_id: int) -> jax.Array:
    """[B] the end of the text the grammar has accepted: the gate, or one past it once the loop
    filled it (only an allowed token can stand there); NO_POSITION for unconstrained rows."""
    at_gate = jnp.take_along_axis(canvas, jnp.minimum(gate, canvas.shape[1] - 1)[:, None],
                                  axis=1)[:, 0]
    return jnp.where(constrained(gate), gate + (at_gate != mask_token_id), NO_POSITION)
