"""Results: a finished row's host arrays turned into a GenerationResult (token ids, text, the
counters, voting). Pure host-side functions of the fetched decode state."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mbd_jax.config import DecodeConfig, ModelConfig, VotingConfig
from mbd_jax.decoding import block_buffer, voting
from mbd_jax.decoding.block_buffer import FINISH_NAMES, DecodeState
from mbd_jax.tokenizer import Tokenizer


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens, without the terminating EOS
    finish_reason: str  # stop | length | max_nfe
    nfe: int  # decode forwards (decoding/block_buffer.py says what counts as one)
    tokens_unmasked: int  # unmasked by decode steps, including any past the EOS (not output)
    bubble_forwards: int  # forwards that unmasked no token (the storing bubble)
    edits: int  # filled tokens rewritten (edit mode)
    blocks: int  # blocks decoded (started)
    max_active_blocks: int
    prompt_tokens: int
    seconds: float
    text: str | None = None
    voted_answer: str | None = None  # voting: the weighted majority over the steps' answers
    final_answer: str | None = None  # voting: the answer parsed from the final text
    vote_scores: dict[str, float] | None = None
    logprobs: list[float] | None = None  # per token: its log-probability when it was written
    eos: bool = False  # the output ended with an EOS token (not in token_ids)

    @property
    def output_tokens(self) -> int:
        """Tokens the model output: token_ids and the terminating EOS, if any."""
        return len(self.token_ids) + self.eos

    @property
    def tpf(self) -> float:
        """Tokens per forward as the MBD-LMs paper counts it: output tokens (up to and including
        EOS) / decode forwards."""
        return self.output_tokens / max(self.nfe, 1)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tokens"] = len(self.token_ids)
        d["output_tokens"] = self.output_tokens
        d["tpf"] = round(self.tpf, 4)
        return d


def output_ids(cfg: ModelConfig, host: DecodeState, row: int, end: int | None = None) -> list[int]:
    """Row's generated tokens from host arrays, up to `end` (default: its stop position),
    without a terminating EOS."""
    p0 = int(host.prompt_len[row])
    stop = int(host.stop_pos[row]) if end is None else end
    ids = host.canvas[row, p0:stop].tolist()
    if ids and ids[-1] in cfg.eos_token_ids and int(host.finish[row]) == block_buffer.FINISH_STOP:
        ids = ids[:-1]
    return ids


def result_of(cfg: ModelConfig, tokenizer: Tokenizer | None, host: DecodeState, i: int,
              seconds: float, decode: DecodeConfig | None = None) -> GenerationResult:
    """The result of finished row i, from host arrays (jax.device_get of the state)."""
    p0, stop = int(host.prompt_len[i]), int(host.stop_pos[i])
    ids = output_ids(cfg, host, i)
    eos = len(ids) < stop - p0  # output_ids dropped the terminating EOS
    blocks = math.ceil(max(stop, p0 + 1) / cfg.block_size) - p0 // cfg.block_size
    r = GenerationResult(
        token_ids=ids, finish_reason=FINISH_NAMES.get(int(host.finish[i]), "unknown"),
        nfe=int(host.nfe[i]), tokens_unmasked=int(host.n_unmasked[i]),
        bubble_forwards=int(host.bubbles[i]), edits=int(host.n_edits[i]), blocks=blocks,
        max_active_blocks=int(host.max_active[i]), prompt_tokens=p0, seconds=seconds, eos=eos)
    if host.logprob is not None:
        r.logprobs = host.logprob[i, p0: p0 + len(ids)].tolist()
    if tokenizer is not None:
        r.text = tokenizer.decode(ids)
    if decode is not None and decode.voting is not None:
        vote(cfg, tokenizer, r, host.trajectory[i], decode.voting)
    return r


def vote(cfg: ModelConfig, tokenizer: Tokenizer, result: GenerationResult, trajectory: np.ndarray,
         voting_cfg: VotingConfig) -> None:
    """Parses every recorded step's full prediction and votes (voting.py) into `result`."""
    r = trajectory.shape[0]
    steps = list(range(max(0, result.nfe - r), result.nfe))
    stops = set(cfg.eos_token_ids) | {cfg.mask_token_id}
    answers = []
    for t in steps:
        ids = []
        for tok in trajectory[t % r].tolist():
            if tok in stops:
                break
            ids.append(tok)
        answers.append(voting.extract(tokenizer.decode(ids), voting_cfg))
    result.voted_answer, scores = voting.vote(answers, voting_cfg, steps, result.nfe)
    result.vote_scores = {a: round(s, 6) for a, s in scores.items()}
    result.final_answer = voting.extract(result.text or "", voting_cfg)
