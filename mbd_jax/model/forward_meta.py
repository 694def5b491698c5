"""ForwardMeta: everything one forward needs besides the tokens, in one struct for every layer.

Two kinds of forward read it:

- over a cache (prefill and decode): input row b is cache row `rows[b]` (the row table; None:
  cache row b, every row of the cache in order), its T new tokens sit at `positions`, their cache
  entries go to [write_offset, write_offset + T) for the rows `write` selects (the others leave
  the cache as it was: a free row, a finished one, a row not in this prefill), and attention reads
  that cache row's positions [0, visible_len) under the block-causal rule. A forward over a few of
  the cache's rows (one prompt's prefill) computes only those;
- without a cache (training, the full-sequence reference): the T tokens attend to each other
  under an explicit `mask`. The trainer's rows are [noisy ; clean] dual streams whose noisy
  blocks fall in noise `groups` (train/objective.py): attention reads that from the mask, a
  recurrent layer from `groups` (a noisy group starts from the clean state before it).

A layer kind takes what it needs from it. Attention reads all of it but `commit`; a recurrent
layer (model/gated_deltanet.py) keeps, per cache row, its state after the row's committed
positions: `commit` says how many of this forward's T tokens (whole blocks, from the first) are
clean and committed by it, so its state moves past them and past nothing else (a KV write can
be overwritten at the same position later; a state that absorbed a noisy token cannot).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


def group_starts(groups: jax.Array) -> jax.Array:
    """groups [B, nb] (consecutive, numbered in order) -> the first block of each block's noise
    group [B, nb] (a group's first block = the number of blocks in the groups before it)."""
    return jnp.sum(groups[:, None, :] < groups[:, :, None], axis=-1)


@flax.struct.dataclass
class ForwardMeta:
    positions: jax.Array  # [B, T] int32: each token's absolute position
    write_offset: jax.Array | None = None  # [B] int32: cache position of row b's first new token
    visible_len: jax.Array | None = None  # [B] int32: cache positions [0, visible_len) are read
    write: jax.Array | None = None  # [B] bool: rows whose new entries the cache stores; the
    # others' outputs are never read (attention may bound its work by the writing rows)
    rows: jax.Array | None = None  # [B] int32: the cache row of each input row (None: row b)
    mask: jax.Array | None = None  # [B, T, T] bool: explicit attention (no cache)
    commit: jax.Array | None = None  # [B] int32: leading tokens of the T (whole blocks) that
    # this forward commits (recurrent layers advance their state past them)
    groups: jax.Array | None = None  # [B, nb] int32: a dual stream's noise group of each block

    @classmethod
    def cached(cls, positions: jax.Array, write_offset: jax.Array, visible_len: jax.Array,
               write: jax.Array | None = None, rows: jax.Array | None = None,
               commit: jax.Array | None = None) -> ForwardMeta:
        """A forward over a cache (every row stores its entries unless `write` says otherwise;
        input row b is cache row b unless `rows` says which; every token is committed unless
        `commit` says how many)."""
        if write is None:
            write = jnp.ones(positions.shape[:1], bool)
        if commit is None:
            commit = jnp.full(positions.shape[:1], positions.shape[1], jnp.int32)
        return cls(positions=positions, write_offset=write_offset, visible_len=visible_len,
                   write=write, rows=rows, commit=commit)

    @classmethod
    def explicit(cls, positions: jax.Array, mask: jax.Array,
                 groups: jax.Array | None = None) -> ForwardMeta:
        """A forward without a cache: the tokens attend to each other under `mask`; with
        `groups`, they are the trainer's [noisy ; clean] dual stream in those noise groups."""
        return cls(positions=positions, mask=mask, groups=groups)

    @property
    def uses_cache(self) -> bool:
        return self.mask is None
