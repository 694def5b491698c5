"""The model's parameters and cache laid out on a device mesh: the logical axis names the model
declares, through the rules table (parallel/mesh.py), as shardings."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from mbd_jax.config import ModelConfig
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.transformer import param_logical_axes, param_shapes
from mbd_jax.parallel.mesh import tree_shardings


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Any:
    """A tree of NamedShardings shaped like the parameters."""
    return tree_shardings(param_logical_axes(cfg), param_shapes(cfg), mesh)


def cache_shardings(cfg: ModelConfig, mesh: Mesh, batch: int, capacity: int,
                    pages: int | None = None) -> Any:
    """The model's cache (model/cache.py) as a tree of shardings, from the logical axes its kinds
    name: KV heads on `tensor`; the KV pool's pages (any row's) and the page table replicated
    over `data`."""
    shapes = jax.eval_shape(lambda: ModelCache.allocate(cfg, batch, capacity, pages))
    return tree_shardings(ModelCache.logical_axes(cfg), shapes, mesh)


def abstract_params(cfg: ModelConfig, mesh: Mesh) -> Any:
    """ShapeDtypeStructs of the parameters (in `cfg`'s runtime layout) carrying their shardings:
    a restore target that reads each device's shard straight into place (orbax), with no full
    host copy."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        param_shapes(cfg), param_shardings(cfg, mesh))
