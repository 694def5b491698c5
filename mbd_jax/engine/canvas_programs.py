"""The canvas engine's device programs (engine/canvas_engine.py), jitted once per process per
shape: the encoder pass into the pages (prefill chunks, commits in a forward of their own) and
the denoising round (decoding/canvas_loop.engine_round). Each pins its outputs' shardings
(`Layout`), so the buffers it donates come back in the layout they went in with."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from mbd_jax import canvas_model
from mbd_jax.decoding import canvas_loop
from mbd_jax.model import diffusion_gemma as dg
from mbd_jax.parallel import mesh as meshlib

PAGE_SIZE = 64  # positions per KV page, by default


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where an engine's device buffers live (hashable: the programs take it as a static
    argument): each layer's pool sharding (its k and v alike: canvas_model.CACHE_AXES), and the
    replicated one of the canvas state."""

    layers: tuple[jax.sharding.NamedSharding, ...]
    replicated: jax.sharding.NamedSharding

    @classmethod
    def of(cls, pool: list[dict[str, Any]], mesh: jax.sharding.Mesh) -> Layout:
        """The layout of a pool (arrays or shapes, dg.allocate_pool's) on `mesh`."""
        keys = [x["k"] for x in pool]
        return cls(tuple(meshlib.tree_shardings([canvas_model.CACHE_AXES] * len(keys), keys,
                                                mesh)), meshlib.replicated(mesh))

    def pin_layers(self, layers: list[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
        put = jax.lax.with_sharding_constraint if isinstance(layers[0]["k"], jax.core.Tracer) \
            else jax.device_put
        return [{n: put(x[n], s) for n in ("k", "v")} for x, s in zip(layers, self.layers)]


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=3)
def encode(params, cfg, layout, layers, table, tokens, start, write):
    """Encoder pass of tokens [B, T] at start [B] into the pages of the rows `write` selects."""
    cache = dg.forward(params, cfg, tokens, start, dg.PagedCache(layers, table), write=write)[0]
    return layout.pin_layers(cache.layers)


@functools.partial(jax.jit, static_argnums=(1, 2, 14), donate_argnums=(4, 5))
def denoise_round(params, cfg, layout, p, st, layers, table, cached_len, index, fresh, idle, commit,
           commit_rows, max_steps, sampler_rows):
    st, cache, passes = canvas_loop.engine_round(
        params, cfg, p, st, dg.PagedCache(layers, table), cached_len, index, fresh, idle, commit,
        commit_rows, max_steps, sampler_rows)
    return (jax.lax.with_sharding_constraint(st, layout.replicated),
            layout.pin_layers(cache.layers), passes)
