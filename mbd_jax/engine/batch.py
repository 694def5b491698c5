"""The step's parts: an engine's rows on the device and the calls over them. Admission into free
rows (KV pages and shared prefix pages, prefix-store hits, prefill rounds, the merge into the
running state), decode calls, cancelling and releasing rows, host views and results. `Engine`
(core.py) builds its one `step()` from these; warm-up (warmup.py), tools and tests call them one
by one. Every device call goes through the Runner (runner.py).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mbd_jax import compile_stats
from mbd_jax.cache.offload import OffloadProgress
from mbd_jax.cache.prefix_store import PrefixStore
from mbd_jax.config import DecodeConfig, ModelConfig
from mbd_jax.decoding import block_buffer, indel
from mbd_jax.decoding.block_buffer import DecodeState
from mbd_jax.engine import admission, checks, results
from mbd_jax.engine.admission import ROW_PREFILL_MIN, Admission, PrefillCall
from mbd_jax.engine.host_view import HostViews
from mbd_jax.engine.page_plan import PagePlan, pool_size
from mbd_jax.engine.pages import PagePool, page_table
from mbd_jax.engine.prefix import PrefixGlue, PrefixHit
from mbd_jax.engine.programs import prefix_programs
from mbd_jax.engine.results import GenerationResult
from mbd_jax.engine.rows import EngineRequest, Row, RowTable
from mbd_jax.engine.runner import Runner
from mbd_jax.engine.stats import RECENT_CALLS, EngineStats
from mbd_jax.errors import UserError
from mbd_jax.grammar.compile import Grammars
from mbd_jax.grammar.row import RowGrammar
from mbd_jax.model.cache import ModelCache
from mbd_jax.parallel import mesh as meshlib
from mbd_jax.tokenizer import Tokenizer


class Batch:
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
        if batch_size < 1 or buffer_size < 1:
            raise UserError("batch_size and buffer_size must be >= 1")
        compile_stats.install()  # count this engine's compilations from the first one
        self.mesh = mesh if mesh is not None else meshlib.single_device_mesh()
        # every platform choice (expert path, layer loop, delta-rule chunks) from the mesh's
        # devices, not from the host's default backend
        self.cfg = cfg = dataclasses.replace(cfg, platform=meshlib.platform(self.mesh))
        self.batch_size = batch_size
        self.buffer_size = buffer_size
        self.steps_per_call = steps_per_call
        self.row_prefill_min = row_prefill_min
        self.debug = debug
        self.tokenizer = tokenizer
        # structured output: grammars compiled against the tokenizer (grammar/compile.py)
        self.grammars = Grammars(tokenizer, cfg.vocab_size, cfg.eos_token_ids, cfg.mask_token_id)
        self.record = (record_steps, record_len) if record_steps > 0 and record_len > 0 else (0, 0)
        # (seconds, decode steps) of the latest decode calls, for benches and metrics (stats())
        self._call_log: collections.deque[tuple[float, int]] = collections.deque(maxlen=RECENT_CALLS)
        self._decode_calls = 0
        self._decode_seconds = 0.0  # inside decode calls (each waits for the device)
        self._grammar_calls, self._grammar_seconds = 0, 0.0  # constrained rows' host steps
        # The model's cache (its layout is the model's business: model/cache.py) in a pool of
        # pages (page_plan.pool_size).
        size = pool_size(cfg, batch_size, buffer_size, prefill_chunk, kv_pool_tokens)
        self.prefill_chunk, self.capacity = size.prefill_chunk, size.capacity
        # The longest prefill bucket compiled so far: prompts are cut into chunks of at most
        # this many tokens. A service ready before its larger buckets compile (warmup.py's
        # `background`) raises it as they land; it only grows.
        self.prefill_ready = self.prefill_chunk
        self.background = None  # the warm-up's BackgroundBuckets, while they compile
        page, n_pages = size.page, size.pages
        self.pages = PagePool(n_pages, page, self.capacity // page)
        self.rows = RowTable(batch_size)  # one record per busy row: all the host knows of it
        # A model with snapshot kinds (a recurrent state) also needs each row's state at the
        # shared boundary, which pages do not hold: its prompts prefill from their start.
        self.plan = PagePlan(self.pages, cfg, buffer_size,
                             share_prefixes=share_prefixes and page % cfg.block_size == 0
                             and ModelCache.snapshot_shape(cfg) is None)
        self.runner = Runner(cfg, params, self.mesh, batch_size=batch_size,
                             buffer_size=buffer_size, capacity=self.capacity, n_pages=n_pages,
                             debug=debug, split_experts=split_experts)
        self.runner.set_table(self._page_table())
        self.moe_timings: dict[str, dict[str, float]] = {}  # measure: ms per step, per program
        self.views = HostViews(self.runner.fetch_rows)  # the decode state on the host
        self.prefix_store = prefix_store
        self.prefix_hit_tokens = 0  # prompt tokens not prefilled: from the pool's pages or the store
        self.pool_hit_tokens = 0  # of those, the ones mapped from the pool's shared prefix pages
        self.prefill_seconds_per_token = 0.0  # measured in warmup (with a prefix store)
        self.prefix = None if prefix_store is None else PrefixGlue(
            prefix_store, cfg, self.kv.block_dtype,
            prefix_programs(cfg, self.mesh, batch_size, self.capacity, n_pages,
                            np.dtype(self.kv.block_dtype).name, offload_blocks_per_call),
            self.runner.put, offload_blocks_per_call, self._bucket)
        self.offloader = None if self.prefix is None else self.prefix.offloader

    @property
    def kv(self) -> Any:
        return self.runner.kv

    @kv.setter
    def kv(self, value: Any) -> None:
        self.runner.kv = value

    # the device side's state, read through the runner (tests and tools look at these)
    params = property(lambda self: self.runner.params)
    experts_split = property(lambda self: self.runner.experts_split)
    moe_paths = property(lambda self: self.runner.moe_paths)

    def use_expert_paths(self, all_rows: str, one_row: str) -> None:
        self.runner.use_expert_paths(all_rows, one_row)

    # ---------------------------------------------------------------- checks
    def check_prompt(self, ids: Sequence[int], where: str = "prompt") -> None:
        checks.check_prompt(self.cfg, ids, where)

    @property
    def can_vote(self) -> bool:
        """Whether requests may ask for voting: the engine records trajectories, has a tokenizer."""
        return self.record != (0, 0) and self.tokenizer is not None

    def check_decode(self, d: DecodeConfig, where: str = "decoding") -> None:
        checks.check_decode(self.cfg, d, self.buffer_size, self.can_vote, where)
        if d.structure is not None:  # compiled now (kept for the admission), or refused
            self.grammars.check(d.structure, f"{where}.structure.source")

    def check_fits(self, prompt: Sequence[int], d: DecodeConfig, where: str = "decoding") -> None:
        self.plan.check_fits(prompt, d, where)

    def pages_needed(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        return self.plan.pages_needed(prompt, d)

    def pages_to_admit(self, prompt: Sequence[int], d: DecodeConfig) -> int:
        return self.plan.pages_to_admit(prompt, d)

    # ---------------------------------------------------------------- admission
    def prefetch(self, prompt: Sequence[int]) -> PrefixHit | None:
        """Looks a prompt's full blocks past the pages the pool maps up in the prefix store and
        starts their transfer to the device (the scheduler calls this for queued requests, so the
        copy overlaps their wait; admission looks again if the pool changed meanwhile, and counts
        the lookup it uses). None without a store."""
        if self.prefix is None:
            return None
        pool_hit = len(self.plan.prefix_pages(prompt)[1]) * self.pages.page  # the store's start
        return self.prefix.prefetch(prompt, after=pool_hit)

    def begin_admit(self, requests: dict[int, EngineRequest | tuple[Sequence[int], DecodeConfig]]
                    ) -> Admission:
        """Starts admitting requests into rows {row: request, or (prompt ids, decode)}: validates
        them, gives each row its record (a busy row's old one is released first) with its KV
        pages, mapping a prompt prefix the pool holds instead of prefilling it, copies prompt
        blocks found in the prefix store into the row (a request's prefetched hit, or looked up
        now), and builds their fresh state. Then `prefill_step` until it returns True, then
        `finish_admit`. Decode calls may run between the steps: the other rows keep their state
        and KV."""
        requests = {row: r if isinstance(r, EngineRequest) else EngineRequest(*r)
                    for row, r in requests.items()}
        for r in requests.values():
            self.check_prompt(r.prompt)
            self.check_decode(r.decode)
            self.check_fits(r.prompt, r.decode)
        self.release([row for row in requests if row in self.rows])
        if sum(self.plan.pages_to_admit(r.prompt, r.decode) for r in requests.values()) > self.pages.free:
            raise RuntimeError("KV pool: admitted requests need more pages than are free (the "
                               "caller checks pages_to_admit against pages.free)")
        try:
            return self._admit_rows(requests)
        except BaseException:  # nothing half-admitted stays: the rows are free again
            self.release(list(requests))
            raise

    def _admit_rows(self, requests: dict[int, EngineRequest]) -> Admission:
        """begin_admit's work once the requests were checked."""
        admitted = np.zeros(self.batch_size, bool)
        prompts, decodes = self.blank_rows()
        for index, request in requests.items():
            row = Row(request)
            self.rows.add(index, row)
            prompt = row.prompt
            row.page_keys, hit = self.plan.prefix_pages(prompt)
            row.pages = self.pages.reserve(self.plan.positions_held(prompt, request.decode),
                                           shared=hit)
            row.prefilled = len(hit) * self.pages.page
            row.prefill_end = len(prompt) // self.cfg.block_size * self.cfg.block_size
            row.grammar = self.grammars.row(request.decode.structure, len(prompt))
            self.pool_hit_tokens += row.prefilled
            admitted[index], prompts[index], decodes[index] = True, prompt, request.decode
        self.runner.set_table(self._page_table())
        for index, request in requests.items():
            row = self.rows[index]
            if self.prefix is not None:  # the store serves what the pool missed, after its pages
                self.kv, row.prefilled = self.prefix.load(self.kv, index, row.prompt,
                                                          request.prefix, after=row.prefilled)
                if request.persist:
                    row.offload = OffloadProgress(row.prefilled // self.cfg.block_size)
            request.cached_tokens = row.prefilled
            self.prefix_hit_tokens += row.prefilled
        grammars = [self.rows[i].grammar if i in requests else None for i in range(self.batch_size)]
        return Admission(rows=admitted, fresh=self.initial_state(prompts, decodes, done=~admitted,
                                                                 grammars=grammars))

    def prefill_step(self, adm: Admission) -> bool:
        """The next prefill chunk of every admitted row with prompt blocks left; True once all
        its prompt blocks are written."""
        prompts, end, start = self._prefill_progress(adm)
        calls, after = self.next_round(end, start, adm.rows)
        for call in calls:
            self.prefill_call(prompts, end, start, call)
        for index in np.flatnonzero(adm.rows):
            self.rows[index].prefilled = int(after[index])
        if calls and self.offloader is not None and self.prefix.snapshots:
            self._stage_prefilled(adm, prompts, after)
        return not (adm.rows & (end > after)).any()

    def _prefill_progress(self, adm: Admission) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """The admission's prompts, prefill ends and prefilled positions per row ([B] each; free
        rows: a placeholder and 0), from the rows' records."""
        prompts = self.blank_rows()[0]
        end, start = np.zeros(self.batch_size, np.int32), np.zeros(self.batch_size, np.int32)
        for index in np.flatnonzero(adm.rows):
            row = self.rows[index]
            prompts[index], end[index], start[index] = row.prompt, row.prefill_end, row.prefilled
        return prompts, end, start

    def finish_admit(self, state: DecodeState, adm: Admission) -> DecodeState:
        """Merges the admitted rows' fresh state into the running state (one compiled program)."""
        self._index_prompts(adm)
        return self.runner.merge(state, adm.fresh, adm.rows)

    def admit(self, state: DecodeState | None,
              requests: dict[int, EngineRequest | tuple[Sequence[int], DecodeConfig]]
              ) -> DecodeState:
        """Starts requests in rows at once (begin_admit, every prefill step, finish_admit).
        `state` None: no row is running, so the admission's own state (its other rows free) is
        the new state, with no empty state to build and merge into."""
        adm = self.begin_admit(requests)
        while not self.prefill_step(adm):
            pass
        if state is None:
            self._index_prompts(adm)
            return adm.fresh
        return self.finish_admit(state, adm)

    def _index_prompts(self, adm: Admission) -> None:
        """The admitted prompts are prefilled: their whole pages join the pool's prefix index."""
        for index in np.flatnonzero(adm.rows):
            row = self.rows[index]
            self.pages.register(row.pages, row.page_keys)

    def _stage_prefilled(self, adm: Admission, prompts: list[np.ndarray], prefilled: np.ndarray
                         ) -> None:
        """Rows of a model with snapshot kinds after a prefill round: the prompt blocks written
        so far go to the prefix store with a snapshot of the state after them. A row's state
        exists only at its committed end, so this is where prompts get snapshots: one per round
        (every prefill_chunk tokens of a long prompt, and the prompt's last full block), before
        the first decode call commits past them."""
        admitted = np.flatnonzero(adm.rows)
        canvas = np.zeros((self.batch_size, max(len(prompts[r]) for r in admitted)), np.int32)
        for r in admitted:
            canvas[r, : len(prompts[r])] = prompts[r]
        progress = [self.rows[i].offload if adm.rows[i] else None for i in range(self.batch_size)]
        self.offloader.after_commit(self.kv, prefilled, canvas, progress, prefill=True)

    def prefill_call(self, prompts: list[np.ndarray], full_len: np.ndarray, start: np.ndarray,
                      call: PrefillCall) -> None:
        """Writes the KV of prompt positions [start, start + T) of the call's rows."""
        self.runner.prefill(self.prefill_inputs(prompts, full_len, start, call))

    def prefill_inputs(self, prompts: list[np.ndarray], full_len: np.ndarray, start: np.ndarray,
                       call: PrefillCall) -> list[np.ndarray]:
        """The host inputs of a prefill call (Runner.prefill): tokens [R, T], start [R],
        full_len [R], write [R] and, for one row alone, rows [1]."""
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
        return host

    def next_round(self, full_len: np.ndarray, start: np.ndarray, rows: np.ndarray
                    ) -> tuple[list[PrefillCall], np.ndarray]:
        return admission.next_round(full_len, start, rows, self._bucket, self.row_prefill_min)

    def _bucket(self, tokens: int) -> int:
        return admission.bucket(tokens, self.cfg.block_size, self.prefill_ready)

    def initial_state(self, prompts: list[np.ndarray], decodes: list[DecodeConfig],
                      done: np.ndarray | None = None,
                      grammars: Sequence[RowGrammar | None] = ()) -> DecodeState:
        """The rows' fresh state on the device (`done`: rows that start free; `grammars`: the
        constrained rows' gates and masks, by row)."""
        gate = np.full(len(prompts), block_buffer.NO_POSITION, np.int32)
        allowed = np.zeros((len(prompts), self.grammars.words), np.uint32)
        for i, g in enumerate(grammars):
            if g is not None:
                gate[i], allowed[i] = g.gate, g.mask
        host = block_buffer.initial_state(prompts, self.capacity, self.cfg.block_size,
                                          self.buffer_size, self.cfg.mask_token_id,
                                          admission.row_params(self.cfg, prompts, decodes),
                                          self.record, put=np.asarray, gate=gate, allowed=allowed,
                                          history=indel.history_len(self.cfg))
        if done is not None:
            host = host.replace(done=done)
        return self.runner.put_rows(host)

    def blank_rows(self) -> tuple[list[np.ndarray], list[DecodeConfig]]:
        """Placeholder prompt and decode config of a free row."""
        b = self.batch_size
        return [np.array([self.cfg.pad_token_id], np.int32)] * b, [DecodeConfig()] * b

    def empty_state(self) -> DecodeState:
        """A state whose rows are all free (done)."""
        return self.initial_state(*self.blank_rows(), done=np.ones(self.batch_size, bool))

    # ---------------------------------------------------------------- decode and rows
    def decode_call(self, state: DecodeState, max_steps: int | None = None) -> DecodeState:
        """One call of the jitted loop: up to max_steps decode steps (default steps_per_call),
        returning early when some row finishes (so a server can refill it). In debug mode a
        broken Block Buffer invariant raises here."""
        t = time.perf_counter()
        if self.offloader is not None:
            self.offloader.decode_issued()
        running = np.flatnonzero(~self.views.done(state))
        alone = int(running[0]) if len(running) == 1 and self.batch_size > 1 else None
        state, steps = self.runner.decode(state, max_steps or self.steps_per_call, alone)
        seconds = time.perf_counter() - t
        self._call_log.append((seconds, steps))
        self._decode_calls += 1
        self._decode_seconds += seconds
        if self.offloader is not None:  # stage what this call committed; drain the last call's
            host = self.views.view(state)
            progress = [self.rows[i].offload if i in self.rows else None
                        for i in range(self.batch_size)]
            self.offloader.after_commit(self.kv, host.cached_len, host.canvas, progress, host.done)
        if self.debug:
            violations = jax.device_get(state.violations)
            if np.any(violations):
                raise RuntimeError(f"Block Buffer invariant broken in rows "
                                   f"{np.nonzero(violations)[0].tolist()} (debug mode)")
        return self._advance_grammars(state)

    def _advance_grammars(self, state: DecodeState) -> DecodeState:
        """After a decode call: each live constrained row's grammar consumes the run its loop
        filled at the gate, and the new gates, masks and rejected tokens go back to the device
        (grammar/row.py). Nothing is fetched without such a row."""
        rows = [(i, r.grammar) for i, r in self.rows.items()
                if r.grammar is not None and not r.prefilling]
        if not rows:
            return state
        t = time.perf_counter()
        window, cached_len, done = self.runner.gate_view(state)
        b = self.batch_size
        gate, clear, update = np.zeros(b, np.int32), np.zeros(b, bool), np.zeros(b, bool)
        allowed = np.zeros((b, self.grammars.words), np.uint32)
        for i, grammar in rows:
            if not done[i]:
                clear[i] = grammar.advance(window[i], int(cached_len[i]))
                gate[i], allowed[i], update[i] = grammar.gate, grammar.mask, True
        if update.any():
            state = self.runner.set_gates(state, gate, allowed, clear, update)
        self._grammar_calls += 1
        self._grammar_seconds += time.perf_counter() - t
        return state

    def run_decode(self, state: DecodeState, max_calls: int | None = None) -> DecodeState:
        """Decode calls until every row is done (or max_calls calls ran)."""
        calls = 0
        while not np.all(self.views.done(state)) and (max_calls is None or calls < max_calls):
            state = self.decode_call(state)
            calls += 1
        return state

    def cancel(self, state: DecodeState, rows: Sequence[int]) -> DecodeState:
        """Frees rows (a client went away): they stop at the next step."""
        done = self.views.done(state).copy()
        done[list(rows)] = True
        return state.replace(done=self.runner.put(done))

    def release(self, rows: Sequence[int]) -> None:
        """Frees rows (finished: their results were read; cancelled; failed): their records go,
        with their KV pages, so the pool is what the running requests need. A released row's
        writes go nowhere until it is admitted again, and its blocks not yet staged for the
        prefix store are not persisted (its pages may hold another row's by then)."""
        freed = [self.rows.pop(int(index)) for index in rows if int(index) in self.rows]
        for row in freed:
            self.pages.release(row.pages)
        if freed:
            self.runner.set_table(self._page_table())

    def _page_table(self) -> np.ndarray:
        """[B, pages per row] the pool page of each row's logical page, from the rows' records."""
        return page_table({i: row.pages for i, row in self.rows.items()}, self.batch_size,
                          self.pages.pages_per_row, self.pages.num_pages)

    def buffers_intact(self, state: DecodeState | None) -> bool:
        """Whether the KV pool and `state` still hold their device memory (a call that failed
        after taking its donated buffers leaves them deleted)."""
        return self.runner.buffers_intact(state)

    def reset_buffers(self) -> None:
        """A fresh, empty KV pool and page accounting (after a failure lost the old pool); every
        row is free and no prefix page is cached (the old ones are gone with the buffer)."""
        self.pages.clear()
        self.rows = RowTable(self.batch_size)
        self.runner.reset(self._page_table())
        self.views.forget()

    # ---------------------------------------------------------------- reads
    def host_view(self, state: DecodeState, logprobs: bool = False) -> DecodeState:
        """`state` on the host (host_view.py), fetched once per decode call."""
        return self.views.view(state, logprobs)

    def done_rows(self, state: DecodeState) -> np.ndarray:
        """state.done on the host ([B] bool), fetched once per state."""
        return self.views.done(state)

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

    def stats(self) -> EngineStats:
        """One snapshot of the engine's counters and pool (metrics, benchmarks, tools)."""
        pages = self.pages
        return EngineStats(
            rows=self.batch_size, kv_bytes=self.runner.nbytes(), page_size=pages.page,
            pages=pages.num_pages,
            pages_in_use=pages.in_use, pages_free=pages.free, pages_cached=pages.cached,
            pool_hit_tokens=self.pool_hit_tokens, prefix_hit_tokens=self.prefix_hit_tokens,
            prefill_seconds_per_token=self.prefill_seconds_per_token,
            decode_calls=self._decode_calls, decode_seconds=self._decode_seconds,
            recent_calls=tuple(self._call_log),
            grammar_calls=self._grammar_calls, grammar_seconds=self._grammar_seconds,
            store=None if self.prefix_store is None else dataclasses.replace(
                self.prefix_store.stats),
            offload=None if self.offloader is None else dataclasses.replace(
                self.offloader.stats))

    def kv_usage(self) -> float:
        """The share of the KV pool's pages rows hold now (read from any thread)."""
        return self.pages.in_use / self.pages.num_pages

    @property
    def prefix_cache(self) -> bool:
        """Whether prompts reuse blocks from a prefix store (and committed blocks go there)."""
        return self.prefix is not None

    def sync(self) -> None:
        """Waits until the device has run every call made so far."""
        self.runner.sync()

    def flush(self) -> None:
        """Persists every block staged for the prefix store now (waits for its disk writes)."""
        if self.offloader is not None:
            self.offloader.flush()

    def close(self, compile_wait_s: float = 30.0) -> bool:
        """Persists what is staged and stops the prefix store's threads and the background
        compiles (the engine's end), waiting up to `compile_wait_s` for a compile running now:
        False if it still runs."""
        if self.offloader is not None:
            self.offloader.close()
        return self.background is None or self.background.stop(compile_wait_s)

    def went_idle(self) -> None:
        """No decode call follows for now: blocks staged for the prefix store go there now."""
        if self.offloader is not None:
            self.offloader.idle()
