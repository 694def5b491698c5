"""CanvasEngine: the engine of the uniform-noise canvas family (DiffusionGemma), with the mask
engine's step protocol (rows.py): `step(candidates)` ends the rows asked to end, admits what
fits (free rows, KV pages, prefix pages shared), prefills them, runs one decode call and
returns an event per row whose canvas finished.

    admit:  reserve pages (prompt + the commits its budget allows), map the prompt's indexed
            pages; then one [1, prefill_chunk] encoder call per prefilling row per step, its
            full pages indexed once its prompt is in
    decode: [buffer_size 1 rows] commit the previous canvas in an encoder call of its own
            round (canvas_loop.engine_round): fresh rows start a canvas, the buffer_size 2 rows'
            commits ride on the first step, then every row steps until one finishes its canvas
    publish: a finished canvas's argmax -> the row's tokens (to an EOS, within its budget), one
            event per canvas; the row ends (EOS, budget) or commits it and starts the next

Rows are independent (a row's tokens never depend on which others run beside it), so a row
admitted while others are mid-canvas decodes exactly what canvas_loop.generate (the dense
reference) decodes for it alone. Shapes are static per engine: nothing compiles after warmup().
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax import canvas_model
from mbd_jax.config.diffusion_gemma import STABILITY_LIMIT, CanvasDecoding, DiffusionGemmaConfig
from mbd_jax.decoding.canvas_loop import SAMPLER_ROWS, CanvasParams, start_canvas
from mbd_jax.engine import canvas_checks, canvas_programs as programs
from mbd_jax.engine.canvas_programs import Layout
from mbd_jax.engine.canvas_rows import CanvasRow
from mbd_jax.engine.pages import PagePool, page_keys, page_table
from mbd_jax.engine.results import GenerationResult
from mbd_jax.engine.rows import EngineRequest, RowEvent, RowTable, StepOutcome
from mbd_jax.engine.stats import RECENT_CALLS, EngineStats
from mbd_jax.model import diffusion_gemma as dg
from mbd_jax.parallel import mesh as meshlib


class CanvasEngine:
    buffer_size = 2  # the deepest schedule a request may ask for (decoding.buffer_size)
    prefix_cache = False  # no RAM / disk prefix store for this family (pool pages are shared)
    can_vote = False
    grammars = None  # no structured output for this family

    def __init__(self, cfg: DiffusionGemmaConfig, params: Any, *, batch_size: int = 4,
                 page_size: int = programs.PAGE_SIZE, max_len: int | None = None,
                 kv_pool_tokens: int | None = None,
                 prefill_chunk: int = 64, steps_per_call: int = 64, tokenizer=None,
                 defaults: CanvasDecoding = CanvasDecoding(), sampler_rows: int = SAMPLER_ROWS,
                 mesh: jax.sharding.Mesh | None = None):
        """`max_len`: positions a row may hold (default the model's); `kv_pool_tokens`: the
        pool's size (default every row a full max_len); `defaults`: the settings a request
        starts from (the model's generation.yaml); `mesh`: the devices (default one): the
        parameters and the pool split by canvas_model's logical axes, the canvas state and
        every host input replicated; each program pins its outputs' shardings, so the buffers
        it donates keep their layout and nothing recompiles."""
        mesh = mesh or meshlib.single_device_mesh()
        self.cfg = dataclasses.replace(cfg, platform=meshlib.platform(mesh))  # its expert path
        self.tokenizer, self.defaults, self.mesh = tokenizer, defaults, mesh
        self.params = jax.device_put(params, meshlib.tree_shardings(
            canvas_model.logical_axes(params), params, mesh))
        self._replicated = meshlib.replicated(mesh)
        self.batch_size, self.prefill_chunk = batch_size, prefill_chunk
        self.steps_per_call = steps_per_call
        self.prefill_ready = prefill_chunk
        self.sampler_rows = sampler_rows
        per_row = -(-(max_len or cfg.max_seq_len) // page_size)
        self.max_len = per_row * page_size
        n_pages = -(-kv_pool_tokens // page_size) if kv_pool_tokens else batch_size * per_row
        self.pages = PagePool(n_pages, page_size, per_row)
        self.rows = RowTable(batch_size)
        self._calls: list[tuple[float, int]] = []
        self.pool_hit_tokens = 0
        self.reset_buffers()

    # ---------------------------------------------------------------- checks
    def check_prompt(self, ids: Sequence[int], where: str = "prompt") -> None:
        canvas_checks.check_prompt(self.cfg, ids, where)

    def check_decode(self, d: CanvasDecoding, where: str = "decoding") -> None:
        canvas_checks.check_decode(self.cfg, d, where)

    def check_fits(self, prompt: Sequence[int], d: CanvasDecoding, where: str = "decoding") -> None:
        canvas_checks.check_fits(self.cfg, prompt, d, self.max_len, self.pages, where)

    # ---------------------------------------------------------------- drivers
    def generate(self, prompts: Sequence[Sequence[int]],
                 decode: CanvasDecoding | Sequence[CanvasDecoding] | None = None
                 ) -> list[GenerationResult]:
        """Every prompt's generation, as many at a time as fit (step() until all are done)."""
        decode = self.defaults if decode is None else decode
        decodes = list(decode) if isinstance(decode, (list, tuple)) else [decode] * len(prompts)
        for i, (p, d) in enumerate(zip(prompts, decodes, strict=True)):
            self.check_prompt(p, f"prompt[{i}]")
            self.check_decode(d, f"decoding[{i}]")
            self.check_fits(p, d, f"decoding[{i}]")
        waiting = [EngineRequest(p, d, stream=False, tag=i)
                   for i, (p, d) in enumerate(zip(prompts, decodes))]
        results: list[GenerationResult | None] = [None] * len(waiting)
        t0 = time.perf_counter()
        while waiting or len(self.rows):
            out = self.step(waiting)
            if out.error is not None:
                raise out.error
            waiting = [r for r in waiting if r not in out.admitted]
            for e in out.events:
                if e.finished:
                    results[e.request.tag] = e.result(time.perf_counter() - t0)
        return results

    def step(self, candidates: Sequence[EngineRequest] = (),
             max_steps: int | None = None) -> StepOutcome:
        """End the rows asked to end -> admit the longest prefix of `candidates` that fits ->
        a prefill chunk of each prefilling row -> one decode call over the rows whose prompt is
        in -> an event per row whose canvas finished. A failure fails
        every busy row (the device buffers are allocated afresh) and is reported; the engine
        goes on."""
        out, in_decode = StepOutcome(), False
        try:
            self._end_rows(out)
            self._admit(candidates, out)
            self._prefill_round()
            if self._decoding():
                in_decode = True
                self._decode(out, max_steps or self.steps_per_call)
                out.decoded = True
        except Exception as e:  # noqa: BLE001 - reported, and the engine goes on
            out.error, out.decode_failed = e, in_decode
            out.failed = [r.request for _, r in self.rows.items()]
            out.failed += [r for r in out.admitted if r not in out.failed]
            self.release([i for i, _ in self.rows.items()])
            self.reset_buffers()
        return out

    def end(self, request: EngineRequest, how: str = "cancel") -> None:
        """Ends a running request at the next step ("cancel": no event; "stop": finished with
        the tokens its events handed out)."""
        if how not in ("cancel", "stop"):
            raise ValueError(f"end(how={how!r}): expected 'cancel' or 'stop'")
        index = self.rows.find(request)
        if index is not None:
            self.rows[index].ending = how

    # ---------------------------------------------------------------- the step's parts
    def _end_rows(self, out: StepOutcome) -> None:
        ending = [i for i, r in self.rows.items() if r.ending]
        for i in ending:
            row = self.rows[i]
            if row.ending == "stop":
                result = functools.partial(row.result, self.tokenizer, "stop")
                out.events.append(RowEvent(row.request, [], None, finished=True, result=result))
        self.release(ending)

    def _admit(self, candidates: Sequence[EngineRequest], out: StepOutcome) -> None:
        free = self.rows.free()
        for request in candidates[: len(free)]:
            keys = page_keys(request.prompt, self.pages.page, len(request.prompt))
            shared = self.pages.lookup(keys)
            tokens = canvas_checks.positions(self.cfg, request.prompt, request.decode)
            if self.pages.cost(tokens, shared) > self.pages.free:
                break  # the head waits for pages; nothing behind it overtakes it
            if len(shared) < len(keys) and keys[len(shared)] in self._being_prefilled():
                break  # its next page is a prompt page still prefilling: map it once it is in
            i = free[len(out.admitted)]
            out.admitted.append(request)
            row = CanvasRow(request, self.pages.reserve(tokens, shared),
                            canvas_checks.canvases(self.cfg, request.decode))
            row.prefilled, row.page_keys = len(shared) * self.pages.page, keys
            self.rows.add(i, row)
            self._table = None
            self.pool_hit_tokens += min(row.prefilled, len(request.prompt))
            self._set_params(i, request.decode)

    def _prefill_round(self) -> None:
        """One prefill_chunk of each prefilling row's prompt into its pages (a long prompt
        takes a chunk per step, between the others' decode calls); a row whose prompt is in
        indexes its full pages and decodes from the next call."""
        t = self.prefill_chunk
        for i, row in self.rows.items():
            if not row.prefilling:
                continue
            s, prompt = row.prefilled, row.request.prompt
            chunk = np.full((1, t), self.cfg.pad_token_id, np.int32)
            piece = prompt[s: s + t]
            chunk[0, : len(piece)] = piece
            self._layers = programs.encode(self.params, self.cfg, self._layout, self._layers,
                                           self.table()[i: i + 1], chunk, np.array([s], np.int32),
                                           np.ones(1, bool))
            row.prefilled = min(s + t, len(prompt))
            if not row.prefilling:
                self.pages.register(row.pages, row.page_keys)

    def _being_prefilled(self) -> set[bytes]:
        return {k for _, r in self.rows.items() if r.prefilling for k in r.page_keys}

    def _decoding(self) -> dict[int, CanvasRow]:
        return {i: row for i, row in self.rows.items() if not row.prefilling}

    def _decode(self, out: StepOutcome, max_steps: int) -> None:
        b, c = self.batch_size, self.cfg.canvas_length
        busy = self._decoding()  # (prefilling rows idle: their canvases start once it is in)
        commit = np.zeros((b, c), np.int32)
        apart, fused, fresh = (np.zeros(b, bool) for _ in range(3))
        cached, index = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for i, row in busy.items():
            cached[i], index[i], fresh[i] = row.cached_len(c), row.index, row.fresh
            if row.commit is not None:
                commit[i] = row.commit
                (fused if row.request.decode.buffer_size == 2 else apart)[i] = True
        table = self._tables()[1]
        t0 = time.perf_counter()
        if apart.any():
            self._layers = programs.encode(self.params, self.cfg, self._layout, self._layers,
                                           table, commit, cached - c, apart)
        idle = np.array([i not in busy for i in range(b)])
        self._state, self._layers, passes = programs.denoise_round(
            self.params, self.cfg, self._layout, self._params_device(), self._state,
            self._layers, table, cached, index, fresh, idle, commit if fused.any() else None, fused,
            np.int32(max_steps), self.sampler_rows)
        done, argmax, steps, passes = jax.device_get((self._state.done, self._state.argmax,
                                                      self._state.steps_done, passes))
        self._calls.append((time.perf_counter() - t0, int(passes)))
        del self._calls[:-RECENT_CALLS]
        finished = []
        for i, row in busy.items():
            row.commits_apart += bool(apart[i])
            row.fresh, row.commit = False, None
            if done[i]:
                event = row.canvas_done(argmax[i], int(steps[i]), self.cfg)
                if event.finished:
                    event.result = functools.partial(row.result, self.tokenizer, None)
                    finished.append(i)
                out.events.append(event)
        self.release(finished)

    # ---------------------------------------------------------------- device state
    def table(self) -> np.ndarray:
        """[B, pages per row] the busy rows' page table (rebuilt when rows change)."""
        return self._tables()[0]

    def _tables(self) -> tuple[np.ndarray, jax.Array]:
        """The page table on the host and on the mesh: sent once per change of rows, not per
        decode call."""
        if self._table is None:
            held = {i: r.pages for i, r in self.rows.items()}
            host = page_table(held, self.batch_size, self.pages.pages_per_row,
                              self.pages.num_pages)
            self._table = host, jax.device_put(host, self._replicated)
        return self._table

    def _set_params(self, i: int, d: CanvasDecoding) -> None:
        self._decodings[i] = d
        self._params = None

    def _params_device(self) -> CanvasParams:
        if self._params is None:
            self._params = jax.device_put(CanvasParams.of(self._decodings), self._replicated)
        return self._params

    def release(self, rows: Sequence[int]) -> None:
        for i in rows:
            self.pages.release(self.rows.pop(i).pages)
        if rows:
            self._table = None

    def reset_buffers(self) -> None:
        """Fresh device buffers (pool, canvas state) and page accounting; every row free."""
        b = self.batch_size
        self.pages.clear()
        layers = dg.allocate_pool(self.cfg, self.pages.num_pages, self.pages.page)
        self._layout = Layout.of(layers, self.mesh)
        self._layers = self._layout.pin_layers(layers)
        self._decodings = [self.defaults] * b
        self._params = self._table = None
        st = start_canvas(self.cfg, self._params_device(), jnp.zeros(b, jnp.int32),
                          jnp.ones(b, bool), STABILITY_LIMIT)
        self._state = jax.device_put(st.replace(argmax=jnp.copy(st.argmax)),  # (each buffer
                                     self._replicated)  # is donated once)

    # ---------------------------------------------------------------- service protocol
    def warmup(self, progress: Callable[[str], None] | None = None, buckets=None,
               background: bool = False) -> None:
        """Compiles the prefill chunk, the apart commit and both rounds (with and without
        commits) on idle rows: nothing compiles after this."""
        say = progress or (lambda message: None)
        b, c = self.batch_size, self.cfg.canvas_length
        no, zeros = np.zeros(b, bool), np.zeros(b, np.int32)
        say(f"compiling the prefill of {self.prefill_chunk} tokens")
        chunk = np.zeros((1, self.prefill_chunk), np.int32)
        self._layers = programs.encode(self.params, self.cfg, self._layout, self._layers,
                                       self.table()[:1], chunk, zeros[:1], no[:1])
        say("compiling the commit")
        self._layers = programs.encode(self.params, self.cfg, self._layout, self._layers,
                                       self._tables()[1], np.zeros((b, c), np.int32), zeros, no)
        for commit in (None, np.zeros((b, c), np.int32)):
            say("compiling the denoising round" + (" with commits" if commit is not None else ""))
            self._state, self._layers, _ = programs.denoise_round(
                self.params, self.cfg, self._layout, self._params_device(), self._state,
                self._layers, self._tables()[1], zeros, zeros, no, np.ones(b, bool), commit, no,
                np.int32(1), self.sampler_rows)
        jax.block_until_ready(self._layers)

    def stats(self) -> EngineStats:
        pages = self.pages
        nbytes = sum(x.nbytes for x in jax.tree.leaves(self._layers))
        return EngineStats(
            rows=self.batch_size, kv_bytes=nbytes, page_size=pages.page, pages=pages.num_pages,
            pages_in_use=pages.in_use, pages_free=pages.free, pages_cached=pages.cached,
            pool_hit_tokens=self.pool_hit_tokens, prefix_hit_tokens=self.pool_hit_tokens,
            prefill_seconds_per_token=0.0, decode_calls=len(self._calls),
            decode_seconds=sum(s for s, _ in self._calls), recent_calls=tuple(self._calls),
            grammar_calls=0, grammar_seconds=0.0, store=None, offload=None)

    def kv_usage(self) -> float:
        return self.pages.in_use / self.pages.num_pages

    def prefetch(self, prompt: Sequence[int]) -> None:
        return None

    def went_idle(self) -> None:
        pass

    def close(self, compile_wait_s: float = 30.0) -> bool:
        return True
