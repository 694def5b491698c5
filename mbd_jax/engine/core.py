"""Engine: the host side of serving a model. It plans, and its Runner (runner.py) runs.

`step()` is the one engine step every driver uses (generate, the service's scheduler): end the
rows asked to end, admit what fits, one prefill round, one decode call, an event per row
(rows.py: the one record per busy row). Its parts live in batch.py (admission into rows with
their KV pages and prefix hits, decode calls, host views, results); what a request asks of the
KV pool in page_plan.py, what the engine accepts in checks.py, the warm-up in warmup.py. Shapes
are static per engine: nothing compiles after `warmup()`. On several processes the service's
engine calls are mirrored (mirror.py); offline, every process runs the same calls
(parallel/multihost.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Sequence

import jax
import numpy as np

from mbd_jax.config import DecodeConfig, ModelConfig
from mbd_jax.decoding.block_buffer import DecodeState
from mbd_jax.engine import warmup
from mbd_jax.engine.admission import Admission
from mbd_jax.engine.batch import Batch
from mbd_jax.engine.results import GenerationResult
from mbd_jax.engine.rows import EngineRequest, Row, RowEvent, StepOutcome
from mbd_jax.errors import UserError
from mbd_jax.parallel import multihost


class Engine(Batch):
    def __init__(self, cfg: ModelConfig, params: Any, **options: Any):
        """`options`: Batch's (batch.py: rows, buffer, prefill chunk, KV pool, prefix store,
        mesh, ...)."""
        super().__init__(cfg, params, **options)
        self._state: DecodeState | None = None  # the running rows' decode state
        self._admission: Admission | None = None  # the admission in progress

    def warmup(self, progress: Callable[[str], None] | None = None,
               buckets: Sequence[int] | None = None, background: bool = False) -> None:
        """Compiles every program this engine can run, the larger prefill buckets on a thread
        with `background` (warmup.py)."""
        warmup.warmup(self, progress, buckets, background)

    def prefill_buckets_for(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """The prefill lengths `generate(prompts)` compiles (warmup.py)."""
        return warmup.prefill_buckets_for(self, prompts)

    def generate(self, prompts: Sequence[Sequence[int]],
                 decode: DecodeConfig | Sequence[DecodeConfig] = DecodeConfig()) -> list[GenerationResult]:
        """Generates for every prompt (token ids): as many at a time as fit in the rows and the
        KV pool, each such batch stepped (step()) until it is done. On several processes,
        process 0's prompts and decode configs are used by all (multihost.share). A result's
        `seconds` is its batch's time to it."""
        decodes = list(decode) if isinstance(decode, (list, tuple)) else [decode] * len(prompts)
        prompts, decodes = multihost.share((list(prompts), decodes))
        if len(decodes) != len(prompts):
            raise UserError(f"got {len(prompts)} prompts but {len(decodes)} decode configs")
        for i, (p, d) in enumerate(zip(prompts, decodes)):
            self.check_prompt(p, where=f"prompt[{i}]")
            self.check_decode(d, where=f"decoding[{i}]")
            self.check_fits(p, d, where=f"decoding[{i}]")
        if self._admission is not None or (self._state is not None
                                           and not self.done_rows(self._state).all()):
            raise RuntimeError("generate needs an idle engine (its steps are running rows)")
        self.release(range(self.batch_size))  # generate owns every row (rows admitted one call
        # at a time, admit / decode_call, are the caller's: theirs end here)
        requests = [EngineRequest(p, d, logprobs=True, stream=False, tag=i)
                    for i, (p, d) in enumerate(zip(prompts, decodes))]
        results: list[GenerationResult | None] = [None] * len(requests)
        s = 0
        while s < len(requests):  # as many as fit in the rows and the KV pool at once
            e, pages = s, 0
            while e < len(requests) and e - s < self.batch_size:
                cost = self.plan.pages_to_admit(prompts[e], decodes[e])
                if pages + cost > self.pages.free:
                    break
                pages, e = pages + cost, e + 1
            t0 = time.perf_counter()
            waiting = requests[s: e]
            while waiting or len(self.rows):
                out = self.step(waiting)
                if out.error is not None:
                    raise out.error
                waiting = [r for r in waiting if r not in out.admitted]
                for event in out.events:
                    if event.finished:
                        results[event.request.tag] = event.result(time.perf_counter() - t0)
            s = e
        self.went_idle()
        return results

    def step(self, candidates: Sequence[EngineRequest] = (),
             max_steps: int | None = None) -> StepOutcome:
        """One engine step: end the rows `end` asked for -> admit the longest prefix of
        `candidates` that fits (free rows, KV pages, the shared-prefix rule; only when no
        admission is in progress) -> one prefill round of the admission in progress -> one
        decode call over the decoding rows (max_steps, default steps_per_call) -> an event per
        row that committed tokens or finished. A failure fails the requests it touched (every
        row when the device buffers went down with it, which are then allocated afresh) and is
        reported in the outcome; the engine goes on."""
        out, touched, in_decode = StepOutcome(), set(), False
        try:
            self._end_rows(out)
            if self._admission is None and candidates:
                self._admit(candidates, out, touched)
            if self._admission is not None:
                touched = set(self.rows.prefilling())
                if self.prefill_step(self._admission):
                    self._state = self._merged(self._admission)
                    for row in touched:
                        self.rows[row].prefilling = False
                    self._admission = None
            if self.rows.decoding():
                touched, in_decode = {i for i, _ in self.rows.items()}, True
                self._state = self.decode_call(self._running(), max_steps)
                self._publish(out)
                out.decoded = True
        except Exception as e:  # noqa: BLE001 - reported, and the engine goes on
            self._fail(e, touched, in_decode, out)
        return out

    def end(self, request: EngineRequest, how: str = "cancel") -> None:
        """Ends a running request at the next step: "cancel" frees its row with no event (a
        client went away, a deadline passed), "stop" finishes it with the tokens its events
        handed out (a stop string ended its text). A request still prefilling ends once its
        admission is done."""
        if how not in ("cancel", "stop"):
            raise ValueError(f"end(how={how!r}): expected 'cancel' or 'stop'")
        index = self.rows.find(request)
        if index is not None:
            self.rows[index].ending = how

    def _merged(self, adm: Admission) -> DecodeState:
        """The running state with a finished admission's rows in: its own state when no other
        row is busy (nothing to merge), else merged (finish_admit)."""
        if len(self.rows) == int(adm.rows.sum()):
            self._index_prompts(adm)
            return adm.fresh
        return self.finish_admit(self._running(), adm)

    def _running(self) -> DecodeState:
        if self._state is None:
            self._state = self.empty_state()
        return self._state

    def _admit(self, candidates: Sequence[EngineRequest], out: StepOutcome,
               touched: set[int]) -> None:
        """Starts the admission of the longest prefix of `candidates` that fits; its rows join
        `touched` before anything can fail."""
        free = self.rows.free()
        budget = self.pages.free
        picked: dict[int, EngineRequest] = {}
        for request in candidates[: len(free)]:
            cost = self.plan.pages_to_admit(request.prompt, request.decode)
            if cost > budget or self.plan.waits_for(request.prompt, [r.prompt for r in picked.values()]):
                break  # (a shared first page: the next admission maps it, not prefills)
            budget -= cost
            picked[free[len(picked)]] = request
        touched.update(picked)  # busy from here: a failure fails them
        out.admitted = list(picked.values())
        if picked:
            self._admission = self.begin_admit(picked)

    def _end_rows(self, out: StepOutcome) -> None:
        """Frees the decoding rows `end` asked for; a stopped one gets its finished event."""
        ending = [i for i in self.rows.decoding() if self.rows[i].ending]
        if not ending:
            return
        host = self.views.view(self._state, logprobs=any(
            self.rows[i].request.logprobs for i in ending))
        for i in ending:
            row = self.rows[i]
            if row.ending == "stop":
                out.events.append(RowEvent(row.request, [], None, finished=True,
                                           result=functools.partial(self._stopped, host, i, row)))
        self._state = self.cancel(self._state, ending)
        self.release(ending)

    def _stopped(self, host: DecodeState, i: int, row: Row, seconds: float) -> GenerationResult:
        """The result of a row a stop string ended: the tokens its events handed out."""
        p0 = int(host.prompt_len[i])
        result = self.result_of(host, i, seconds)
        lps = host.logprob[i, p0: p0 + row.emitted].tolist() if row.request.logprobs else None
        return dataclasses.replace(result, token_ids=host.canvas[i, p0: p0 + row.emitted].tolist(),
                                   finish_reason="stop", logprobs=lps)

    def _publish(self, out: StepOutcome) -> None:
        """An event per decoding row with new committed tokens or a finish; finished rows are
        freed (their pages given back)."""
        blk = self.cfg.block_size
        decoding = self.rows.decoding()
        if not (any(self.rows[i].request.stream for i in decoding)
                or self.views.done(self._state)[decoding].any()):
            return  # nothing to tell: only `done` was fetched
        host = self.views.view(self._state, logprobs=any(
            r.request.logprobs for _, r in self.rows.items()))
        if any(host.done[i] and r.request.decode.voting is not None
               for i, r in self.rows.items() if not r.prefilling):
            host = host.replace(trajectory=jax.device_get(self._state.trajectory))
        finished = []
        for i in decoding:
            row = self.rows[i]
            p0, done = int(host.prompt_len[i]), bool(host.done[i])
            if done:
                new = self.output_ids(host, i)[row.emitted:]
            else:  # committed or final (TO_CACHE) blocks never change
                end = int(host.cached_len[i]) + int(host.n_to_cache[i]) * blk
                new = host.canvas[i, p0 + row.emitted: max(end, p0)].tolist()
            lps = None
            if row.request.logprobs:
                lps = host.logprob[i, p0 + row.emitted: p0 + row.emitted + len(new)].tolist()
            row.emitted += len(new)
            if new or done:
                out.events.append(RowEvent(row.request, new, lps, finished=done))
            if done:
                out.events[-1].result = functools.partial(self.result_of, host, i,
                                                          decode=row.request.decode)
                finished.append(i)
        self.release(finished)

    def _fail(self, error: Exception, touched: set[int], in_decode: bool,
              out: StepOutcome) -> None:
        """After a failed call: fails the requests it touched and frees their rows; when the
        device buffers went down with it, every row fails and they are allocated afresh."""
        lost = not self.buffers_intact(self._state)
        victims = {i for i, _ in self.rows.items()} if lost else touched
        out.failed = [self.rows[i].request for i in sorted(victims) if i in self.rows]
        # requests this step admitted whose admission failed before their rows had records
        out.failed += [r for r in out.admitted if self.rows.find(r) is None and r not in out.failed]
        out.error, out.decode_failed = error, in_decode
        if self._admission is not None and set(np.flatnonzero(self._admission.rows)) & victims:
            self._admission = None
        if lost:
            self.reset_buffers()
        elif victims:
            self._state = self.cancel(self._running(), sorted(victims))
            self.release(sorted(victims))

    def reset_buffers(self) -> None:
        """Fresh device buffers and pool (batch.py); every row is free."""
        super().reset_buffers()
        self._state = self._admission = None
