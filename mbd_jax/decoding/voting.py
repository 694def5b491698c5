"""Temporal self-consistency voting: a weighted vote over the answers parsed at every decode step.

At step t of T the full prediction (committed tokens + the argmax at masked positions) is parsed
into an answer a_t; the voted answer is argmax_a sum_t f(t) [a_t = a] with f(t) = 1 (fixed),
(t + 1) / T (linear) or exp(alpha * t / T) (exp). Host-side and pure.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from mbd_jax import user_regex
from mbd_jax.config import VotingConfig

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

# The most decode steps an engine records for voting: the trajectory ring is [rows, steps,
# generated positions] of int32 on the device; a longer generation votes over its last steps.
MAX_RECORDED_STEPS = 1024


def record_shape(max_nfe: int, max_new_tokens: int, max_seq_len: int) -> tuple[int, int]:
    """(steps, positions) an engine records (Engine's record_steps, record_len) for requests of
    up to `max_nfe` forwards and `max_new_tokens` tokens."""
    return min(max_nfe, MAX_RECORDED_STEPS), min(max_new_tokens, max_seq_len)


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, with nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract(text: str, cfg: VotingConfig) -> str | None:
    """The answer in `text` by cfg.extractor, or None when there is none."""
    if cfg.extractor == "last_number":
        found = _NUMBER.findall(text)
        return found[-1] if found else None
    if cfg.extractor == "boxed":
        return _boxed(text)
    return user_regex.last_answer(cfg.pattern, text)  # RE2: linear time, whatever the pattern


def step_weight(t: int, total: int, cfg: VotingConfig) -> float:
    if cfg.weighting == "fixed":
        return 1.0
    if cfg.weighting == "linear":
        return (t + 1) / total
    return math.exp(cfg.alpha * t / total)


def vote(answers: list[str | None], cfg: VotingConfig,
         steps: list[int] | None = None, total: int | None = None) -> tuple[str | None, dict[str, float]]:
    """Weighted vote over per-step answers. `steps` are the step indices of `answers` (default
    0..len-1) out of `total` steps (default len). Returns (winner or None, score per answer)."""
    steps = list(range(len(answers))) if steps is None else steps
    total = total or len(answers)
    scores: dict[str, float] = defaultdict(float)
    last_seen: dict[str, int] = {}
    for t, a in zip(steps, answers):
        if a is not None:
            scores[a] += step_weight(t, total, cfg)
            last_seen[a] = t
    if not scores:
        return None, {}
    # Ties go to the answer seen most recently.
    return max(scores, key=lambda a: (scores[a], last_seen[a])), dict(scores)
