"""The engine thread: continuous batching over the Engine's rows, feeding per-request async streams.

One thread owns the devices. Requests wait in two bounded queues (normal and thinking, the latter
with its own row, token and time budgets); between decode calls the thread refills free rows
(prefilling only those rows), frees the rows of finished, cancelled or timed-out requests, and
hands every newly committed block to its request's asyncio queue.

Failures: an exception in one iteration fails the requests that iteration touched (the admitted
rows, or every row for a decode call) with a 500 event and the loop goes on; device buffers lost
with the failed call are allocated afresh. Only `max_engine_failures` decode failures in a row, or
a failed warm-up, stop the engine for good (`error` is set, `on_fatal` tells the server, which
exits non-zero). Voting results are computed off this thread (user patterns, trajectory decoding).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from mbd_jax.config import DecodeConfig, ServeConfig
from mbd_jax.detokenizer import IncrementalDetokenizer
from mbd_jax.engine import Engine, GenerationResult
from mbd_jax.stop_strings import StopStrings

log = logging.getLogger("mbd_jax.serving")


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


class EngineDown(Exception):
    """The engine has failed for good; the process is exiting."""


@dataclasses.dataclass
class Request:
    """One generation. Events on `events` (read by the HTTP handler, on its event loop):
    ("tokens", ids, text_delta, logprobs or None) for every committed block, then ("done",
    GenerationResult)
    or ("error", http_status, message)."""

    id: str
    prompt: list[int]
    decode: DecodeConfig
    loop: asyncio.AbstractEventLoop
    thinking: bool = False
    logprobs: bool = False  # report each token's log-probability
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the HTTP side (client went away)
    started: float | None = None
    first_block: float | None = None
    last_block: float | None = None  # when its latest block was streamed
    sent_tokens: int = 0
    detokenizer: IncrementalDetokenizer | None = None  # the streamed text (engine thread)
    prefix: Any = None  # the prefix-cache hit prefetched while it waited (engine.PrefixHit)
    prefetched: bool = False
    stops: StopStrings | None = None  # stop strings: the row ends at the first one
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    released: list[str] = dataclasses.field(default_factory=list)  # text sent (with stop strings)

    def emit(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    def __init__(self, engine: Engine, cfg: ServeConfig, metrics) -> None:
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics
        self.ready = False
        self.draining = False
        self._queues = {False: collections.deque(), True: collections.deque()}  # by thinking
        self._rows: dict[int, Request] = {}  # busy rows: decoding, or being prefilled
        self._prefilling: set[int] = set()  # rows of the admission in progress
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mbd-engine", daemon=True)
        self.error: BaseException | None = None  # set when the engine has failed for good
        self.on_fatal: Callable[[], None] = lambda: None  # called (engine thread) when it has
        self._touched: set[int] = set()  # rows the current iteration's step works on
        self._in_decode = False  # the current step is the batch-wide decode call
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
            free_rows = self.engine.batch_size - len(self._rows)
            if waiting + len(requests) > self.cfg.server.queue_size + free_rows:
                raise QueueFull()
            for r in requests:
                self._queues[r.thinking].append(r)
            self.metrics.queue_length.set(waiting + len(requests))
            self._lock.notify()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._rows) + sum(len(q) for q in self._queues.values())

    def abort_all(self, status: int, message: str) -> int:
        """Ends every queued and running request with an error event (the drain ran out of
        time); their rows are freed at the engine's next step. Returns how many were ended."""
        with self._lock:
            victims = [r for r in list(self._rows.values()) + [r for q in self._queues.values()
                                                                for r in q] if not r.cancelled]
        for r in victims:
            r.cancelled = True
            r.emit("error", status, message)
        return len(victims)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=30)
        self._voting.shutdown(wait=True, cancel_futures=False)
        self.engine.close()  # persist what is staged for the prefix cache before exiting

    # ------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            t0 = time.monotonic()
            self.engine.warmup(progress=lambda message: log.info("warm-up: %s", message))
            self.metrics.warmup.set(time.monotonic() - t0)
            state = self.engine.empty_state()
        except BaseException as e:
            self._fatal(e)
            return
        self.ready = True
        log.info("engine ready: %d rows, N_buf %d", self.engine.batch_size, self.engine.buffer_size)
        admission = None
        failures = 0  # decode failures since the last decode call that succeeded
        while True:
            with self._lock:
                idle = not self._stop and not self._rows and not any(self._queues.values())
            if idle:
                self.engine.went_idle()
            with self._lock:
                while not self._stop and not self._rows and not any(self._queues.values()):
                    self._lock.wait(timeout=0.5)
                if self._stop:
                    break
            try:
                state, admission, decoded = self._iteration(state, admission)
                failures = 0 if decoded else failures
            except Exception as e:
                # Only failed decode calls count towards giving up: a request that breaks its
                # own admission is removed with it, however many such requests arrive.
                failures += self._in_decode
                self.metrics.engine_failures.inc()
                log.exception("engine step failed on rows %s", sorted(self._touched))
                if failures >= self.cfg.server.max_engine_failures:
                    self._fatal(e)
                    return
                try:
                    state, admission = self._recover(state, admission)
                except BaseException as e2:
                    self._fatal(e2)
                    return
            except BaseException as e:
                self._fatal(e)
                return

    def _iteration(self, state, admission):
        """Expire, admit (one prefill chunk), decode, publish. Returns (state, admission, whether
        a decode call ran)."""
        self._touched, self._in_decode = set(), False
        state = self._expire_and_cancel(state)
        self._prefetch()
        # Prefill one chunk per iteration, so a long prompt does not stall running rows for more
        # than one chunk between their decode calls.
        if admission is None:
            admission = self._begin_admission()
        if admission is not None:
            self._touched = set(self._prefilling)
            if self.engine.prefill_step(admission):
                state = self.engine.finish_admit(state, admission)
                self._prefilling.clear()
                admission = None
        decoding = set(self._rows) - self._prefilling
        if not decoding:
            return state, admission, False
        self._touched, self._in_decode = set(self._rows), True  # one program runs every row
        state = self.engine.decode_call(state, self.cfg.server.steps_per_call)
        seconds, steps = self.engine.stats().recent_calls[-1]
        if steps:
            self.metrics.decode_step.observe(seconds / steps)
        stopped = self._publish(self._fetch(state))
        if stopped:  # a stop string ended these rows early: free them at the next step
            state = self.engine.cancel(state, stopped)
        return state, admission, True

    def _recover(self, state, admission):
        """After a failed step: fails the requests it touched and frees their rows; when the
        device buffers went down with the failed call, every row is failed and they are
        allocated afresh. Returns (state, admission) to go on with."""
        lost = not self.engine.buffers_intact(state)
        victims = set(self._rows) if lost else set(self._touched)
        with self._lock:
            failed = [self._rows.pop(row) for row in victims if row in self._rows]
        for r in failed:
            r.emit("error", 500, "the engine failed while running this request; it has "
                                 "recovered, retry the request")
        if lost:
            self.engine.reset_buffers()
            state = self.engine.empty_state()
        elif victims:
            state = self.engine.cancel(state, sorted(victims))
        if admission is not None and set(self._prefilling) & victims:
            admission = None
        self._prefilling -= victims
        self.metrics.busy_rows.set(len(self._rows))
        return state, admission

    def _fatal(self, e: BaseException) -> None:
        """The engine cannot go on: fail everything, refuse new work, tell the server."""
        with self._lock:
            self.error = e
            victims = list(self._rows.values()) + [r for q in self._queues.values() for r in q]
            self._rows.clear()
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

    def _expire_and_cancel(self, state):
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
        gone = [row for row, r in self._rows.items() if row not in self._prefilling
                and (r.cancelled or now - (r.started or now) > self._budget(r))]
        if gone:
            state = self.engine.cancel(state, gone)
            for row in gone:
                with self._lock:
                    r = self._rows.pop(row)
                if not r.cancelled:
                    r.emit("error", 504, f"generation took longer than its time budget "
                                         f"({self._budget(r):.0f} s)")
            self.metrics.busy_rows.set(len(self._rows))
        return state

    def _prefetch(self) -> None:
        """Warm-up: looks the next queued requests up in the prefix cache and starts copying their
        blocks to the device while they wait (at most one batch of rows ahead)."""
        if not self.engine.prefix_cache:
            return
        with self._lock:
            ahead = [r for q in (self._queues[False], self._queues[True]) for r in q
                     ][: self.engine.batch_size]
        for r in ahead:
            if not r.prefetched:
                r.prefix, r.prefetched = self.engine.prefetch(r.prompt), True

    def _begin_admission(self):
        """Moves waiting requests into free rows and starts their prefill (None if nothing to do).
        Rows no request holds give their KV pages back first; the queue's head waits (and the
        rest behind it) until the pool has its pages, or for the next admission when its first
        page is one a request picked here is about to prefill (it then maps those pages)."""
        free = [i for i in range(self.engine.batch_size) if i not in self._rows]
        self.engine.release(free)  # rows no request holds give their pages back
        if not free:
            return None
        thinking_rows = sum(r.thinking for r in self._rows.values())
        picked: dict[int, Request] = {}
        pages = self.engine.stats().pages_free
        with self._lock:
            for row in free:
                q = self._queues[False]
                if not q and thinking_rows < self.cfg.generation.thinking_max_rows:
                    q = self._queues[True]
                cost = self.engine.pages_to_admit(q[0].prompt, q[0].decode) if q else 0
                if not q or cost > pages or self.engine.waits_for(
                        q[0].prompt, [r.prompt for r in picked.values()]):
                    break  # (a shared first page: the next admission maps it, not prefills)
                pages -= cost
                r = q.popleft()
                thinking_rows += r.thinking
                picked[row] = r
                self._rows[row] = r  # under the lock: submit() counts waiting + busy together
            self.metrics.queue_length.set(sum(len(q) for q in self._queues.values()))
        if not picked:
            return None
        now = time.monotonic()
        for row, r in picked.items():
            r.started = now
            self.metrics.queue_wait.observe(now - r.arrived)
        self.metrics.busy_rows.set(len(self._rows))
        self._prefilling = set(picked)
        self._touched = set(picked)  # a failure from here on fails these requests
        admission = self.engine.begin_admit(
            {row: (r.prompt, r.decode) for row, r in picked.items()},
            prefetched={row: r.prefix for row, r in picked.items()})
        for row, r in picked.items():
            r.cached_tokens = int(admission.start[row])
        return admission

    def _fetch(self, state):
        """The state on the host, without the voting trajectories ([B, steps, len]: large) unless
        a finished row asked for a vote."""
        host = self.engine.host_view(  # shared with the offloader: one transfer per call
            state, logprobs=any(r.logprobs for r in self._rows.values()))
        if any(host.done[row] and r.decode.voting is not None for row, r in self._rows.items()
               if row not in self._prefilling):
            host = host.replace(trajectory=jax.device_get(state.trajectory))
        return host

    def _publish(self, host) -> list[int]:
        """Streams newly committed blocks; finishes done rows. Returns the rows a stop string
        ended (still running on the device: the caller cancels them)."""
        blk = self.engine.cfg.block_size
        tok = self.engine.tokenizer
        now = time.monotonic()
        stopped, finished = [], []
        for row, r in list(self._rows.items()):
            if row in self._prefilling:  # not merged yet: the device state is the old occupant's
                continue
            p0 = int(host.prompt_len[row])
            done = bool(host.done[row])
            if done:
                new = self.engine.output_ids(host, row)[r.sent_tokens:]
            else:  # committed or final (TO_CACHE) blocks never change
                end = int(host.cached_len[row]) + int(host.n_to_cache[row]) * blk
                new = host.canvas[row, p0 + r.sent_tokens: max(end, p0)].tolist()
            text = ""
            if tok is not None:
                r.detokenizer = r.detokenizer or IncrementalDetokenizer(tok)
                text = r.detokenizer.push(new) + (r.detokenizer.finish() if done else "")
            if r.stops is not None:
                text = r.stops.push(text)
                if done:  # the held-back tail (or the text before a stop string it holds)
                    text += r.stops.finish()
                if r.stops.stopped:
                    stopped.append(row)
                r.released.append(text)
            lps = None
            if r.logprobs:
                start = p0 + r.sent_tokens
                lps = host.logprob[row, start: start + len(new)].tolist()
            if new or text:
                if r.first_block is None:
                    r.first_block = now
                    self.metrics.first_block.observe(now - r.arrived)
                else:
                    self.metrics.inter_block.observe(now - r.last_block)
                r.last_block = now
                r.emit("tokens", new, text, lps)
                r.sent_tokens += len(new)
            if done or row in stopped:
                self._finish(r, host, row, now, by_stop=row in stopped)
                with self._lock:
                    del self._rows[row]
                if done:  # a stopped row still runs until its cancel lands: freed later
                    finished.append(row)
        if finished:
            self.engine.release(finished)
        self.metrics.busy_rows.set(len(self._rows))
        self.metrics.kv_usage.set(self.engine.stats().kv_usage)
        return stopped

    def _finish(self, r: Request, host, row: int, now: float, by_stop: bool = False) -> None:
        """Builds and sends a finished row's result; with voting (user patterns, one decode per
        recorded step) on the voting thread, so the engine thread never waits on it. A row ended
        by a stop string returns the tokens streamed so far and the text before the stop string
        (no vote: its trajectory did not finish)."""
        p0 = int(host.prompt_len[row])
        sent = host.canvas[row, p0: p0 + r.sent_tokens].tolist() if by_stop else None

        def finish() -> None:
            try:
                result: GenerationResult = self.engine.result_of(
                    host, row, now - r.arrived, None if by_stop else r.decode)
                if by_stop:
                    lps = host.logprob[row, p0: p0 + len(sent)].tolist() if r.logprobs else None
                    result = dataclasses.replace(result, token_ids=sent, finish_reason="stop",
                                                 logprobs=lps)
                if r.stops is not None:
                    result.text = "".join(r.released)
            except Exception:
                log.exception("building the result of %s failed", r.id)
                r.emit("error", 500, "building this request's result failed; see the server log")
                return
            self.metrics.latency.observe(now - r.arrived)
            self.metrics.generated_tokens.inc(len(result.token_ids))
            self.metrics.prompt_tokens.inc(result.prompt_tokens)
            self.metrics.finished.labels(result.finish_reason).inc()
            self.metrics.nfe.inc(result.nfe)
            self.metrics.tpf.observe(result.tpf)
            if not result.token_ids:
                self.metrics.empty.inc()
            r.emit("done", result)

        if r.decode.voting is None or by_stop:
            finish()
        else:
            self._voting.submit(finish)
