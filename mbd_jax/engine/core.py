"""Engine: the host side of serving a model. It plans, and its Runner (runner.py) runs.

`step()` is the one engine step every driver uses (generate, the service's scheduler): end the
rows asked to end, admit what fits, one prefill round, one decode call, an event per row
(rows.py: the one record per busy row). The engine validates requests, accounts the paged KV
pool (pages.py: a row holds pages for the positions it can write from admission to release),
plans prefill rounds (admission.py), glues the prefix cache in (prefix.py) and turns finished
rows into results (results.py); every device call goes through the Runner. Shapes are static
per engine: nothing compiles after `warmup()`. On several processes the service's engine calls
are mirrored (mirror.py); offline, every process runs the same calls (parallel/multihost.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Sequence

import jax
import numpy as np

from mbd_jax import compile_stats
from mbd_jax.cache.prefix_store import PrefixStore
from mbd_jax.config import DecodeConfig, ModelConfig
from mbd_jax.decoding import block_buffer
from mbd_jax.decoding.block_buffer import DecodeState
from mbd_jax.engine import admission, expert_paths, results
from mbd_jax.engine.admission import ROW_PREFILL_MIN, Admission, PrefillCall, prefill_buckets
from mbd_jax.engine.pages import PagePool, page_keys
from mbd_jax.engine.prefix import PrefixGlue, PrefixHit
from mbd_jax.engine.programs import prefix_programs
from mbd_jax.engine.results import GenerationResult
from mbd_jax.engine.rows import EngineRequest, Row, RowEvent, RowTable, StepOutcome
from mbd_jax.engine.runner import Runner
from mbd_jax.engine.stats import RECENT_CALLS, EngineStats
from mbd_jax.errors import UserError
from mbd_jax.model.cache import ModelCache
from mbd_jax.parallel import mesh as meshlib
from mbd_jax.parallel import multihost
from mbd_jax.tokenizer import Tokenizer


class Engine:
    def __init__(self, cfg: ModelConfig, params: Any, *, batch_size: int = 4, buffer_size: int = 1,
                 prefill_chunk: int = 256, steps_per_call: int = 64, debug: bool = False,
                 tokenizer: Tokenizer | None = None, record_steps: int = 0, record_len: int = 0,
                 prefix_store: PrefixStore | None = None, offload_blocks_per_call: int = 64,
                 mesh: jax.sharding.Mesh | None = None, row_prefill_min: int = ROW_PREFILL_MIN,
                 kv_pool_tokens: int | None = None, share_prefixes: bool = True,
                 split_experts: bool = True):
        """batch_size rows decode together; buffer_size is the compiled N_buf (requests may use
        less); with `debug`, every decode step checks the Block Buffer invariants and a broken
        one raises (slower: the check scans each row's canvas). With a tokenizer, results carry
        text. record_steps x record_len > 0 records each step's full prediction of the first
        record_len generated positions (the last record_steps steps), which voting needs.
        With a prefix store, admitted prompts reuse stored leading blocks and committed blocks
        are persisted after every decode call (double-buffered, cache/offload.py). `mesh`: the
        devices to run on (default: the first device). `row_prefill_min`: prefill chunks of at
        least this many tokens run one row at a time (ROW_PREFILL_MIN). `kv_pool_tokens`: the
        positions the KV pool holds over all rows (rounded up to whole pages; default: every
        row can hold a full context at once); a request waits until its pages are free.
        `share_prefixes`: a prompt whose leading pages match a prefilled prompt's maps those
        pages instead of prefilling them (pages.py; needs pages of whole blocks).
        `split_experts`: keep each routed expert's weights as arrays of their own while the
        all-rows program runs the looped path on one CPU device (model/layout.py's
        splits_experts; the engine's copies, so the caller's stacked ones are not needed); False
        keeps them stacked everywhere."""
        if prefill_chunk < cfg.block_size or prefill_chunk % cfg.block_size:
            raise UserError(f"prefill_chunk ({prefill_chunk}) must be a positive multiple of "
                            f"block_size ({cfg.block_size})")
        if batch_size < 1 or buffer_size < 1:
            raise UserError("batch_size and buffer_size must be >= 1")
        compile_stats.install()  # count this engine's compilations from the first one
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else meshlib.single_device_mesh()
        self.batch_size = batch_size
        self.buffer_size = buffer_size
        self.prefill_chunk = min(prefill_chunk, cfg.max_seq_len)
        self.steps_per_call = steps_per_call
        self.row_prefill_min = row_prefill_min
        self.debug = debug
        self.tokenizer = tokenizer
        self.record = (record_steps, record_len) if record_steps > 0 and record_len > 0 else (0, 0)
        # (seconds, decode steps) of the latest decode calls, for benches and metrics (stats())
        self._call_log: collections.deque[tuple[float, int]] = collections.deque(maxlen=RECENT_CALLS)
        self._decode_calls = 0
        window = buffer_size * cfg.block_size
        # The model's cache (its layout is the model's business: model/cache.py). A forward
        # writes at most one decode window or one prefill chunk, starting before max_seq_len.
        self.capacity = ModelCache.capacity_for(cfg, max(self.prefill_chunk, window))
        page = ModelCache.page_size(cfg)
        per_row = self.capacity // page
        n_pages = batch_size * per_row if kv_pool_tokens is None else -(-kv_pool_tokens // page)
        if n_pages < 1:
            raise UserError(f"kv_pool_tokens must be >= 1, got {kv_pool_tokens}")
        self.pages = PagePool(n_pages, page, batch_size, per_row)
        # A model with snapshot kinds (a recurrent state) also needs each row's state at the
        # shared boundary, which pages do not hold: its prompts prefill from their start.
        self.share_prefixes = (share_prefixes and page % cfg.block_size == 0
                               and ModelCache.snapshot_shape(cfg) is None)
        self.runner = Runner(cfg, params, self.mesh, batch_size=batch_size,
                             buffer_size=buffer_size, capacity=self.capacity, n_pages=n_pages,
                             debug=debug, split_experts=split_experts)
        self.runner.set_table(self.pages.table)
        self.moe_timings: dict[str, dict[str, float]] = {}  # measure: ms per step, per program
        self._host: tuple[DecodeState, DecodeState] | None = None  # (device, host): host_view
        self._done: tuple[DecodeState, np.ndarray] | None = None  # (device, host): done_rows
        # step(): one record per busy row, the running decode state, the admission in progress
        self.rows = RowTable(batch_size)
        self._state: DecodeState | None = None
        self._admission: Admission | None = None
        self.prefix_store = prefix_store
        self.prefix_hit_tokens = 0  # prompt tokens not prefilled: from the pool's pages or the store
        self.pool_hit_tokens = 0  # of those, the ones mapped from the pool's shared prefix pages
        self.prefill_seconds_per_token = 0.0  # measured in warmup (with a prefix store)
        self._prefix = None if prefix_store is None else PrefixGlue(
            prefix_store, cfg, self.kv.block_dtype,
            prefix_programs(cfg, self.mesh, batch_size, self.capacity, n_pages,
                            np.dtype(self.kv.block_dtype).name, offload_blocks_per_call),
            self.runner.put, batch_size, offload_blocks_per_call, self.prefill_chunk, self._bucket)
        self.offloader = None if self._prefix is None else self._prefix.offloader

    # the device side's state, read through the runner (tests and tools look at these)
    params = property(lambda self: self.runner.params)
    experts_split = property(lambda self: self.runner.experts_split)
    moe_paths = property(lambda self: self.runner.moe_paths)

    @property
    def kv(self) -> Any:
        return self.runner.kv

    @kv.setter
    def kv(self, value: Any) -> None:
        self.runner.kv = value

    def use_expert_paths(self, all_rows: str, one_row: str) -> None:
        self.runner.use_expert_paths(all_rows, one_row)

    # ---------------------------------------------------------------- validation
    def check_prompt(self, ids: Sequence[int], where: str = "prompt") -> None:
        cfg = self.cfg
        if len(ids) == 0:
            raise UserError(f"{where}: empty prompt; give at least one token")
        if len(ids) >= cfg.max_seq_len:
            raise UserError(f"{where}: {len(ids)} tokens leaves no room to generate; the model's "
                            f"max_seq_len is {cfg.max_seq_len} (prompt must be < {cfg.max_seq_len})")
        bad = [i for i in ids if not 0 <= i < cfg.vocab_size or i == cfg.mask_token_id]
        if bad:
            raise UserError(f"{where}: token id {bad[0]} is not allowed; ids must be in "
                            f"[0, {cfg.vocab_size}) and not the mask id {cfg.mask_token_id}")

    def check_fits(self, prompt: Sequence[int], d: DecodeConfig, where: str = "decoding") -> None:
        """A request that needs more KV pages than the whole pool can never run."""
        need = self.pages_needed(prompt, d)
        if need > self.pages.num_pages:
            page = self.pages.page
            raise UserError(f"{where}: {d.max_new_tokens} new tokens after a {len(prompt)}-token "
                            f"prompt need {need} KV pages of {page} positions; this engine's pool "
                            f"has {self.pages.num_pages} ({self.pages.num_pages * page} positions): "
                            "ask for fewer tokens or send a shorter prompt")

    def check_decode(self, d: DecodeConfig, where: str = "decoding") -> None:
        if d.buffer_size > self.buffer_size:
            raise UserError(f"{where}: buffer_size {d.buffer_size} exceeds this engine's "
                            f"{self.buffer_size}")
        if d.voting is not None and (self.record == (0, 0) or self.tokenizer is None):
            raise UserError(f"{where}: voting needs an engine that records trajectories and has a "
                            "tokenizer (record_steps, record_len, tokenizer)")

    # ---------------------------------------------------------------- KV pages
    def _positions_held(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        """Positions a request holds pages for while it runs: every one it can write (its prompt
        and new tokens up to the model's length, to the end of their block, plus one decode
        window of the engine's buffer). Nothing is allocated mid-decode."""
        blk = self.cfg.block_size
        limit = min(len(prompt) + d.max_new_tokens, self.cfg.max_seq_len)
        return -(-limit // blk) * blk + self.buffer_size * blk

    def pages_needed(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        """Pool pages a request holds while it runs (shared prefix pages included)."""
        return self.pages.pages_for(self._positions_held(prompt, d))

    def _prefix_pages(self, prompt: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """(the keys of the prompt's whole pages inside its full blocks, the leading ones
        found in the pool: a prefix hit)."""
        if not self.share_prefixes:
            return [], []
        blk = self.cfg.block_size
        keys = page_keys(prompt, self.pages.page, len(prompt) // blk * blk)
        return keys, self.pages.lookup(keys)

    def _first_page(self, prompt: Sequence[int]) -> bytes | None:
        """The key of the prompt's first page if it lies inside the prompt's full blocks (a page
        that can be shared), else None."""
        page, blk = self.pages.page, self.cfg.block_size
        if len(prompt) // blk * blk < page:
            return None
        return page_keys(prompt[:page], page, page)[0]

    def _admitted_later(self, prompts: Sequence[Sequence[int]],
                        indexed: Callable[[bytes], bool]) -> set[int]:
        if not self.share_prefixes:
            return set()
        return admission.admitted_later([self._first_page(p) for p in prompts], indexed)

    def _indexed(self, key: bytes) -> bool:
        return bool(self.pages.lookup([key]))

    def waits_for(self, prompt: Sequence[int], admitted: Sequence[Sequence[int]]) -> bool:
        """Whether `prompt` waits for the next admission rather than joining `admitted` (the
        prompts picked for this one): admission.admitted_later's rule."""
        return len(admitted) in self._admitted_later([*admitted, prompt], self._indexed)

    def pages_to_admit(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        """Free pages admitting this request takes now (what a shared prefix saves is not
        counted): the scheduler admits the queue's head while this is <= pages.free."""
        return self.pages.cost(self._positions_held(prompt, d), self._prefix_pages(prompt)[1])

    def _sync_table(self) -> None:
        """The device cache reads the host page table from the next use of `kv` on (after pages
        were taken or given back): one transfer however many changes came in between."""
        self.runner.set_table(self.pages.table)

    def release(self, rows: Sequence[int]) -> None:
        """Gives back the KV pages of finished rows (their results were read): the pool is
        what the running requests need. A released row's writes go nowhere until it is
        admitted again."""
        held = [int(row) for row in rows if self.pages.held[int(row)]]
        for row in held:
            self.pages.release(row)
        if held:
            self._sync_table()

    # ---------------------------------------------------------------- host -> device state
    def initial_state(self, prompts: list[np.ndarray], decodes: list[DecodeConfig],
                      done: np.ndarray | None = None) -> DecodeState:
        """The rows' fresh state on the device (`done`: rows that start free)."""
        host = block_buffer.initial_state(prompts, self.capacity, self.cfg.block_size,
                                          self.buffer_size, self.cfg.mask_token_id,
                                          admission.row_params(self.cfg, prompts, decodes),
                                          self.record,
                                          put=np.asarray)
        if done is not None:
            host = host.replace(done=done)
        return self.runner.put_rows(host)

    def _bucket(self, tokens: int) -> int:
        return admission.bucket(tokens, self.cfg.block_size, self.prefill_chunk)

    def _next_round(self, full_len: np.ndarray, start: np.ndarray, rows: np.ndarray
                    ) -> tuple[list[PrefillCall], np.ndarray]:
        return admission.next_round(full_len, start, rows, self._bucket, self.row_prefill_min)

    def _prefill_call(self, prompts: list[np.ndarray], full_len: np.ndarray, start: np.ndarray,
                      call: PrefillCall) -> None:
        """Writes the KV of prompt positions [start, start + T) of the call's rows."""
        if call.row is None:  # every cache row in order; the call's rows store
            rows, write = np.arange(self.batch_size), call.rows
        else:
            rows, write = np.array([call.row]), np.ones(1, bool)
        tokens = np.full((len(rows), call.tokens), self.cfg.pad_token_id, np.int32)
        for j, i in enumerate(rows):
            if write[j]:
                seg = prompts[i][start[i]: min(start[i] + call.tokens, full_len[i])]
                tokens[j, : len(seg)] = seg
        host = [tokens, start[rows].astype(np.int32), full_len[rows], write]
        if call.row is not None:  # the row table: input row 0 is this cache row
            host.append(rows.astype(np.int32))
        self.runner.prefill(host)

    # ---------------------------------------------------------------- reads
    def stats(self) -> EngineStats:
        """One snapshot of the engine's counters and pool (metrics, benchmarks, tools)."""
        pages = self.pages
        return EngineStats(
            rows=self.batch_size, kv_bytes=self.runner.nbytes(), page_size=pages.page,
            pages=pages.num_pages,
            pages_in_use=pages.in_use, pages_free=pages.free, pages_cached=pages.cached,
            pool_hit_tokens=self.pool_hit_tokens, prefix_hit_tokens=self.prefix_hit_tokens,
            prefill_seconds_per_token=self.prefill_seconds_per_token,
            decode_calls=self._decode_calls, recent_calls=tuple(self._call_log),
            store=None if self.prefix_store is None else dataclasses.replace(
                self.prefix_store.stats),
            offload=None if self.offloader is None else dataclasses.replace(
                self.offloader.stats))

    @property
    def prefix_cache(self) -> bool:
        """Whether prompts reuse blocks from a prefix store (and committed blocks go there)."""
        return self._prefix is not None

    def sync(self) -> None:
        """Waits until the device has run every call made so far."""
        self.runner.sync()

    def flush(self) -> None:
        """Persists every block staged for the prefix store now (waits for its disk writes)."""
        if self.offloader is not None:
            self.offloader.flush()

    def close(self) -> None:
        """Persists what is staged and stops the prefix store's threads (the engine's end)."""
        if self.offloader is not None:
            self.offloader.close()

    # ---------------------------------------------------------------- public API
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
        if len(self.rows):
            raise RuntimeError("generate needs an idle engine (its rows are busy)")
        self.release(range(self.batch_size))  # generate owns every row (the last call's too)
        requests = [EngineRequest(p, d, logprobs=True, stream=False, tag=i)
                    for i, (p, d) in enumerate(zip(prompts, decodes))]
        results: list[GenerationResult | None] = [None] * len(requests)
        s = 0
        while s < len(requests):  # as many as fit in the rows and the KV pool at once
            e, pages = s, 0
            while e < len(requests) and e - s < self.batch_size:
                cost = self.pages_to_admit(prompts[e], decodes[e])
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

    # ---------------------------------------------------------------- one step
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
        `touched` before anything can fail. Rows no request holds give their KV pages back
        first."""
        free = self.rows.free()
        self.release(free)
        budget = self.pages.free
        picked: dict[int, EngineRequest] = {}
        for request in candidates[: len(free)]:
            cost = self.pages_to_admit(request.prompt, request.decode)
            if cost > budget or self.waits_for(request.prompt, [r.prompt for r in picked.values()]):
                break  # (a shared first page: the next admission maps it, not prefills)
            budget -= cost
            picked[free[len(picked)]] = request
        for row, request in picked.items():  # busy from here: a failure fails them
            self.rows.add(row, Row(request))
            touched.add(row)
        out.admitted = list(picked.values())
        if picked:
            self._admission = self.begin_admit(
                {row: (r.prompt, r.decode) for row, r in picked.items()},
                prefetched={row: r.prefix for row, r in picked.items()})
            for row, request in picked.items():
                request.cached_tokens = int(self._admission.start[row])

    def _end_rows(self, out: StepOutcome) -> None:
        """Frees the decoding rows `end` asked for; a stopped one gets its finished event."""
        ending = [i for i in self.rows.decoding() if self.rows[i].ending]
        if not ending:
            return
        host = self.host_view(self._state, logprobs=any(
            self.rows[i].request.logprobs for i in ending))
        for i in ending:
            row = self.rows.pop(i)
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
                or self.done_rows(self._state)[decoding].any()):
            return  # nothing to tell: only `done` was fetched
        host = self.host_view(self._state, logprobs=any(
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
                self.rows.pop(i)
        self.release(finished)

    def _fail(self, error: Exception, touched: set[int], in_decode: bool,
              out: StepOutcome) -> None:
        """After a failed call: fails the requests it touched and frees their rows; when the
        device buffers went down with it, every row fails and they are allocated afresh."""
        lost = not self.buffers_intact(self._state)
        victims = {i for i, _ in self.rows.items()} if lost else touched
        out.failed = [self.rows.pop(i).request for i in sorted(victims) if i in self.rows]
        out.error, out.decode_failed = error, in_decode
        if self._admission is not None and set(np.flatnonzero(self._admission.rows)) & victims:
            self._admission = None
        if lost:
            self.reset_buffers()
        elif victims:
            self._state = self.cancel(self._running(), sorted(victims))
            self.release(sorted(victims))

    def went_idle(self) -> None:
        """No decode call follows for now: blocks staged for the prefix store go there now."""
        if self.offloader is not None:
            self.offloader.idle()

    def decode_call(self, state: DecodeState, max_steps: int | None = None) -> DecodeState:
        """One call of the jitted loop: up to max_steps decode steps (default steps_per_call),
        returning early when some row finishes (so a server can refill it). In debug mode a
        broken Block Buffer invariant raises here."""
        t = time.perf_counter()
        if self.offloader is not None:
            self.offloader.decode_issued()
        running = np.flatnonzero(~self.done_rows(state))
        alone = int(running[0]) if len(running) == 1 and self.batch_size > 1 else None
        state, steps = self.runner.decode(state, max_steps or self.steps_per_call, alone)
        self._call_log.append((time.perf_counter() - t, steps))
        self._decode_calls += 1
        if self.offloader is not None:  # stage what this call committed; drain the last call's
            host = self.host_view(state)
            self.offloader.after_commit(self.kv, host.cached_len, host.canvas, host.done)
        if self.debug:
            violations = jax.device_get(state.violations)
            if np.any(violations):
                raise RuntimeError(f"Block Buffer invariant broken in rows "
                                   f"{np.nonzero(violations)[0].tolist()} (debug mode)")
        return state

    def host_view(self, state: DecodeState, logprobs: bool = False) -> DecodeState:
        """`state` on the host, without the voting trajectories, and without the log-probabilities
        unless asked; fetched once per decode call however many readers (the offloader, the
        scheduler's streaming) ask."""
        if self._host is None or self._host[0] is not state or (
                logprobs and self._host[1].logprob is None):
            self._host = (state, self.runner.fetch_rows(self._host_tree(state, logprobs)))
        return self._host[1]

    @staticmethod
    def _host_tree(state: DecodeState, logprobs: bool) -> DecodeState:
        """What host_view fetches: no voting trajectories, log-probabilities only if asked."""
        return state.replace(trajectory=None, logprob=state.logprob if logprobs else None)

    def done_rows(self, state: DecodeState) -> np.ndarray:
        """state.done on the host ([B] bool), fetched once per state: host_view's copy when it
        has one (the scheduler and the offloader fetch it after every call)."""
        if self._host is not None and self._host[0] is state:
            return np.asarray(self._host[1].done)
        if self._done is None or self._done[0] is not state:
            self._done = (state, np.asarray(jax.device_get(state.done)))
        return self._done[1]

    def run_decode(self, state: DecodeState, max_calls: int | None = None) -> DecodeState:
        """Decode calls until every row is done (or max_calls calls ran)."""
        calls = 0
        while not np.all(self.done_rows(state)) and (max_calls is None or calls < max_calls):
            state = self.decode_call(state)
            calls += 1
        return state

    def results(self, state: DecodeState, n: int, seconds: float,
                decodes: Sequence[DecodeConfig] | None = None) -> list[GenerationResult]:
        """Results of rows 0..n-1 of a finished state."""
        host = self.runner.fetch_rows(state)
        return [self.result_of(host, i, seconds, None if decodes is None else decodes[i])
                for i in range(n)]

    def output_ids(self, host: DecodeState, row: int, end: int | None = None) -> list[int]:
        """Row's generated tokens from host arrays (results.output_ids)."""
        return results.output_ids(self.cfg, host, row, end)

    def result_of(self, host: DecodeState, i: int, seconds: float,
                  decode: DecodeConfig | None = None) -> GenerationResult:
        """The result of finished row i, from host arrays (results.result_of)."""
        return results.result_of(self.cfg, self.tokenizer, host, i, seconds, decode)

    # ---------------------------------------------------------------- continuous batching
    def _blank_rows(self) -> tuple[list[np.ndarray], list[DecodeConfig]]:
        """Placeholder prompt and decode config of a free row."""
        b = self.batch_size
        return [np.array([self.cfg.pad_token_id], np.int32)] * b, [DecodeConfig()] * b

    def empty_state(self) -> DecodeState:
        """A state whose rows are all free (done)."""
        return self.initial_state(*self._blank_rows(), done=np.ones(self.batch_size, bool))

    def prefetch(self, prompt: Sequence[int]) -> PrefixHit | None:
        """Looks a prompt's full blocks past the pages the pool maps up in the prefix store and
        starts their transfer to the device (the scheduler calls this for queued requests, so the
        copy overlaps their wait; admission looks again if the pool changed meanwhile, and counts
        the lookup it uses). None without a store."""
        if self._prefix is None:
            return None
        pool_hit = len(self._prefix_pages(prompt)[1]) * self.pages.page  # the store's start
        return self._prefix.prefetch(prompt, after=pool_hit)

    def begin_admit(self, requests: dict[int, tuple[Sequence[int], DecodeConfig]],
                    prefetched: dict[int, PrefixHit | None] | None = None) -> Admission:
        """Starts admitting requests into free rows {row: (prompt ids, decode)}: validates them and
        builds their fresh state; prompt blocks found in the prefix store (`prefetched` per row, or
        looked up now) are copied into the row. Then `prefill_step` until it returns True, then
        `finish_admit`. Decode calls may run between the steps: the other rows keep their state
        and KV."""
        rows = np.zeros(self.batch_size, bool)
        prompts, decodes = self._blank_rows()
        for row, (prompt, decode) in requests.items():
            self.check_prompt(prompt)
            self.check_decode(decode)
            self.check_fits(prompt, decode)
            rows[row], prompts[row], decodes[row] = True, np.asarray(prompt, np.int32), decode
        for row in requests:  # the rows' old pages back first, then every row's new ones
            self.pages.release(row)
        if sum(self.pages_to_admit(prompts[r], decodes[r]) for r in requests) > self.pages.free:
            raise RuntimeError("KV pool: admitted requests need more pages than are free (the "
                               "caller checks pages_to_admit against pages.free)")
        start = np.zeros(self.batch_size, np.int32)
        keys = {}
        for row in requests:  # a prefix in the pool is mapped, not prefilled
            keys[row], hit = self._prefix_pages(prompts[row])
            self.pages.reserve(row, self._positions_held(prompts[row], decodes[row]), shared=hit)
            start[row] = len(hit) * self.pages.page
        self.pool_hit_tokens += int(start.sum())
        self._sync_table()
        if self._prefix is not None:
            for row in requests:  # the store serves what the pool missed, after its pages
                self.kv, start[row] = self._prefix.load(self.kv, row, prompts[row],
                                                        (prefetched or {}).get(row),
                                                        after=int(start[row]))
        self.prefix_hit_tokens += int(start.sum())
        full_len = admission.full_blocks(prompts, rows, self.cfg.block_size)
        return Admission(rows=rows, prompts=prompts, full_len=full_len,
                         fresh=self.initial_state(prompts, decodes, done=~rows), start=start,
                         keys=keys)

    def _index_prompts(self, adm: Admission) -> None:
        """The admitted prompts are prefilled: their whole pages join the pool's prefix index."""
        for row, keys in adm.keys.items():
            self.pages.register(row, keys)

    def _stage_prefilled(self, adm: Admission) -> None:
        """Rows of a model with snapshot kinds after a prefill round: the prompt blocks written
        so far go to the prefix store with a snapshot of the state after them. A row's state exists only at its
        committed end, so this is where prompts get snapshots: one per round (every
        prefill_chunk tokens of a long prompt, and the prompt's last full block), before the
        first decode call commits past them."""
        admitted = np.flatnonzero(adm.rows)
        canvas = np.zeros((self.batch_size, max(len(adm.prompts[r]) for r in admitted)), np.int32)
        for r in admitted:
            canvas[r, : len(adm.prompts[r])] = adm.prompts[r]
        self.offloader.after_commit(self.kv, np.where(adm.rows, adm.start, 0), canvas,
                                    prefill=True)

    def prefill_step(self, adm: Admission) -> bool:
        """The next prefill chunk of every admitted row with prompt blocks left; True once all
        its prompt blocks are written."""
        calls, after = self._next_round(adm.full_len, adm.start, adm.rows)
        for call in calls:
            self._prefill_call(adm.prompts, adm.full_len, adm.start, call)
        adm.start = after
        if calls and self.offloader is not None and self._prefix.snapshots:
            self._stage_prefilled(adm)
        return adm.prefilled

    def finish_admit(self, state: DecodeState, adm: Admission) -> DecodeState:
        """Merges the admitted rows' fresh state into the running state (one compiled program)."""
        self._index_prompts(adm)
        return self.runner.merge(state, adm.fresh, adm.rows)

    def admit(self, state: DecodeState | None,
              requests: dict[int, tuple[Sequence[int], DecodeConfig]]) -> DecodeState:
        """Starts requests in free rows at once (begin_admit, every prefill step, finish_admit).
        `state` None: no row is running, so the admission's own state (its other rows free) is
        the new state, with no empty state to build and merge into."""
        adm = self.begin_admit(requests)
        while not self.prefill_step(adm):
            pass
        if state is None:
            self._index_prompts(adm)
            return adm.fresh
        return self.finish_admit(state, adm)

    def buffers_intact(self, state: DecodeState | None) -> bool:
        """Whether the KV pool and `state` still hold their device memory (a call that failed
        after taking its donated buffers leaves them deleted)."""
        return self.runner.buffers_intact(state)

    def reset_buffers(self) -> None:
        """A fresh, empty KV pool and page accounting (after a failure lost the old pool); every
        row is free and no prefix page is cached."""
        pool = self.pages  # a fresh pool: the old one's prefix pages are gone with the buffer
        self.pages = PagePool(pool.num_pages, pool.page, self.batch_size, pool.pages_per_row)
        self.runner.reset(self.pages.table)
        self._host = self._done = None
        self.rows = RowTable(self.batch_size)
        self._state = self._admission = None
        if self.offloader is not None:
            for row in range(self.batch_size):
                self.offloader.reset_row(row, 0)

    def cancel(self, state: DecodeState, rows: Sequence[int]) -> DecodeState:
        """Frees rows (a client went away): they stop at the next step."""
        done = self.done_rows(state).copy()
        done[list(rows)] = True
        return state.replace(done=self.runner.put(done))

    def prefill_buckets_for(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """The prefill lengths `generate(prompts)` compiles (batch_size rows at a time, prefix
        pages shared as generate shares them, no prefix store hits, a pool large enough for each
        batch): what a one-shot command needs warm, where the service needs every bucket."""
        used, indexed, blk, page = set(), set(), self.cfg.block_size, self.pages.page

        def prefill(batch: list[np.ndarray]) -> None:  # the calls prefill_step makes
            rows = np.ones(len(batch), bool)
            full = admission.full_blocks(batch, rows, blk)
            start = np.zeros(len(batch), np.int32)
            for i, p in enumerate(batch):
                keys = page_keys(p, page, int(full[i])) if self.share_prefixes else []
                while start[i] // page < len(keys) and keys[start[i] // page] in indexed:
                    start[i] += page
            while (full > start).any():
                calls, start = self._next_round(full, start, rows)
                used.update(call.tokens for call in calls)
            for p in batch:
                if self.share_prefixes:
                    indexed.update(page_keys(p, page, len(p) // blk * blk))

        for s in range(0, len(prompts), self.batch_size):
            batch = [np.asarray(p) for p in prompts[s: s + self.batch_size]]
            later = self._admitted_later(batch, indexed.__contains__)  # as generate splits it
            prefill([p for i, p in enumerate(batch) if i not in later])
            if later:
                prefill([batch[i] for i in sorted(later)])
        return sorted(used)

    def _choose_expert_paths(self, say: Callable[[str], None]) -> None:
        """Runs each decode program on its fastest expert path (engine/expert_paths.py); the
        timing rows' blocks are not persisted."""
        decode = expert_paths.timing_decode(self.cfg, self.buffer_size)
        prompt = np.array([self.cfg.pad_token_id], np.int32)

        def time_calls(impl: str, rows: int) -> list[float]:
            self.use_expert_paths(impl, impl)
            state = self.admit(self.empty_state(), dict.fromkeys(range(rows), (prompt, decode)))
            state = self.decode_call(state, expert_paths.STEPS)  # compiles
            seconds = []
            for _ in range(expert_paths.CALLS):
                t = time.perf_counter()
                state = self.decode_call(state, expert_paths.STEPS)  # returns once they ran
                seconds.append(time.perf_counter() - t)
            self.release(range(rows))
            return seconds

        offloader, self.offloader = self.offloader, None
        try:
            best, self.moe_timings = expert_paths.choose(self.batch_size, time_calls, say)
        finally:
            self.offloader = offloader
        self.use_expert_paths(best["all rows"], best.get("one row", best["all rows"]))

    def _warm_call(self, t: int, rows: np.ndarray) -> PrefillCall:
        """The call a `t`-token chunk makes (its program): row 0 alone, or the shared one."""
        alone = admission.runs_alone(t, self.row_prefill_min)
        return PrefillCall(t, row=0) if alone else PrefillCall(t, rows=rows)

    def warmup(self, progress: Callable[[str], None] | None = None,
               buckets: Sequence[int] | None = None) -> None:
        """Compiles every program this engine can run (all prefill buckets, or only `buckets`,
        the row merge and the decode loop); `progress` hears about each step (compiling takes a
        while)."""
        say = progress or (lambda message: None)
        t_start = time.perf_counter()
        blk = self.cfg.block_size
        b = self.batch_size
        zeros_b = np.zeros(b, np.int32)
        if self.cfg.moe_impl == "measure" and self.cfg.num_experts > 0:
            self._choose_expert_paths(say)  # before the prefill buckets: they follow its choice
        buckets = prefill_buckets(blk, self.prefill_chunk) if buckets is None else list(buckets)
        for i, t in enumerate(buckets):
            say(f"compiling prefill of {t} tokens ({i + 1}/{len(buckets)})")
            self._prefill_call(self._blank_rows()[0], zeros_b, zeros_b,
                               self._warm_call(t, np.zeros(b, bool)))  # pads, no request yet
            if self._prefix is not None:  # loading t cached tokens into a row
                self.kv = self._prefix.warm_load(self.kv, t)
        if self.offloader is not None:
            self.offloader.warmup(self.kv)
            # what a prefill token costs, for the "time saved" metric: the largest bucket, all rows
            t0 = time.perf_counter()
            call = self._warm_call(self.prefill_chunk, np.ones(b, bool))
            self._prefill_call(self._blank_rows()[0], zeros_b, zeros_b, call)
            jax.block_until_ready(self.kv)
            rows = 1 if call.row is not None else b
            self.prefill_seconds_per_token = (time.perf_counter() - t0) / (rows * self.prefill_chunk)
        say(f"compiling the decode loop ({b} rows, N_buf {self.buffer_size})")
        prompt = np.array([self.cfg.pad_token_id], np.int32)
        one = (prompt, DecodeConfig(max_new_tokens=1))
        for rows in sorted({1, min(2, b)}):  # one running row alone, and all rows
            state = self.admit(self.empty_state(), dict.fromkeys(range(rows), one))
            state = self.decode_call(state, 1)
            self.release(range(rows))
        # the host views a decode call's readers fetch (with and without the log-probabilities),
        # and the whole state that results() fetches: each a packing program (transfer.py)
        for tree in (self._host_tree(state, True), self._host_tree(state, False), state):
            self.runner.fetch_rows(tree)
        jax.block_until_ready(self.kv)
        say(f"warm-up done in {time.perf_counter() - t_start:.1f} s")
