"""An engine's programs compiled for GPUs that are not here: compile-only devices of a GPU
topology (XLA's target description of the device, configs/gpu-targets/), the engine's real
decode and prefill programs lowered over abstract inputs with the engine's shardings on a mesh
of those devices, and XLA:GPU's whole pipeline run on them (SPMD partitioning, collectives,
fusions, PTX). Needs the CUDA plugin wheels (`pip install -e '.[gpu-compile]'`, no driver) and
JAX_PLATFORMS=cpu set before JAX starts (else the plugin looks for a driver and the topology
cannot be built).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.config import DATA_ROOT, DecodeConfig, ModelConfig
from mbd_jax.decoding import block_buffer, indel
from mbd_jax.decoding.gate import mask_words
from mbd_jax.engine import admission
from mbd_jax.engine.page_plan import pool_size
from mbd_jax.engine.programs import programs
from mbd_jax.errors import UserError
from mbd_jax.model import sharding
from mbd_jax.model.cache import ModelCache
from mbd_jax.parallel import mesh as meshlib

TARGET_DIR = DATA_ROOT / "configs" / "gpu-targets"
TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}  # names -> files in TARGET_DIR


def target_text(target: str) -> str:
    """A target description: a name in TARGETS or a GpuTargetConfigProto text file."""
    path = TARGET_DIR / TARGETS[target] if target in TARGETS else pathlib.Path(target)
    if not path.is_file():
        raise UserError(f"target {target!r}: expected one of {', '.join(TARGETS)} or a "
                        "GpuTargetConfigProto text file")
    return path.read_text()


def topology_devices(target: str, hosts: int = 1, per_host: int = 8,
                     memory_scale: int = 1) -> list[Any]:
    """Compile-only devices of `hosts` hosts of `per_host` GPUs each (`memory_scale`: with that
    many times the device's memory, to size a program that does not fit it)."""
    from jax.experimental import topologies

    if hosts < 1 or per_host < 1:
        raise UserError(f"topology: {hosts} hosts of {per_host} devices; both must be >= 1")
    text = target_text(target)
    if memory_scale != 1:
        text = re.sub(r"device_memory_size:\s*(\d+)",
                      lambda m: f"device_memory_size: {int(m.group(1)) * memory_scale}", text)
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{per_host}",
                                            target_config=text)
    except (RuntimeError, ValueError) as e:  # no plugin, a CUDA backend already up, a bad file
        raise UserError(f"cannot build a {hosts}x{per_host} {target} topology here: {e} (needs "
                        "the gpu-compile extra: pip install -e '.[gpu-compile]')") from None
    return list(topo.devices)


def too_large(error: Exception) -> bool:
    """Whether a compile failed because the program's buffers exceed the device's memory (XLA
    says so in a warning and then fails with cudaErrorInvalidDevice). A kernel over its shared
    memory is RESOURCE_EXHAUSTED too, but no larger HBM helps it: not this."""
    text = str(error)
    if "Shared memory size limit" in text:
        return False
    return "cudaErrorInvalidDevice" in text or "exceeds the base limit" in text \
        or "RESOURCE_EXHAUSTED" in text


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The engine whose programs are compiled: what `Engine(...)` would be given."""

    batch_size: int = 4
    buffer_size: int = 2
    prefill_chunk: int = 256
    kv_pool_tokens: int | None = None  # None: every row a full context


@dataclasses.dataclass
class Program:
    compiled: jax.stages.Compiled
    input_bytes: int  # per device, from the inputs' shapes and shardings (what XLA must hold)


def per_device_bytes(args: Any) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(args))


def _compile(jitted: Any, *args: Any) -> Program:
    return Program(jitted.lower(*args).compile(), per_device_bytes(args))


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """What an engine of a shape holds per device (as Engine sizes it)."""

    capacity: int  # positions per row
    pages: int  # KV pool pages
    param_bytes: int  # per device, from the parameters' shardings
    kv_bytes: int  # per device, from the cache's shardings (page table included)


def _sizes(cfg: ModelConfig, shape: EngineShape) -> tuple[int, int, int]:
    """(prefill chunk, capacity, pages) as Engine sizes them (page_plan.pool_size)."""
    size = pool_size(cfg, shape.batch_size, shape.buffer_size, shape.prefill_chunk,
                     shape.kv_pool_tokens)
    return size.prefill_chunk, size.capacity, size.pages


def _abstract_kv(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch: int, capacity: int,
                 pages: int) -> Any:
    return _abstract(jax.eval_shape(lambda: ModelCache.allocate(cfg, batch, capacity, pages)),
                     sharding.cache_shardings(cfg, mesh, batch, capacity, pages))


def engine_layout(cfg: ModelConfig, mesh: jax.sharding.Mesh, shape: EngineShape) -> EngineLayout:
    cfg = dataclasses.replace(cfg, platform=meshlib.platform(mesh))
    _, capacity, pages = _sizes(cfg, shape)
    return EngineLayout(capacity, pages, per_device_bytes(sharding.abstract_params(cfg, mesh)),
                        per_device_bytes(_abstract_kv(cfg, mesh, shape.batch_size, capacity,
                                                       pages)))


def compile_engine(cfg: ModelConfig, mesh: jax.sharding.Mesh, shape: EngineShape
                   ) -> dict[str, Program]:
    """{"decode": the all-rows decode loop, "prefill": a prefill_chunk-token call over every
    row} of an engine of `shape` on `mesh`, compiled for the mesh's platform."""
    cfg = dataclasses.replace(cfg, platform=meshlib.platform(mesh))
    prefill_chunk, capacity, n_pages = _sizes(cfg, shape)
    b = shape.batch_size
    progs = programs(cfg, mesh, b, capacity, n_pages, shape.buffer_size, False)
    replicated = meshlib.replicated(mesh)
    params = sharding.abstract_params(cfg, mesh)
    kv = _abstract_kv(cfg, mesh, b, capacity, n_pages)
    prompts = [np.full(1, cfg.pad_token_id, np.int32)] * b
    decodes = [DecodeConfig(buffer_size=shape.buffer_size)] * b
    host = block_buffer.initial_state(prompts, capacity, cfg.block_size, shape.buffer_size,
                                      cfg.mask_token_id,
                                      admission.row_params(cfg, prompts, decodes), put=np.asarray,
                                      allowed=np.zeros((b, mask_words(cfg.vocab_size)), np.uint32),
                                      history=indel.history_len(cfg))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         host)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    rows = lambda dt: jax.ShapeDtypeStruct((b,), dt, sharding=replicated)  # noqa: E731
    tokens = jax.ShapeDtypeStruct((b, prefill_chunk), jnp.int32, sharding=replicated)
    return {"decode": _compile(progs.decode, params, state, kv, scalar),
            "prefill": _compile(progs.prefill, params, kv, tokens, rows(jnp.int32),
                                rows(jnp.int32), rows(jnp.bool_))}
