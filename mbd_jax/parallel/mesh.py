"""The device mesh and the one rules table from logical axis names to mesh axes.

Mesh axes are ('data', 'expert', 'tensor'). Every parameter carries logical axis names
(`nn.with_logical_partitioning` in model/transformer.py); `RULES` maps them to mesh axes:
heads, KV heads, MLP hidden and vocab split on `tensor`, experts on `expert`, batch rows on
`data`. A dimension the mesh axis does not divide stays replicated (a tiny model on a wide
mesh), so every preset runs on every mesh shape.

    mesh = make_mesh(parse_mesh("data=1,expert=4,tensor=2"))
    params = jax.device_put(params, model.sharding.param_shardings(cfg, mesh))

The engine keeps its decode state replicated (every process reads it after each call) and its
KV pool split like the KV heads; the routed experts run inside shard_map (parallel/expert.py).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mbd_jax.errors import UserError

AXES = ("data", "expert", "tensor")
RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    "embed": None,
    "head_dim": None,
    "seq": None,
    "layers": None,  # the stacked axis of scanned layers and of the KV pool
    "pages": None,  # the KV pool's pages: any row's, so every data shard holds the pool
    "page": None,
    "conv": None,  # a linear-attention layer's convolution taps
}


def parse_mesh(spec: str, n_devices: int | None = None) -> dict[str, int]:
    """"data=1,expert=4,tensor=2" -> sizes per axis; one size may be -1 (fills the devices);
    axes not named get 1."""
    n = jax.device_count() if n_devices is None else n_devices
    sizes = dict.fromkeys(AXES, 1)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in AXES:
            raise UserError(f"--mesh {spec!r}: unknown axis {name!r}; axes: {', '.join(AXES)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise UserError(f"--mesh {spec!r}: {name} needs an integer size, got {value!r}") from None
        if sizes[name] < 1 and sizes[name] != -1:
            raise UserError(f"--mesh {spec!r}: {name} must be >= 1 or -1 (fill)")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise UserError(f"--mesh {spec!r}: at most one axis may be -1")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if n % known:
            raise UserError(f"--mesh {spec!r}: {n} devices do not split by {known}")
        sizes[fill[0]] = n // known
    if math.prod(sizes.values()) != n:
        raise UserError(f"--mesh {spec!r}: needs {math.prod(sizes.values())} devices, "
                        f"{n} are present")
    return sizes


def make_mesh(sizes: dict[str, int], devices: list | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = tuple(sizes[a] for a in AXES)
    return Mesh(np.array(devices[: math.prod(shape)]).reshape(shape), AXES)


def spec_for(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The mesh PartitionSpec of an array with these logical axis names (RULES; dims the mesh
    axis does not divide, and mesh axes already used by an earlier dim, stay replicated)."""
    out, used = [], set()
    for name, dim in zip(logical, shape):
        axis = RULES.get(name) if name is not None else None
        if axis is None or axis in used or dim % mesh.shape[axis]:
            out.append(None)
        else:
            out.append(axis)
            used.add(axis)
    return P(*out)


def tree_shardings(logical: Any, shapes: Any, mesh: Mesh) -> Any:
    """NamedShardings for a tree of arrays (`shapes`: anything with `.shape`) whose logical axis
    names are the matching leaves of `logical` (tuples of names, or PartitionSpecs)."""
    is_axes = lambda x: isinstance(x, P) or (isinstance(x, tuple) and all(  # noqa: E731
        a is None or isinstance(a, str) for a in x))
    return jax.tree.map(lambda axes, s: NamedSharding(mesh, spec_for(tuple(axes), s.shape, mesh)),
                        logical, shapes, is_leaf=is_axes)


def platform(mesh: Mesh) -> str:
    """The platform of the mesh's devices ("cpu", "gpu", "tpu"; compile-only devices of a GPU
    topology say "gpu"): what the programs built for it are traced for (ModelConfig.platform)."""
    return mesh.devices.flat[0].platform


def single_device_mesh() -> Mesh:
    """The (1, 1, 1) mesh of the first device: what an engine without --mesh runs on."""
    return make_mesh(dict.fromkeys(AXES, 1), jax.devices()[:1])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
