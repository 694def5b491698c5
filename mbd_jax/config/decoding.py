"""Decoding settings per request (`DecodeConfig`, with temporal self-consistency `VotingConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from mbd_jax import user_regex
from mbd_jax.config.fields import _check, _check_range, from_dict
from mbd_jax.config.structure import Structure
from mbd_jax.errors import ConfigError

UnmaskPolicy = Literal["threshold", "fixed_steps", "factor"]  # decoding/policy.py
# "edit": filled tokens may be rewritten; "indel": also deleted, or given a MASK before them
# (Levenshtein editing; models with delete/split ids: decoding/indel.py)
SamplingMode = Literal["naive", "edit", "indel"]
BlockActivation = Literal["progress", "eager"]  # when MultiBD's next block joins (decoding/block_buffer.py)
# edit mode: which blocks wait for a forward that changes nothing in them (decoding/block_buffer.py)
EditConfirm = Literal["always", "context"]
VoteWeighting = Literal["fixed", "linear", "exp"]  # decoding/voting.py
VoteExtractor = Literal["last_number", "boxed", "regex"]


@dataclasses.dataclass(frozen=True)
class VotingConfig:
    """Temporal self-consistency voting (arXiv 2508.09138): parse an answer from the full prediction
    at every decode step and return the weighted majority beside the final text."""

    weighting: VoteWeighting = "exp"  # f(t): 1, (t+1)/T, exp(alpha*t/T)
    alpha: float = 5.0
    extractor: VoteExtractor = "last_number"
    pattern: str | None = None  # regex extractor: the answer is group 1 (or the whole match)

    def validate(self, where: str = "voting") -> None:
        # exp(alpha * t / T) stays far inside float64 for alpha <= 100
        _check_range(self, where, "alpha", 0.0, 100.0)
        if self.extractor == "regex":
            _check(bool(self.pattern), where, "field 'pattern' is required with extractor 'regex'")
            try:
                user_regex.compile_pattern(self.pattern)
            except ValueError as e:
                raise ConfigError(f"{where}: field 'pattern': {e}") from None


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How one request is decoded. SingleBD is buffer_size 1; MultiBD is the same loop with more."""

    buffer_size: int = 1  # N_buf: blocks decoded at once
    accept_threshold: float = 0.95  # tau_accept: accept masked positions more confident than this
    add_block_threshold: float = 0.1  # tau_add: activate the next block once the last is this full
    # "progress": the next block joins when the last is tau_add full (and tau_stable stable), one
    # per forward (the paper's rule); "eager": every free slot whose block starts before the limit
    # is active at once, from the first forward on (the thresholds above unused)
    block_activation: BlockActivation = "progress"
    semi_complete_threshold: float = 0.9  # tau_semi: a block's top-1 fallback needs this much of its predecessor
    token_stability_threshold: float = 0.0  # tau_stable: share of the last block the model keeps
    policy: UnmaskPolicy = "threshold"
    steps_per_block: int = 8  # fixed_steps: block_size / steps_per_block tokens per step
    factor: float = 1.0  # factor (Fast-dLLM): accept the n most confident with (m+1)(1-c_m) <= factor
    sampling_mode: SamplingMode = "naive"
    # edit / indel: rewrite (indel: or delete, or split) a filled token when the model's other
    # choice is this confident
    edit_threshold: float = 0.5
    max_post_edit_steps: int = 16  # edit / indel: a block is final after block_size + this many steps
    # edit: "always": every block waits for a forward that changes nothing in it; "context": only
    # a block last written while an earlier block still had a MASK, or edited, waits for one
    edit_confirm: EditConfirm = "always"
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # sample among the k most likely tokens; 0 = no limit
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    ignore_eos: bool = False  # decode all max_new_tokens past EOS (benchmarks: fixed work per row)
    max_nfe: int = 1024  # decode forwards per request
    voting: VotingConfig | None = None
    # the output must match this grammar (a JSON Schema, a regex, ...: config/structure.py)
    structure: Structure | None = None

    def validate(self, where: str = "decoding") -> None:
        for field, (lo, hi) in RANGES.items():
            _check_range(self, where, field, lo, hi)
        _check(self.sampling_mode != "indel" or self.voting is None, where,
               "sampling_mode 'indel' cannot be combined with field 'voting' (positions move)")
        _check(0.0 < self.top_p <= 1.0, where, f"field 'top_p' must be in (0, 1], got {self.top_p}")
        if self.structure is not None:
            _check(self.voting is None, where, "structured output cannot be combined with "
                   "field 'voting' (voting picks an answer out of unconstrained predictions)")
            _check(not self.ignore_eos, where, "structured output cannot be combined with "
                   "field 'ignore_eos' (a constrained output ends where its grammar does)")

    @property
    def edits(self) -> bool:
        """Filled tokens may change (sampling_mode edit or indel)."""
        return self.sampling_mode != "naive"

    def tokens_per_step(self, block_size: int) -> int:
        return max(1, -(-block_size // self.steps_per_block))


# Each numeric field's allowed [low, high] (top_p, in (0, 1], is checked apart): what validate()
# checks and /openapi.json publishes. Integer fields become int32 device values; their bounds
# leave room for the sums the loop computes (block_size + max_post_edit_steps, prompt_len +
# max_new_tokens).
RANGES: dict[str, tuple[float, float]] = {
    "buffer_size": (1, 1024),
    "steps_per_block": (1, 1 << 16),
    "max_post_edit_steps": (0, 1 << 16),
    "max_new_tokens": (1, 1 << 30),
    "max_nfe": (1, 1 << 30),
    "add_block_threshold": (0, 1e6),
    "factor": (1e-6, 1e6),
    "temperature": (0, 100),
    "top_k": (0, 1 << 30),
    "accept_threshold": (0, 1),
    "semi_complete_threshold": (0, 1),
    "token_stability_threshold": (0, 1),
    "edit_threshold": (0, 1),
    "seed": (0, 2**31 - 1),
}


def decode_config(**overrides: Any) -> DecodeConfig:
    """A DecodeConfig from keyword overrides (None values keep the default), validated."""
    return from_dict(DecodeConfig, {k: v for k, v in overrides.items() if v is not None},
                     where="decoding")
