"""The device side of an engine: the parameters, the model's cache and the compiled programs, and
every call that touches the device (prefill, decode, merge rows, transfers, reset).

The engine (core.py) plans on the host (rows, pages, prefill rounds) and hands the Runner host
arrays; the Runner owns nothing the host plans with. Everything lives on a device mesh
(parallel/mesh.py; one device without one): the parameters and the KV pool are split by the rules
table, the decode state and every host input are replicated, and every compiled program names
its output shardings, so donated buffers keep their layout and nothing recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from mbd_jax.config import ModelConfig, resolve_auto
from mbd_jax.decoding.block_buffer import DecodeState
from mbd_jax.engine.programs import programs
from mbd_jax.engine.transfer import RowFetcher, RowPacker
from mbd_jax.model import layout, sharding
from mbd_jax.parallel import mesh as meshlib


class Runner:
    def __init__(self, cfg: ModelConfig, params: Any, mesh: jax.sharding.Mesh, *,
                 batch_size: int, buffer_size: int, capacity: int, n_pages: int, debug: bool,
                 split_experts: bool):
        """A cache of `capacity` positions per row in `n_pages` pages for `batch_size` rows, and a
        compiled N_buf of `buffer_size`. `split_experts`: see Engine."""
        self.cfg, self.mesh, self.batch_size = cfg, mesh, batch_size
        self.replicated = replicated = meshlib.replicated(mesh)
        self.put = functools.partial(jax.device_put, device=replicated)  # host input -> mesh
        self.put_rows = RowPacker(self.put)  # a batch-first host tree -> mesh, one transfer
        self.fetch_rows = RowFetcher(replicated)  # a batch-first device tree -> host, one transfer
        self.params = jax.device_put(params, sharding.param_shardings(cfg, mesh))
        self._split_experts = split_experts
        self.experts_split = False  # the params' expert layout (_use_layout)
        # The expert path each decode program runs (moe_impl `measure`: auto's until the warm-up
        # times the candidates, engine/expert_paths.py); programs are built per path.
        self._program_key = (mesh, batch_size, capacity, n_pages, buffer_size, debug)
        impl = resolve_auto("moe_impl", cfg.moe_impl, cfg.platform)
        self.moe_paths = {"all rows": impl, "one row": impl}
        self._use_layout(impl)
        progs = self._programs(impl)
        self._table_sharding = progs.kv_sharding.table
        self._allocate_kv = progs.allocate_kv
        self._prefill, self._decode, self._merge = progs.prefill, progs.decode, progs.merge
        self._decode_one = progs.decode  # one running row alone
        self._take_row, self._put_row = progs.take_row, progs.put_row
        self._gate_view, self._set_gates = progs.gate_view, progs.set_gates
        self._row_ids = [self.put(np.array([i], np.int32)) for i in range(batch_size)]
        self._table: np.ndarray | None = None  # a page table not yet sent to the device
        self._kv = self._allocate_kv()
        self.kv_shape = jax.tree.map(_abstract, self._kv)  # the cache's shapes and shardings

    def _programs(self, moe_impl: str):
        """This engine's programs with the expert path `moe_impl` (shared per process)."""
        return programs(dataclasses.replace(self.cfg, moe_impl=moe_impl), *self._program_key)

    def _use_layout(self, moe_impl: str) -> None:
        """Puts the expert weights in the layout path `moe_impl` reads fastest: per-expert arrays
        for the looped path on one CPU device, stacked otherwise (model/layout.py)."""
        split = self._split_experts and layout.splits_experts(self.cfg, self.mesh, moe_impl)
        if split != self.experts_split:
            self.params = (layout.split_experts if split else layout.stack_experts)(self.params)
            self.experts_split = split

    def use_expert_paths(self, all_rows: str, one_row: str) -> None:
        """Runs prefill and the all-rows decode program with expert path `all_rows` (the expert
        weights in its layout), and the one-row decode program with `one_row`."""
        self._use_layout(all_rows)
        progs = self._programs(all_rows)
        self._prefill, self._decode = progs.prefill, progs.decode
        self._decode_one = self._programs(one_row).decode
        self.moe_paths = {"all rows": all_rows, "one row": one_row}

    # ---------------------------------------------------------------- the cache
    @property
    def kv(self) -> Any:
        """The device cache, with the latest page table: a table set since the last read is sent
        first, once however many were set in between (one transfer)."""
        if self._table is not None:
            self._kv = self._kv.with_table(jax.device_put(self._table, self._table_sharding))
            self._table = None
        return self._kv

    @kv.setter
    def kv(self, value: Any) -> None:
        self._kv = value

    def set_table(self, table: np.ndarray) -> None:
        """The host page table [B, pages per row] the cache reads from its next use on."""
        self._table = table

    def reset(self, table: np.ndarray) -> None:
        """A fresh, empty cache over page table `table` (after a failure lost the old one)."""
        self._kv = self._allocate_kv()
        self.set_table(table)

    def nbytes(self) -> int:
        return self._kv.nbytes()

    def sync(self) -> None:
        """Waits until the device has run every call made so far."""
        jax.block_until_ready(self._kv)

    def buffers_intact(self, state: DecodeState | None) -> bool:
        """Whether the cache and `state` still hold their device memory (a call that failed
        after taking its donated buffers leaves them deleted)."""
        return not any(x.is_deleted() for x in jax.tree.leaves((self._kv, state))
                       if isinstance(x, jax.Array))

    # ---------------------------------------------------------------- the programs
    def prefill(self, host_inputs: list[np.ndarray]) -> None:
        """One prefill call: (tokens [R, T], start [R], full_len [R], write [R] and, for one row
        alone, rows [1]) written into the cache (loop.prefill)."""
        self.kv = self._prefill(self.params, self.kv, *self.put(host_inputs))  # one transfer

    def compile(self, program: Any, *args: Any) -> None:
        """Compiles `program` (one of this engine's jitted programs) for arguments like `args`
        without running it, from any thread: its first call then finds it compiled (JAX's
        in-memory cache). A host array stands for what `put` makes of it (replicated), a device
        array or a ShapeDtypeStruct for itself, a NumPy scalar is passed as it is."""
        def like(x: Any) -> Any:
            if isinstance(x, np.ndarray):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated)
            return jax.tree.map(_abstract, x) if not isinstance(x, np.generic) else x

        program.lower(*map(like, args)).compile()

    def compile_prefill(self, host_inputs: list[np.ndarray]) -> None:
        """Compiles the prefill call of these host inputs (prefill) without running it."""
        self.compile(self._prefill, self.params, self.kv_shape, *host_inputs)

    def decode(self, state: DecodeState, max_steps: int, row: int | None = None
               ) -> tuple[DecodeState, int]:
        """One call of the jitted decode loop over every row, or over cache row `row` alone (its
        state row taken out and put back): (the new state, the steps it ran). Waits for it."""
        if row is None:
            state, self.kv, steps = self._decode(self.params, state, self.kv, np.int32(max_steps))
        else:
            ids = self._row_ids[row]  # [1] on the device
            sub, self.kv, steps = self._decode_one(self.params, self._take_row(state, ids),
                                                   self.kv, np.int32(max_steps), ids)
            state = self._put_row(state, sub, ids)
        return state, int(steps)

    def gate_view(self, state: DecodeState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(window [B, W], cached_len [B], done [B]) on the host: what constrained rows'
        grammars read after a decode call (one small transfer, not the whole canvas)."""
        return jax.device_get(self._gate_view(state))

    def set_gates(self, state: DecodeState, gate: np.ndarray, allowed: np.ndarray,
                  clear: np.ndarray, rows: np.ndarray) -> DecodeState:
        """`state` with the grammars' new gates and masks (block_buffer.with_gates)."""
        return self._set_gates(state, *self.put([gate, allowed, clear, rows]))

    def merge(self, state: DecodeState, fresh: DecodeState, rows: np.ndarray) -> DecodeState:
        """`state` with the rows `rows` selects ([B] bool) replaced by `fresh`'s."""
        return self._merge(state, fresh, self.put(rows))


def _abstract(x: Any) -> Any:
    """A device array's shape, dtype and sharding (a ShapeDtypeStruct stays as it is)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
