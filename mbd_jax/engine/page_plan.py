"""What a request asks of the KV pool: the pages it holds while it runs, the leading pages it
can map from earlier prompts instead of prefilling them, and what admitting it takes now.

Host-side and pure over the pool's accounting (pages.py). A request holds pages for every
position it can write from admission to release (its prompt and new tokens up to the model's
length, to the end of their block, plus one decode window), so nothing is allocated mid-decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from mbd_jax.config import DecodeConfig, ModelConfig
from mbd_jax.engine import admission
from mbd_jax.engine.pages import PagePool, page_keys
from mbd_jax.errors import UserError
from mbd_jax.model.cache import ModelCache


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """An engine's KV pool: how Engine and the deviceless compile size it."""

    prefill_chunk: int  # the longest prefill call (at most max_seq_len)
    capacity: int  # positions per row: a forward writes at most one decode window or one
    # prefill chunk, starting before max_seq_len (ModelCache.capacity_for)
    page: int  # positions per page
    pages: int  # pool pages over all rows


def pool_size(cfg: ModelConfig, batch_size: int, buffer_size: int, prefill_chunk: int,
              kv_pool_tokens: int | None) -> PoolSize:
    """`kv_pool_tokens`: the positions the pool holds over all rows, rounded up to whole pages
    (None: every row a full context at once)."""
    if prefill_chunk < cfg.block_size or prefill_chunk % cfg.block_size:
        raise UserError(f"prefill_chunk ({prefill_chunk}) must be a positive multiple of "
                        f"block_size ({cfg.block_size})")
    prefill_chunk = min(prefill_chunk, cfg.max_seq_len)
    capacity = ModelCache.capacity_for(cfg, max(prefill_chunk, buffer_size * cfg.block_size))
    page = ModelCache.page_size(cfg)
    pages = (batch_size * (capacity // page) if kv_pool_tokens is None
             else -(-kv_pool_tokens // page))
    if pages < 1:
        raise UserError(f"kv_pool_tokens must be >= 1, got {kv_pool_tokens}")
    return PoolSize(prefill_chunk, capacity, page, pages)


class PagePlan:
    def __init__(self, pool: PagePool, cfg: ModelConfig, buffer_size: int, share_prefixes: bool):
        """`share_prefixes`: prompts map the pool's indexed prefix pages (the engine decides
        whether the model allows it)."""
        self.pool, self.cfg, self.buffer_size = pool, cfg, buffer_size
        self.share_prefixes = share_prefixes

    def positions_held(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        """Positions a request holds pages for while it runs."""
        blk = self.cfg.block_size
        limit = min(len(prompt) + d.max_new_tokens, self.cfg.max_seq_len)
        return -(-limit // blk) * blk + self.buffer_size * blk

    def pages_needed(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        """Pool pages a request holds while it runs (shared prefix pages included)."""
        return self.pool.pages_for(self.positions_held(prompt, d))

    def check_fits(self, prompt: Sequence[int], d: DecodeConfig, where: str = "decoding") -> None:
        """A request that needs more pages than the whole pool can never run."""
        need, pool = self.pages_needed(prompt, d), self.pool
        if need > pool.num_pages:
            raise UserError(f"{where}: {d.max_new_tokens} new tokens after a {len(prompt)}-token "
                            f"prompt need {need} KV pages of {pool.page} positions; this engine's "
                            f"pool has {pool.num_pages} ({pool.num_pages * pool.page} positions): "
                            "ask for fewer tokens or send a shorter prompt")

    def prefix_pages(self, prompt: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """(the keys of the prompt's whole pages inside its full blocks, the leading ones found
        in the pool: a prefix hit)."""
        if not self.share_prefixes:
            return [], []
        blk = self.cfg.block_size
        keys = page_keys(prompt, self.pool.page, len(prompt) // blk * blk)
        return keys, self.pool.lookup(keys)

    def pages_to_admit(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        """Free pages admitting this request takes now (what a shared prefix saves is not
        counted): admit while this is <= pool.free."""
        return self.pool.cost(self.positions_held(prompt, d), self.prefix_pages(prompt)[1])

    def first_page(self, prompt: Sequence[int]) -> bytes | None:
        """The key of the prompt's first page if it lies inside the prompt's full blocks (a page
        that can be shared), else None."""
        page, blk = self.pool.page, self.cfg.block_size
        if len(prompt) // blk * blk < page:
            return None
        return page_keys(prompt[:page], page, page)[0]

    def admitted_later(self, prompts: Sequence[Sequence[int]],
                       indexed: Callable[[bytes], bool] | None = None) -> set[int]:
        """Which of prompts admitted together wait for the next admission (admission.py's rule;
        `indexed`: whether a page key is in the pool, default this pool's index)."""
        if not self.share_prefixes:
            return set()
        indexed = indexed or (lambda key: bool(self.pool.lookup([key])))
        return admission.admitted_later([self.first_page(p) for p in prompts], indexed)

    def waits_for(self, prompt: Sequence[int], admitted: Sequence[Sequence[int]]) -> bool:
        """Whether `prompt` waits for the next admission rather than joining `admitted` (the
        prompts picked for this one)."""
        return len(admitted) in self.admitted_later([*admitted, prompt])
