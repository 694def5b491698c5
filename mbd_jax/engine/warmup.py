"""An engine's warm-up: every program it can run compiled before the first request (nothing
compiles in steady state), the expert path of each decode program measured where the config
asks, and the prefill buckets a known set of prompts runs (what a one-shot command needs warm).

A service can be ready sooner: prefill is chunked, so the smallest bucket serves any prompt (in
more calls). With `background`, the warm-up compiles that one, and a thread of its own
(BackgroundBuckets) compiles the larger ones without running them while requests are served,
raising the engine's `prefill_ready` as each lands: no request ever waits on a compile."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from mbd_jax.config import DecodeConfig
from mbd_jax.engine import admission, expert_paths
from mbd_jax.engine.admission import PrefillCall, prefill_buckets
from mbd_jax.engine.host_view import host_tree
from mbd_jax.engine.pages import page_keys
from mbd_jax.engine.rows import EngineRequest, StepOutcome

log = logging.getLogger("mbd_jax.engine")


def warm_call(engine, t: int, rows: np.ndarray) -> PrefillCall:
    """The call a `t`-token chunk makes (its program): row 0 alone, or the shared one."""
    alone = admission.runs_alone(t, engine.row_prefill_min)
    return PrefillCall(t, row=0) if alone else PrefillCall(t, rows=rows)


def warmup(engine, progress: Callable[[str], None] | None = None,
           buckets: Sequence[int] | None = None, background: bool = False) -> None:
    """Compiles every program `engine` can run (all prefill buckets, or only `buckets`, the
    prefix cache's loads and gathers, the decode loop over all rows and over one through the
    engine's own step, the row merge, the host views); `progress` hears about each step
    (default: an INFO line of the `mbd_jax.engine` logger per step) and may raise to stop.
    `background` (all buckets, one process): the buckets past the smallest compile on a thread
    after this returns (BackgroundBuckets, `engine.background`)."""
    say = progress or (lambda message: log.info("warm-up: %s", message))
    t_start = time.perf_counter()
    b, cfg = engine.batch_size, engine.cfg
    zeros_b, pads = np.zeros(b, np.int32), engine.blank_rows()[0]
    if cfg.moe_impl == "measure" and cfg.num_experts > 0:
        choose_expert_paths(engine, say)  # before the prefill buckets: they follow its choice
    if engine.background is not None:  # warmed up again: the earlier thread stops first
        engine.background.stop(timeout=60.0)
        engine.background = None
    engine.prefill_ready, later = engine.prefill_chunk, []
    if buckets is None:
        buckets = prefill_buckets(cfg.block_size, engine.prefill_chunk)
        if background and jax.process_count() == 1:  # several: every process compiles in step
            buckets, later = buckets[:1], buckets[1:]
            engine.prefill_ready = buckets[-1]
    for i, t in enumerate(buckets):
        say(f"compiling prefill of {t} tokens ({i + 1}/{len(buckets)})")
        engine.prefill_call(pads, zeros_b, zeros_b, warm_call(engine, t, np.zeros(b, bool)))
        if engine.prefix is not None:  # loading t cached tokens into a row
            engine.kv = engine.prefix.warm_load(engine.kv, t)
    if engine.offloader is not None:
        engine.offloader.warmup(engine.kv)
        # what a prefill token costs, for the "time saved" metric: the largest bucket compiled
        # now, all rows
        t0 = time.perf_counter()
        call = warm_call(engine, engine.prefill_ready, np.ones(b, bool))
        engine.prefill_call(pads, zeros_b, zeros_b, call)
        jax.block_until_ready(engine.kv)
        rows = 1 if call.row is not None else b
        seconds = time.perf_counter() - t0
        engine.prefill_seconds_per_token = seconds / (rows * engine.prefill_ready)
    say(f"compiling the decode loop ({b} rows, N_buf {engine.buffer_size})")
    pad = np.array([cfg.pad_token_id], np.int32)
    for rows in sorted({1, min(2, b)}):  # one running row alone, and all rows
        run(engine, [EngineRequest(pad, DecodeConfig(max_new_tokens=1), stream=False)
                     for _ in range(rows)], max_steps=1)
    # the merge of an admission into running rows (the step skips it when no other row runs),
    # the host views a decode call's readers fetch (with and without the log-probabilities)
    # and the whole state results() fetches: each its own program (transfer.py); the
    # constrained rows' read and write-back between decode calls
    state = engine.runner.merge(engine.empty_state(), engine.empty_state(), np.zeros(b, bool))
    for tree in (host_tree(state, True), host_tree(state, False), state):
        engine.runner.fetch_rows(tree)
    engine.runner.gate_view(state)
    engine.runner.set_gates(state, zeros_b, np.zeros((b, engine.grammars.words), np.uint32),
                            np.zeros(b, bool), np.zeros(b, bool))
    jax.block_until_ready(engine.kv)
    say(f"warm-up done in {time.perf_counter() - t_start:.1f} s"
        + (f" (prefill buckets {', '.join(map(str, later))} to follow)" if later else ""))
    if later:
        engine.background = BackgroundBuckets(engine, later, say)


class BackgroundBuckets:
    """Compiles prefill buckets on a thread of its own, in increasing order, while the engine
    serves with the ones it has: a bucket's prefill programs (and the prefix cache's load of
    that many positions) compile without running (Runner.compile), then `engine.prefill_ready`
    grows to it. `say` hears about each bucket; if it raises (a service stopping), or a compile
    fails (logged), the engine keeps the buckets it has."""

    def __init__(self, engine, buckets: list[int], say: Callable[[str], None]):
        self.done = threading.Event()  # every bucket compiled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(engine, buckets, say),
                                        name="mbd-prefill-buckets", daemon=True)
        self._thread.start()

    def _run(self, engine, buckets: list[int], say: Callable[[str], None]) -> None:
        t0, b = time.perf_counter(), engine.batch_size
        zeros_b, pads = np.zeros(b, np.int32), engine.blank_rows()[0]
        for i, t in enumerate(buckets):
            try:
                say(f"compiling prefill of {t} tokens in the background ({i + 1}/{len(buckets)})")
            except Exception:  # noqa: BLE001 - the caller asks to stop
                return
            if self._stop.is_set():
                return
            try:
                call = warm_call(engine, t, np.zeros(b, bool))
                engine.runner.compile_prefill(engine.prefill_inputs(pads, zeros_b, zeros_b, call))
                if engine.prefix is not None:
                    engine.prefix.compile_load(engine.runner.compile, engine.runner.kv_shape, t)
            except Exception:  # noqa: BLE001 - serve on with the buckets compiled so far
                log.exception("compiling the prefill of %d tokens failed: prompts are prefilled "
                              "in chunks of at most %d tokens", t, engine.prefill_ready)
                return
            engine.prefill_ready = t
        self.done.set()
        log.info("prefill buckets compiled in the background in %.1f s",
                 time.perf_counter() - t0)

    def stop(self, timeout: float) -> bool:
        """Compiles no further bucket; waits up to `timeout` seconds for the one compiling now.
        False if it still runs."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()


def check(out: StepOutcome) -> StepOutcome:
    """A warm-up step that failed fails the warm-up."""
    if out.error is not None:
        raise out.error
    return out


def run(engine, requests: list[EngineRequest], max_steps: int | None = None) -> None:
    """Steps `requests` through the engine until each has finished (warm-up rows)."""
    waiting = list(requests)
    while waiting or len(engine.rows):
        out = check(engine.step(waiting, max_steps))
        waiting = [r for r in waiting if r not in out.admitted]


def choose_expert_paths(engine, say: Callable[[str], None]) -> None:
    """Runs each decode program on its fastest expert path (expert_paths.py), timing engine steps
    of decoding rows on each; the timing rows' blocks are not persisted."""
    decode = expert_paths.timing_decode(engine.cfg, engine.buffer_size)
    prompt = np.array([engine.cfg.pad_token_id], np.int32)

    def time_calls(impl: str, rows: int) -> list[float]:
        engine.use_expert_paths(impl, impl)
        jobs = [EngineRequest(prompt, decode, stream=False, persist=False) for _ in range(rows)]
        check(engine.step(jobs, expert_paths.STEPS))  # admits them all; its decode compiles
        seconds = []
        for _ in range(expert_paths.CALLS):
            t = time.perf_counter()
            check(engine.step((), expert_paths.STEPS))  # one decode call; returns once it ran
            seconds.append(time.perf_counter() - t)
        for job in jobs:
            engine.end(job)
        check(engine.step())  # frees their rows
        return seconds

    best, engine.moe_timings = expert_paths.choose(engine.batch_size, engine.cfg.platform,
                                                   time_calls, say)
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
