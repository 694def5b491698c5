"""What a canvas engine accepts (engine/canvas_engine.py), each error naming the field
(`where`) and what is allowed, and what a request holds: its canvases and the positions it
writes."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mbd_jax.config.diffusion_gemma import CanvasDecoding, DiffusionGemmaConfig
from mbd_jax.engine.pages import PagePool
from mbd_jax.errors import UserError


def canvases(cfg: DiffusionGemmaConfig, d: CanvasDecoding) -> int:
    """Canvases a request's token budget allows (whole canvases)."""
    return math.ceil(d.max_new_tokens / cfg.canvas_length)


def positions(cfg: DiffusionGemmaConfig, prompt: Sequence[int], d: CanvasDecoding) -> int:
    """Positions a row writes: its prompt and every canvas but the last (never committed)."""
    return len(prompt) + (canvases(cfg, d) - 1) * cfg.canvas_length


def check_prompt(cfg: DiffusionGemmaConfig, ids: Sequence[int], where: str = "prompt") -> None:
    if len(ids) == 0:
        raise UserError(f"{where}: empty prompt; give at least one token")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UserError(f"{where}: token id {bad[0]} is not allowed; ids must be in "
                        f"[0, {cfg.vocab_size})")


def check_decode(cfg: DiffusionGemmaConfig, d: CanvasDecoding, where: str = "decoding") -> None:
    if not isinstance(d, CanvasDecoding):
        raise UserError(f"{where}: this model ({cfg.name}) is a canvas model; its decoding "
                        "settings are CanvasDecoding's")
    d.validate(where)


def check_fits(cfg: DiffusionGemmaConfig, prompt: Sequence[int], d: CanvasDecoding,
               max_len: int, pool: PagePool, where: str = "decoding") -> None:
    """The request fits a row of `max_len` positions (its last canvas read after the rest)
    and the whole pool."""
    need = positions(cfg, prompt, d) + cfg.canvas_length
    if need > max_len:
        raise UserError(f"{where}: the prompt ({len(prompt)} tokens) and {canvases(cfg, d)} "
                        f"canvases of {cfg.canvas_length} need {need} positions; this engine "
                        f"holds {max_len} per row")
    if pool.pages_for(positions(cfg, prompt, d)) > pool.num_pages:
        raise UserError(f"{where}: the request needs more KV pages than the whole pool "
                        f"({pool.num_pages} of {pool.page} positions)")
