"""How the model's layers declare parameters: logical axis names on every one (mapped to mesh
axes by parallel/mesh.py), weight matrices drawn later in groups (init_params) and stored in 8
bits when the config quantizes them, and RMSNorm weights in the checkpoint's convention."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig
from mbd_jax.model import quantize
from mbd_jax.model.quantize import Quantized


class Normal(nn.LogicallyPartitioned):
    """A parameter to be drawn from N(0, init_std^2): `model.init` leaves it at zero and
    draw_normals draws every such parameter of one shape in one random call."""


NORMAL = object()  # the initializer of weight matrices: N(0, init_std^2), drawn by init_params


def param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
          init: Any) -> jax.Array:
    """A parameter of `module` (which has a `cfg`) carrying logical axis names."""
    cfg: ModelConfig = module.cfg
    if init is NORMAL:
        boxed = lambda key, shape, dtype: Normal(jnp.zeros(shape, dtype), axes)  # noqa: E731
    else:
        boxed = nn.with_logical_partitioning(init, axes)
    return module.param(name, boxed, shape, jnp.dtype(cfg.param_dtype))


def weight(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
           contract: tuple[int, ...]) -> jax.Array | Quantized:
    """A weight matrix (drawn N(0, init_std^2)) that project() contracts over its leading
    `contract` axes. With cfg.quantization it is stored in 8 bits beside a float32 `name`_scale
    (model/quantize.py) and read as a Quantized pair."""
    cfg: ModelConfig = module.cfg
    if cfg.quantization == "none":
        return param(module, name, shape, axes, NORMAL)
    assert contract == tuple(range(len(contract))), "project() scales the trailing axes"
    q, scale = _quantized(module, name, shape, axes, contract)
    return Quantized(q, scale.reshape(shape[len(contract):]))


def project(spec: str, x: jax.Array, w: jax.Array | Quantized, dtype: Any,
            **kwargs: Any) -> jax.Array:
    """einsum(spec, x, w) in `dtype`, for a weight from weight() whose output axes end the
    result. A Quantized weight's 8-bit values enter the matmul as they are (cast to `dtype`;
    XLA:GPU's Triton GEMM fuses that cast into its operand loads, so no dequantized copy of the
    weight is made) and the per-channel scale multiplies the product."""
    if not isinstance(w, Quantized):
        return jnp.einsum(spec, x, w.astype(dtype), **kwargs)
    out = jnp.einsum(spec, x, w.q.astype(dtype), **kwargs)
    return out * w.scale.astype(out.dtype)


def _quantized(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
               contract: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The stored (8-bit weight, float32 scale) pair; both zero-initialised (a quantized model is
    drawn as a float one and then quantized: init_params)."""
    scheme = quantize.SCHEMES[module.cfg.quantization]
    scale_axes = tuple(None if i in contract else a for i, a in enumerate(axes))
    q = module.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape,
                     scheme.dtype)
    scale = module.param(name + quantize.SCALE_SUFFIX,
                         nn.with_logical_partitioning(nn.initializers.ones, scale_axes),
                         quantize.scale_shape(shape, contract), jnp.float32)
    return q, scale


def expert_weight(module: nn.Module, name: str, shape: tuple[int, ...],
                  axes: tuple[str, ...]) -> Any:
    """A routed-expert weight [E, in, out]: the stacked parameter (a Quantized pair, scale
    [E, 1, out], when quantized: the expert paths read it, moe.py), or the tuple of per-expert
    arrays an engine on one CPU device keeps in its place (model/layout.py, split_experts; a
    quantized weight's scale is split the same way and each expert dequantized here)."""
    scale_name = name + quantize.SCALE_SUFFIX
    if module.has_variable("params", name):
        stored = module.get_variable("params", name)
        if isinstance(stored, tuple):
            if module.cfg.quantization == "none":
                return stored
            scales = module.get_variable("params", scale_name)
            return tuple(quantize.dequantize(q, s, module.cfg.compute_dtype)
                         for q, s in zip(stored, scales))
    if module.cfg.quantization == "none":
        return param(module, name, shape, axes, NORMAL)
    return Quantized(*_quantized(module, name, shape, axes, (1,)))


def norm_weight(module: nn.Module, name: str, dim: int, axes: tuple[str, ...]) -> jax.Array:
    """The weight an RMSNorm multiplies by: the parameter itself, or 1 + it when the model stores
    norm weights as an offset from one (cfg.norm_weight_offset; stored zeros are then ones)."""
    if module.cfg.norm_weight_offset:
        return 1.0 + param(module, name, (dim,), axes, nn.initializers.zeros).astype(jnp.float32)
    return param(module, name, (dim,), axes, nn.initializers.ones)


def draw_normals(boxed: Any, key: jax.Array, std: float, flat: bool) -> Any:
    """`boxed` with every Normal parameter drawn from N(0, std^2): one random draw of
    [n, *shape] per distinct (shape, dtype), split across the n parameters of that shape.

    XLA's CPU compiler spends 0.3-1 s per random call (10 s for the 3-layer tiny preset drawn per
    parameter), so grouping cuts init's compile time about 3x (the draws no longer grow with
    depth; the rest of init still does). `flat` draws each group as one 1-D array (cheaper still
    to compile) and reshapes it: the values are the same (threefry counters run over the
    flattened index), but a 1-D draw cannot be split the way the parameters are sharded, so a
    multi-device mesh draws the [n, *shape] form."""
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    leaves, tree = jax.tree.flatten(boxed, is_leaf=is_box)
    groups: dict[tuple, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Normal):
            groups.setdefault((leaf.value.shape, leaf.value.dtype), []).append(i)
    for ((shape, dtype), index), k in zip(groups.items(),
                                          jax.random.split(key, max(len(groups), 1))):
        group_shape = (len(index), *shape)
        draws = jax.random.normal(k, (math.prod(group_shape),) if flat else group_shape)
        draws = (std * draws).reshape(group_shape).astype(dtype)
        for n, i in enumerate(index):
            leaves[i] = leaves[i].replace_boxed(draws[n])
    return jax.tree.unflatten(tree, leaves)
