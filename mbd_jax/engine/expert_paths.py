"""`moe_impl: measure`: an engine's warm-up times each candidate expert path on its own decode
programs and keeps the faster one per program.

Which path wins depends on the model, the number of tokens a step routes and the host: on a CPU
the loop over the hit experts (`looped`) wins at a few copies per expert, computing every expert
for every token (`dense`) at many (docs/lab/performance-history.md). An engine has two decode programs, all
rows and one running row alone, whose token counts differ by the batch size, so each gets its
own choice; prefill and the expert weights' layout (model/layout.py) follow the all-rows one,
so each candidate is timed over the layout it would run with. Each candidate's decode programs
(and its smallest prefill, for the timing rows) are compiled once, and the losers' are never
run again. This module plans and decides; the engine runs the timed calls (`TimeCalls`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from mbd_jax.config import DecodeConfig, ModelConfig, measured_candidates
from mbd_jax.parallel import multihost

STEPS = 2  # decode steps per timed call
CALLS = 3  # timed calls per (path, program); the median counts

# (expert path, rows) -> seconds of each of CALLS decode calls of STEPS steps, over `rows` rows
# decoding timing_decode() on that path (after one untimed call that compiles)
TimeCalls = Callable[[str, int], list[float]]


def timing_decode(cfg: ModelConfig, buffer_size: int) -> DecodeConfig:
    """What the timing rows decode: their whole buffer busy (one token per block per step, EOS
    ignored), with enough tokens that no row finishes within the calls."""
    new = min((CALLS + 1) * STEPS * buffer_size + cfg.block_size, cfg.max_seq_len - 2)
    return DecodeConfig(buffer_size=buffer_size, policy="fixed_steps",
                        steps_per_block=cfg.block_size, max_new_tokens=new, ignore_eos=True)


def choose(batch_size: int, platform: str, time_calls: TimeCalls, say: Callable[[str], None]
           ) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Times every candidate path on `platform` (config.MEASURED) on the all-rows program and,
    with more than one row, the one-row program. Returns ({program: fastest path}, {program: {path: ms per
    step}}), process 0's on every process (its clock decides, so all run the same programs)."""
    programs = {"all rows": batch_size} | ({"one row": 1} if batch_size > 1 else {})
    timings: dict[str, dict[str, float]] = {name: {} for name in programs}
    for impl in measured_candidates("moe_impl", platform):
        for name, rows in programs.items():
            say(f"timing the {impl} expert path ({name})")
            timings[name][impl] = 1e3 * statistics.median(time_calls(impl, rows)) / STEPS
    timings = multihost.share(timings)
    best = {name: min(t, key=t.get) for name, t in timings.items()}
    say("expert paths: " + "; ".join(
        f"{name} {best[name]} (" + ", ".join(f"{k} {v:.2f}" for k, v in t.items()) + " ms/step)"
        for name, t in timings.items()))
    return best, timings
