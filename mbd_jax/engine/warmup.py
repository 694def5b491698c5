"""An engine's warm-up: every program it can run compiled before the first request (nothing
compiles in steady state), the expert path of each decode program measured where the config
asks, and the prefill buckets a known set of prompts runs (what a one-shot command needs warm)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from mbd_jax.config import DecodeConfig
from mbd_jax.engine import admission, expert_paths
from mbd_jax.engine.admission import PrefillCall, prefill_buckets
from mbd_jax.engine.host_view import host_tree
from mbd_jax.engine.pages import page_keys


def warm_call(engine, t: int, rows: np.ndarray) -> PrefillCall:
    """The call a `t`-token chunk makes (its program): row 0 alone, or the shared one."""
    alone = admission.runs_alone(t, engine.row_prefill_min)
    return PrefillCall(t, row=0) if alone else PrefillCall(t, rows=rows)


def warmup(engine, progress: Callable[[str], None] | None = None,
           buckets: Sequence[int] | None = None) -> None:
    """Compiles every program `engine` can run (all prefill buckets, or only `buckets`, the
    prefix cache's loads and gathers, the row merge, the decode loop over all rows and over one,
    the host views); `progress` hears about each step."""
    say = progress or (lambda message: None)
    t_start = time.perf_counter()
    b, cfg = engine.batch_size, engine.cfg
    zeros_b, pads = np.zeros(b, np.int32), engine.blank_rows()[0]
    if cfg.moe_impl == "measure" and cfg.num_experts > 0:
        choose_expert_paths(engine, say)  # before the prefill buckets: they follow its choice
    buckets = prefill_buckets(cfg.block_size, engine.prefill_chunk) if buckets is None else buckets
    for i, t in enumerate(buckets):
        say(f"compiling prefill of {t} tokens ({i + 1}/{len(buckets)})")
        engine.prefill_call(pads, zeros_b, zeros_b, warm_call(engine, t, np.zeros(b, bool)))
        if engine.prefix is not None:  # loading t cached tokens into a row
            engine.kv = engine.prefix.warm_load(engine.kv, t)
    if engine.offloader is not None:
        engine.offloader.warmup(engine.kv)
        # what a prefill token costs, for the "time saved" metric: the largest bucket, all rows
        t0 = time.perf_counter()
        call = warm_call(engine, engine.prefill_chunk, np.ones(b, bool))
        engine.prefill_call(pads, zeros_b, zeros_b, call)
        jax.block_until_ready(engine.kv)
        rows = 1 if call.row is not None else b
        engine.prefill_seconds_per_token = (time.perf_counter() - t0) / (rows * engine.prefill_chunk)
    say(f"compiling the decode loop ({b} rows, N_buf {engine.buffer_size})")
    one = (np.array([cfg.pad_token_id], np.int32), DecodeConfig(max_new_tokens=1))
    for rows in sorted({1, min(2, b)}):  # one running row alone, and all rows (and the merge)
        state = engine.admit(engine.empty_state(), dict.fromkeys(range(rows), one))
        state = engine.decode_call(state, 1)
        engine.release(range(rows))
    # the host views a decode call's readers fetch (with and without the log-probabilities),
    # and the whole state that results() fetches: each a packing program (transfer.py)
    for tree in (host_tree(state, True), host_tree(state, False), state):
        engine.runner.fetch_rows(tree)
    jax.block_until_ready(engine.kv)
    say(f"warm-up done in {time.perf_counter() - t_start:.1f} s")


def choose_expert_paths(engine, say: Callable[[str], None]) -> None:
    """Runs each decode program on its fastest expert path (expert_paths.py); the timing rows'
    blocks are not persisted."""
    decode = expert_paths.timing_decode(engine.cfg, engine.buffer_size)
    prompt = np.array([engine.cfg.pad_token_id], np.int32)

    def time_calls(impl: str, rows: int) -> list[float]:
        engine.use_expert_paths(impl, impl)
        state = engine.admit(engine.empty_state(), dict.fromkeys(range(rows), (prompt, decode)))
        state = engine.decode_call(state, expert_paths.STEPS)  # compiles
        seconds = []
        for _ in range(expert_paths.CALLS):
            t = time.perf_counter()
            state = engine.decode_call(state, expert_paths.STEPS)  # returns once they ran
            seconds.append(time.perf_counter() - t)
        engine.release(range(rows))
        return seconds

    offloader, engine.offloader = engine.offloader, None
    try:
        best, engine.moe_timings = expert_paths.choose(engine.batch_size, engine.cfg.platform,
                                                       time_calls, say)
    finally:
        engine.offloader = offloader
    engine.use_expert_paths(best["all rows"], best.get("one row", best["all rows"]))


def prefill_buckets_for(engine, prompts: Sequence[Sequence[int]]) -> list[int]:
    """The prefill lengths `engine.generate(prompts)` compiles (batch_size rows at a time,
    prefix pages shared as generate shares them, no prefix store hits, a pool large enough for
    each batch): what a one-shot command needs warm, where the service needs every bucket."""
    used, indexed = set(), set()
    blk, page, share = engine.cfg.block_size, engine.pages.page, engine.plan.share_prefixes

    def prefill(batch: list[np.ndarray]) -> None:  # the calls prefill_step makes
        rows = np.ones(len(batch), bool)
        full = admission.full_blocks(batch, rows, blk)
        start = np.zeros(len(batch), np.int32)
        for i, p in enumerate(batch):
            keys = page_keys(p, page, int(full[i])) if share else []
            while start[i] // page < len(keys) and keys[start[i] // page] in indexed:
                start[i] += page
        while (full > start).any():
            calls, start = engine.next_round(full, start, rows)
            used.update(call.tokens for call in calls)
        for p in batch:
            if share:
                indexed.update(page_keys(p, page, len(p) // blk * blk))

    for s in range(0, len(prompts), engine.batch_size):
        batch = [np.asarray(p) for p in prompts[s: s + engine.batch_size]]
        later = engine.plan.admitted_later(batch, indexed.__contains__)  # as generate splits it
        prefill([p for i, p in enumerate(batch) if i not in later])
        if later:
            prefill([batch[i] for i in sorted(later)])
    return sorted(used)
