"""Admission planning: which prefill calls a prompt chunk makes, and the rows' fresh settings.

Pure host-side functions: the engine (engine/core.py) runs the calls they plan. A prompt's full
blocks are prefilled in chunks of a compiled length (a bucket: block_size * 2^k, up to
prefill_chunk); its last partial block stays in the canvas and is decoded with the first new
block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from mbd_jax.config import DecodeConfig, ModelConfig
from mbd_jax.decoding import policy
from mbd_jax.decoding.block_buffer import DecodeState, RowParams

# A prefill chunk of at least this many tokens per row runs over its own cache row ([1, T]); the
# shorter ones of an admission share one call over every row ([B, T], the rows not being
# prefilled store nothing). Past a few dozen tokens a row reuses each weight enough on its own,
# and one long prompt no longer costs the whole batch's compute (docs/lab/performance-history.md).
ROW_PREFILL_MIN = 64


def prefill_buckets(block_size: int, prefill_chunk: int) -> list[int]:
    """Prefill token counts that get compiled: block_size * 2^k, up to prefill_chunk."""
    sizes, t = [], block_size
    while t < prefill_chunk:
        sizes.append(t)
        t *= 2
    return sizes + [prefill_chunk]


def admitted_later(first_pages: Sequence[bytes | None], indexed: Callable[[bytes], bool]
                   ) -> set[int]:
    """Which of prompts admitted together wait for a second admission: those whose first page
    (its key; None: none it could share) is not `indexed` in the KV pool but is the first page
    of an earlier one. Once that one is prefilled, they map its pages instead of prefilling the
    same positions (the pool indexes a prompt only when its prefill is done)."""
    return {i for i, key in enumerate(first_pages)
            if key is not None and not indexed(key) and key in first_pages[:i]}


def runs_alone(tokens: int, row_prefill_min: int) -> bool:
    """Whether a `tokens`-long chunk (a bucket) runs over its own row: one program per bucket."""
    return tokens >= row_prefill_min


def bucket(tokens: int, block_size: int, prefill_chunk: int) -> int:
    """The compiled prefill length for `tokens` positions (capped at prefill_chunk)."""
    return next(t for t in prefill_buckets(block_size, prefill_chunk)
                if t >= min(tokens, prefill_chunk))


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """One compiled prefill call: `tokens` positions of cache row `row` alone ([1, T]), or, with
    `row` None, of every cache row ([B, T]) where the `rows` mask stores."""

    tokens: int  # T, a prefill bucket
    row: int | None = None
    rows: np.ndarray | None = None  # [B] bool, the shared call's rows


@dataclasses.dataclass
class Admission:
    """Requests being admitted into rows: which rows, and their fresh decode state (how far each
    row's prefill got is in its record, rows.py)."""

    rows: np.ndarray  # [B] bool, the admitted rows
    fresh: DecodeState


def full_blocks(prompts: list[np.ndarray], rows: np.ndarray, block_size: int) -> np.ndarray:
    """[B] the positions of each selected row's full prompt blocks (0 for the others)."""
    return np.array([len(p) // block_size * block_size if rows[i] else 0
                     for i, p in enumerate(prompts)], np.int32)


def next_round(full_len: np.ndarray, start: np.ndarray, rows: np.ndarray,
               bucket_of: Callable[[int], int], row_prefill_min: int
               ) -> tuple[list[PrefillCall], np.ndarray]:
    """The prefill calls of an admission's next chunk and each row's start after them. A row
    with prompt blocks left takes its next chunk in the smallest bucket that covers what it has
    left (`bucket_of`, at most prefill_chunk): a call of its own from row_prefill_min tokens,
    else the shared call, as long as the most any sharing row has left."""
    left = np.where(rows, full_len - start, 0)
    size = np.array([bucket_of(int(n)) if n > 0 else 0 for n in left])
    own = np.array([runs_alone(int(t), row_prefill_min) for t in size]) & (size > 0)
    shared = (size > 0) & ~own
    calls = [PrefillCall(int(size[i]), row=int(i)) for i in np.nonzero(own)[0]]
    if shared.any():
        calls.insert(0, PrefillCall(int(size[shared].max()), rows=shared))
        size = np.where(shared, size[shared].max(), size)
    return calls, start + np.minimum(size, left).astype(np.int32)


def row_params(cfg: ModelConfig, prompts: list[np.ndarray], decodes: list[DecodeConfig]
               ) -> RowParams:
    """Each row's decoding settings as host arrays ([B] per field)."""
    col = lambda f, dt=np.float32: np.array([f(d) for d in decodes], dt)  # noqa: E731
    limits = [min(len(p) + d.max_new_tokens, cfg.max_seq_len) for p, d in zip(prompts, decodes)]
    return RowParams(
        limit=np.array(limits, np.int32),
        max_nfe=col(lambda d: d.max_nfe, np.int32),
        buffer_size=col(lambda d: d.buffer_size, np.int32),
        policy=col(lambda d: policy.POLICY_IDS[d.policy], np.int32),
        accept_threshold=col(lambda d: d.accept_threshold),
        add_block_threshold=col(lambda d: d.add_block_threshold),
        eager=col(lambda d: d.block_activation == "eager", bool),
        semi_complete_threshold=col(lambda d: d.semi_complete_threshold),
        token_stability_threshold=col(lambda d: d.token_stability_threshold),
        tokens_per_step=col(lambda d: d.tokens_per_step(cfg.block_size), np.int32),
        factor=col(lambda d: d.factor),
        edit=col(lambda d: d.edits, bool),
        indel=col(lambda d: d.sampling_mode == "indel", bool),
        edit_threshold=col(lambda d: d.edit_threshold),
        max_block_steps=col(lambda d: cfg.block_size + d.max_post_edit_steps, np.int32),
        confirm_on_context=col(lambda d: d.edit_confirm == "context", bool),
        temperature=col(lambda d: d.temperature),
        top_k=col(lambda d: d.top_k, np.int32),
        top_p=col(lambda d: d.top_p),
        seed=col(lambda d: d.seed, np.int32),
        ignore_eos=col(lambda d: d.ignore_eos, bool),
    )
