"""What an engine accepts: a request's prompt and decoding settings against the model and the
engine's sizes. Each error names the field (`where`) and what is allowed; the KV pool's own
check is page_plan.PagePlan.check_fits."""

from __future__ import annotations

from collections.abc import Sequence

from mbd_jax.config import DecodeConfig, ModelConfig
from mbd_jax.errors import UserError


def check_prompt(cfg: ModelConfig, ids: Sequence[int], where: str = "prompt") -> None:
    if len(ids) == 0:
        raise UserError(f"{where}: empty prompt; give at least one token")
    if len(ids) >= cfg.max_seq_len:
        raise UserError(f"{where}: {len(ids)} tokens leaves no room to generate; the model's "
                        f"max_seq_len is {cfg.max_seq_len} (prompt must be < {cfg.max_seq_len})")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size or i == cfg.mask_token_id]
    if bad:
        raise UserError(f"{where}: token id {bad[0]} is not allowed; ids must be in "
                        f"[0, {cfg.vocab_size}) and not the mask id {cfg.mask_token_id}")


def check_decode(cfg: ModelConfig, d: DecodeConfig, buffer_size: int, can_vote: bool,
                 where: str = "decoding") -> None:
    """`can_vote`: the engine records trajectories and has a tokenizer."""
    if d.sampling_mode == "indel" and not cfg.edit_op_ids:
        raise UserError(f"{where}: sampling_mode 'indel' needs a model with delete and split "
                        f"token ids (Levenshtein editing, LLaDA2.2); {cfg.name} has none: use "
                        "'edit' or 'naive'")
    if d.buffer_size > buffer_size:
        raise UserError(f"{where}: buffer_size {d.buffer_size} exceeds this engine's {buffer_size}")
    if d.voting is not None and not can_vote:
        raise UserError(f"{where}: voting needs an engine that records trajectories and has a "
                        "tokenizer (record_steps, record_len, tokenizer)")
