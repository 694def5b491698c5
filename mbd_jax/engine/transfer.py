"""Moving the decode state between host and device as a few large transfers, not dozens of
small ones: a pytree of batch-first arrays travels as one [B, n] array per dtype, packed on one
side and split on the other. On a CPU each transfer costs ~0.1 ms of Python and runtime work,
more than a batch-1 request's prefill, so per request this is most of the host overhead
(docs/lab/performance-history.md).

- RowPacker: host tree -> device (admission's fresh rows): packed with NumPy, one device_put
  of every dtype's array, split by a jitted unpack (compiled once per tree layout).
- RowFetcher: device tree -> host (each decode call's host view, results): packed by a jitted
  concatenation (compiled once per layout), one device_get, split with NumPy views.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Layout = tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]  # (treedef, ((shape, dtype), ...))


def _groups(layout: Layout) -> dict[str, list[int]]:
    """Leaf indices per dtype, in leaf order: the packed arrays' columns follow it."""
    groups: dict[str, list[int]] = {}
    for i, (_, dtype) in enumerate(layout[1]):
        groups.setdefault(dtype, []).append(i)
    return groups


def _split(arrays: list[Any], layout: Layout, xp: Any) -> Any:
    """The tree of `layout` from its packed arrays (one per dtype group), with array module xp."""
    treedef, leaves = layout
    out: list[Any] = [None] * len(leaves)
    for array, idx in zip(arrays, _groups(layout).values()):
        col = 0
        for i in idx:
            shape = leaves[i][0]
            size = math.prod(shape[1:])
            out[i] = xp.reshape(array[:, col: col + size], shape)
            col += size
    return jax.tree.unflatten(treedef, out)


def _layout(leaves: list[Any], treedef: Any) -> Layout:
    return treedef, tuple((tuple(x.shape), np.dtype(x.dtype).str) for x in leaves)


# The jitted halves, one per layout (and sharding) per process, shared by every engine: an engine
# built again with the same shapes traces nothing (programs.py).
@functools.lru_cache(maxsize=256)
def _unpacker(layout: Layout) -> Callable:
    return jax.jit(lambda *arrays: _split(list(arrays), layout, jnp))


@functools.lru_cache(maxsize=256)
def _packer(layout: Layout, sharding: Any) -> Callable:
    groups = list(_groups(layout).values())
    return jax.jit(lambda *xs: [jnp.concatenate([xs[i].reshape(xs[i].shape[0], -1) for i in idx],
                                                axis=1) for idx in groups],
                   out_shardings=sharding)


def clear() -> None:
    _unpacker.cache_clear()
    _packer.cache_clear()


class RowPacker:
    def __init__(self, put: Callable[[Any], Any]):
        self._put = put  # host arrays (a list) -> the mesh (replicated), one call

    def __call__(self, tree: Any) -> Any:
        """`tree` (every leaf [B, ...]) on the device, as the same tree."""
        leaves, treedef = jax.tree.flatten(tree)
        leaves = [np.asarray(x) for x in leaves]
        layout = _layout(leaves, treedef)
        packed = [np.concatenate([leaves[i].reshape(len(leaves[i]), -1) for i in idx], axis=1)
                  for idx in _groups(layout).values()]
        return _unpacker(layout)(*self._put(packed))


class RowFetcher:
    def __init__(self, sharding: Any = None):
        self._sharding = sharding  # of the packed arrays (the engine's: replicated over its mesh)

    def __call__(self, tree: Any) -> Any:
        """`tree` (every leaf [B, ...] on the device; None leaves stay None) on the host, as the
        same tree of NumPy arrays (views into one array per dtype)."""
        leaves, treedef = jax.tree.flatten(tree)
        layout = _layout(leaves, treedef)
        return _split(jax.device_get(_packer(layout, self._sharding)(*leaves)), layout, np)
