"""The engine thread: continuous batching over the Engine's rows, feeding per-request async streams.

One thread owns the devices. Requests wait in two bounded queues (normal and thinking, the latter
with its own row, token and time budgets). Each iteration ends the requests that were cancelled
or ran out of time, offers the queues' heads to `Engine.step()` (which admits what fits, runs
one prefill round and one decode call) and hands each row event to its request's asyncio queue,
as text (`Request.push`: the detokenizer and stop strings live with the request).

Failures: a step that fails fails the requests it touched with a 500 event and the loop goes on
(the engine reallocates device buffers lost with the call). Only `max_engine_failures` decode
failures in a row, or a failed warm-up, stop the engine for good (`error` is set, `on_fatal`
tells the server, which exits non-zero). Voting results are computed off this thread (user
patterns, trajectory decoding).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import jax

from mbd_jax.config import ServeConfig
from mbd_jax.engine import Engine, GenerationResult
from mbd_jax.engine.rows import RowEvent
from mbd_jax.serving import admission_order
from mbd_jax.serving.refusals import Draining, EngineDown, QueueFull, WarmupStopped
from mbd_jax.serving.request import Request

log = logging.getLogger("mbd_jax.serving")


WARMUP_STOP_S = 1.0  # a stop during warm-up waits this long for the program being compiled
QUEUES = {False: "normal", True: "thinking"}  # by `thinking`, as metrics name them


class Scheduler:
    def __init__(self, engine: Engine, cfg: ServeConfig, metrics) -> None:
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.ready, self.draining = False, False  # warmed up; shutting down (SIGTERM)
        self._queues = {False: collections.deque(), True: collections.deque()}  # by thinking
        self._running: set[Request] = set()  # admitted, not yet finished or ended
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mbd-engine", daemon=True)
        self.error: BaseException | None = None  # set when the engine has failed for good
        self.on_fatal: Callable[[], None] = lambda: None  # called (engine thread) when it has
        self._voting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mbd-vote")

    # ------------------------------------------------------------ called from the HTTP side
    def start(self) -> None:
        self._thread.start()

    def submit(self, requests: list[Request]) -> None:
        """Queues requests (all or none). QueueFull when, beyond the free rows, more than
        queue_size would wait; Draining after SIGTERM."""
        with self._lock:
            if self.error is not None:
                raise EngineDown()
            if self.draining:
                raise Draining()
            waiting = sum(len(q) for q in self._queues.values())
            free_rows = self.engine.batch_size - len(self._running)
            if waiting + len(requests) > self.cfg.server.queue_size + free_rows:
                raise QueueFull()
            for r in requests:
                self._queues[r.thinking].append(r)
            self.metrics.queue_length.set(waiting + len(requests))
            self._lock.notify()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._running) + sum(len(q) for q in self._queues.values())

    def abort_all(self, status: int, message: str) -> int:
        """Ends every queued and running request with an error event (the drain ran out of
        time); their rows are freed at the engine's next step. Returns how many were ended."""
        with self._lock:
            victims = [r for r in [*self._running, *self._queues[False], *self._queues[True]]
                       if not r.cancelled]
        for r in victims:
            r.cancelled = True
            r.emit("error", status, message)
        return len(victims)

    def stop(self) -> bool:
        """Stops the engine thread and closes the engine (staged prefix-cache blocks persist).
        One process waits WARMUP_STOP_S at most for a program being compiled (warm-up or
        background buckets): False if one still runs (the caller exits anyway)."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        quick = jax.process_count() == 1  # several: mirrored warm-up calls
        self._thread.join(timeout=WARMUP_STOP_S if quick and not self.ready else 30)
        if self._thread.is_alive() and not self.ready:
            return False
        self._voting.shutdown(wait=True, cancel_futures=False)
        return self.engine.close(WARMUP_STOP_S)  # persists what is staged for the prefix cache

    def _warmup_progress(self, message: str) -> None:
        """Logs a warm-up step; a stop or a drain ends the warm-up here (between programs)."""
        if self._stop or self.draining:
            raise WarmupStopped
        log.info("warm-up: %s", message)

    # ------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            t0 = time.monotonic()
            self.engine.warmup(progress=self._warmup_progress, background=True)
            if self._stop or self.draining:  # stopped during the last program: never ready
                raise WarmupStopped
            self.metrics.warmup.set(time.monotonic() - t0)
        except WarmupStopped:
            return
        except BaseException as e:
            self._fatal(e)
            return
        self.ready = True
        log.info("engine ready: %d rows, N_buf %d", self.engine.batch_size, self.engine.buffer_size)
        failures = 0  # decode failures since the last decode call that succeeded
        while True:
            with self._lock:
                idle = not self._stop and not self._running and not any(self._queues.values())
            if idle:
                self.engine.went_idle()
            with self._lock:
                while not self._stop and not self._running and not any(self._queues.values()):
                    self._lock.wait(timeout=0.5)
                if self._stop:
                    break
            try:
                out = self._iteration()
            except BaseException as e:
                self._fatal(e)
                return
            if out.error is not None:
                # Only failed decode calls count towards giving up: a request that breaks its
                # own admission is removed with it, however many such requests arrive.
                failures += out.decode_failed
                self.metrics.engine_failures.inc()
                log.error("engine step failed (%s: %s)", type(out.error).__name__, out.error,
                          exc_info=out.error)
                if failures >= self.cfg.server.max_engine_failures:
                    self._fatal(out.error)
                    return
                for r in (job.tag for job in out.failed if job.tag in self._running):
                    self._forget(r)
                    r.emit("error", 500, "the engine failed while running this request; it has "
                                         "recovered, retry the request")
            elif out.decoded:
                failures = 0

    def _iteration(self):
        """End what was cancelled or ran out of time, one engine step over the queues' heads,
        then deliver its events. Returns the step's outcome (its failures are the caller's)."""
        self._expire_and_cancel()
        self._prefetch()
        out = self.engine.step([r.job for r in self._candidates()], self.cfg.server.steps_per_call)
        self._admitted([job.tag for job in out.admitted])
        stats = self.engine.stats()
        if out.decoded:
            seconds, steps = stats.recent_calls[-1]
            if steps:
                self.metrics.decode_step.observe(seconds / steps)
        for event in out.events:
            self._deliver(event)
        self.metrics.busy_rows.set(len(self._running))
        return out

    def _fatal(self, e: BaseException) -> None:
        """The engine cannot go on: fail everything, refuse new work, tell the server."""
        with self._lock:
            self.error = e
            victims = [*self._running, *self._queues[False], *self._queues[True]]
            self._running.clear()
            for q in self._queues.values():
                q.clear()
        log.error("the engine failed for good (%s: %s); the server exits", type(e).__name__, e,
                  exc_info=e)
        for r in victims:
            r.emit("error", 503, "the engine failed; the server is restarting")
        self.on_fatal()

    def _budget(self, r: Request) -> float:
        g = self.cfg.generation
        return (g.thinking_timeout_ms if r.thinking else self.cfg.server.generation_timeout_ms) / 1e3

    def _forget(self, r: Request) -> None:
        with self._lock:
            self._running.discard(r)

    def _expire_and_cancel(self) -> None:
        now = time.monotonic()
        queue_timeout = self.cfg.server.queue_timeout_ms / 1e3
        with self._lock:
            for q in self._queues.values():
                for r in [r for r in q if r.cancelled or now - r.arrived > queue_timeout]:
                    q.remove(r)
                    if not r.cancelled:  # overload: the client may retry (503 + Retry-After)
                        self.metrics.rejected.labels("queue_timeout").inc()
                        r.emit("error", 503, f"the server is overloaded: the request waited more "
                                             f"than queue_timeout_ms "
                                             f"({self.cfg.server.queue_timeout_ms}) for a free row")
            gone = [r for r in self._running if r.cancelled or now - r.started > self._budget(r)]
        for r in gone:
            self.engine.end(r.job)  # its row is freed at the next step
            self._forget(r)
            if not r.cancelled:
                r.emit("error", 504, f"generation took longer than its time budget "
                                     f"({self._budget(r):.0f} s)")

    def _prefetch(self) -> None:
        """Looks the next queued requests up in the prefix cache and starts copying their blocks
        to the device while they wait (at most one batch of rows ahead)."""
        if not self.engine.prefix_cache:
            return
        with self._lock:
            ahead = [r for q in (self._queues[False], self._queues[True]) for r in q
                     ][: self.engine.batch_size]
        for r in ahead:
            if not r.job.prefetched:
                r.job.prefix, r.job.prefetched = self.engine.prefetch(r.prompt), True

    def _candidates(self) -> list[Request]:
        """What the engine may admit now, in the scheduler's order (admission_order.py)."""
        with self._lock:
            free = self.engine.batch_size - len(self._running)
            room = self.cfg.generation.thinking_max_rows - sum(r.thinking for r in self._running)
            return admission_order.offer(self._queues[False], self._queues[True], free, room,
                                         self.cfg.scheduler,
                                         self.cfg.server.queue_timeout_ms / 1e3, time.monotonic())

    def _admitted(self, requests: list[Request]) -> None:
        now = time.monotonic()
        with self._lock:
            for r in requests:
                self._queues[r.thinking].remove(r)
                self._running.add(r)
                r.started = now
                self.metrics.queue_wait.labels(QUEUES[r.thinking]).observe(now - r.arrived)
            self.metrics.queue_length.set(sum(len(q) for q in self._queues.values()))

    def _deliver(self, event: RowEvent) -> None:
        """Streams a row's new tokens as text; a finished row's result is sent (voting on the
        voting thread); a stop string in the text ends the row (its result follows at the next
        step)."""
        r: Request = event.request.tag
        if r not in self._running:  # ended meanwhile (cancelled, out of time)
            return
        now = time.monotonic()
        stopped_before = r.stopped
        text = "" if stopped_before else r.push(event.tokens, self.engine.tokenizer,
                                                event.finished)
        if event.tokens or text:
            if r.first_block is None:
                r.first_block = now
                self.metrics.first_block.observe(now - r.arrived)
            else:
                self.metrics.inter_block.observe(now - r.last_block)
            r.last_block = now
            r.emit("tokens", event.tokens, text, event.logprobs)
            r.sent_tokens += len(event.tokens)
        if event.finished:
            self._forget(r)
            self._finish(r, event, now)
        elif r.stopped and not stopped_before:
            self.engine.end(r.job, "stop")

    def _finish(self, r: Request, event: RowEvent, now: float) -> None:
        """Builds and sends a finished row's result; with voting (user patterns, one decode per
        recorded step) on the voting thread, so the engine thread never waits on it. A row ended
        by a stop string returns the tokens streamed so far and the text before the stop string
        (no vote: its trajectory did not finish)."""
        by_stop = r.stopped

        def finish() -> None:
            try:
                result: GenerationResult = event.result(now - r.arrived)
                if by_stop:
                    result = dataclasses.replace(result, finish_reason="stop")
                if r.stops is not None:
                    result.text = "".join(r.released)
            except Exception:
                log.exception("building the result of %s failed", r.id)
                r.emit("error", 500, "building this request's result failed; see the server log")
                return
            self.metrics.request_done(result, now - r.arrived)
            r.emit("done", result)

        if not self.engine.can_vote or r.decode.voting is None or by_stop:
            finish()
        else:
            self._voting.submit(finish)
