"""`moe_impl: measure`: an engine's warm-up times each candidate expert path on its own decode
programs and keeps the faster one per program.

Which path wins depends on the model, the number of tokens a step routes and the host: on a CPU
the loop over the hit experts (`looped`) wins at a few copies per expert, computing every expert
for every token (`dense`) at many (docs/performance.md). An engine has two decode programs, all
rows and one running row alone, whose token counts differ by the batch size, so each gets its
own choice; prefill and the expert weights' layout (model/layout.py) follow the all-rows one,
so each candidate is timed over the layout it would run with. Each candidate's decode programs
(and its smallest prefill, for the timing rows) are compiled once here, and the losers' are
never run again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from mbd_jax.config import DecodeConfig, measured_candidates
from mbd_jax.parallel import multihost

if TYPE_CHECKING:
    from mbd_jax.engine.core import Engine

STEPS = 2  # decode steps per timed call
CALLS = 3  # timed calls per (path, program); the median counts


def choose(engine: Engine, say: Callable[[str], None]) -> None:
    """Times every candidate path (config.MEASURED) on the engine's all-rows program and, with
    more than one row, its one-row program, over rows that keep their whole buffer busy (one
    token per block per step, EOS ignored); then runs each program on its fastest path
    (engine.moe_paths; the timings, ms per step, in engine.moe_timings)."""
    cfg, b = engine.cfg, engine.batch_size
    candidates = measured_candidates("moe_impl")
    programs = {"all rows": b} | ({"one row": 1} if b > 1 else {})
    # enough tokens that no row finishes within the calls: one per block per step at most
    new = min((CALLS + 1) * STEPS * engine.buffer_size + cfg.block_size, cfg.max_seq_len - 2)
    decode = DecodeConfig(buffer_size=engine.buffer_size, policy="fixed_steps",
                          steps_per_block=cfg.block_size, max_new_tokens=new, ignore_eos=True)
    prompt = np.array([cfg.pad_token_id], np.int32)
    offloader, engine.offloader = engine.offloader, None  # the timing rows' blocks are not kept
    try:
        timings = _time(engine, candidates, programs, decode, prompt, say)
    finally:
        engine.offloader = offloader
    # several processes ran the same calls; process 0's clock decides for all, so every process
    # runs the same programs
    timings = multihost.share(timings)
    best = {name: min(t, key=t.get) for name, t in timings.items()}
    engine.use_expert_paths(best["all rows"], best.get("one row", best["all rows"]))
    engine.moe_timings = timings
    say("expert paths: " + "; ".join(
        f"{name} {best[name]} (" + ", ".join(f"{k} {v:.2f}" for k, v in t.items()) + " ms/step)"
        for name, t in timings.items()))


def _time(engine: Engine, candidates: tuple[str, ...], programs: dict[str, int],
          decode: DecodeConfig, prompt: np.ndarray,
          say: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """{program: {path: median ms per decode step}}."""
    timings: dict[str, dict[str, float]] = {name: {} for name in programs}
    for impl in candidates:
        engine.use_expert_paths(impl, impl)
        for name, rows in programs.items():
            say(f"timing the {impl} expert path ({name})")
            state = engine.admit(engine.empty_state(), dict.fromkeys(range(rows),
                                                                     (prompt, decode)))
            state = engine.decode_call(state, STEPS)  # compiles
            seconds = []
            for _ in range(CALLS):
                t = time.perf_counter()
                state = engine.decode_call(state, STEPS)  # returns once the steps ran
                seconds.append(time.perf_counter() - t)
            engine.release(range(rows))
            timings[name][impl] = 1e3 * statistics.median(seconds) / STEPS
    return timings
