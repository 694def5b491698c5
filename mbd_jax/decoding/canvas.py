"""Uniform-noise canvas denoising (DiffusionGemma): the rules of one step, as pure functions.

A canvas of C positions starts as noise (no mask token) and each decoder pass refines all of
it:

    processed = logits / T,  T = t_min + (t_max - t_min) * remaining / N   (remaining = N..1)
    sample    = a draw from softmax(processed) at every position (deterministic: its argmax)
    accept    = the lowest-entropy positions whose summed entropy, less the largest of them,
                stays <= entropy_bound (the lowest always)
    next      = accept ? sample : fresh noise            (nothing is sticky)
    stop      = the argmax canvas held still for `stability` steps and the mean entropy is
                below `confidence`; else after N steps

and the argmax canvas is what commits. Noise is uniform over the vocabulary (seeded per row and
canvas), or, under the deterministic contract (`noise: deterministic`, for parity across
frameworks), noise(c, k, i) = (7 i + 13 k + 31 c + 3) mod V: c the canvas's index in the
generation, k = 0 for the initial canvas and k = n for the re-draw after the n-th step (1-based),
i the position.

Shapes: B rows, C canvas positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def temperature(remaining: jax.Array, steps: jax.Array, t_min: jax.Array, t_max: jax.Array
                ) -> jax.Array:
    """[B] the schedule's temperature with `remaining` steps left (N at the first step)."""
    return t_min + (t_max - t_min) * (remaining.astype(jnp.float32) / steps.astype(jnp.float32))


def entropy(processed: jax.Array) -> jax.Array:
    """[B, C] entropy of softmax(processed) [B, C, V], as -sum p * log p."""
    log_p = jax.nn.log_softmax(processed, axis=-1)
    return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def accept(ent: jax.Array, bound: jax.Array) -> jax.Array:
    """[B, C] bool: ascending entropy order, a position is accepted while the entropies up to it
    sum, less its own (the running maximum), to at most bound [B]."""
    order = jnp.argsort(ent, axis=-1, stable=True)
    sorted_ent = jnp.take_along_axis(ent, order, axis=-1)
    keep = jnp.cumsum(sorted_ent, axis=-1) - sorted_ent <= bound[:, None]
    return jnp.zeros_like(keep).at[jnp.arange(ent.shape[0])[:, None], order].set(keep)


def contract_noise(canvas_index: jax.Array, k: jax.Array, length: int, vocab: int) -> jax.Array:
    """[B, C] the deterministic contract's draw: (7 i + 13 k + 31 c + 3) mod V."""
    i = jnp.arange(length, dtype=jnp.int32)[None]
    return (7 * i + 13 * k[:, None] + 31 * canvas_index[:, None] + 3) % vocab


def uniform_noise(keys: jax.Array, length: int, vocab: int) -> jax.Array:
    """[B, C] uniform ids from one PRNG key per row."""
    return jax.vmap(lambda key: jax.random.randint(key, (length,), 0, vocab, jnp.int32))(keys)


def noise(deterministic: jax.Array, keys: jax.Array, canvas_index: jax.Array, k: jax.Array,
          length: int, vocab: int) -> jax.Array:
    """[B, C] per row: the contract's draw where `deterministic` [B], else uniform from keys."""
    return jnp.where(deterministic[:, None], contract_noise(canvas_index, k, length, vocab),
                     uniform_noise(keys, length, vocab))


def draw(processed: jax.Array, deterministic: jax.Array, keys: jax.Array) -> jax.Array:
    """[B, C] a sample of softmax(processed) per position (the argmax where deterministic)."""
    greedy = jnp.argmax(processed, axis=-1).astype(jnp.int32)

    def sample():
        drawn = jax.vmap(lambda key, lg: jax.random.categorical(key, lg, axis=-1))(keys, processed)
        return jnp.where(deterministic[:, None], greedy, drawn.astype(jnp.int32))

    return jax.lax.cond(jnp.all(deterministic), lambda: greedy, sample)
