"""8-bit weights: the quantization schemes, and the pure functions that quantize a weight and
read it back.

A quantized weight is two parameters: `name` in 8 bits and `name_scale` in float32, one scale
per output channel. The scale has the weight's shape with size 1 on the axes a matmul contracts
(the input channels), so it broadcasts against the weight and its logical axis names are the
weight's with None there: the mesh rules shard it with the weight's output channels (expert,
tensor), and a reader can tell the contracted axes from the shape alone (quantize_tree).

Scales are absmax: each output channel's largest magnitude maps to the format's largest value.
int8 rounds to integers in [-127, 127] (symmetric: -128 unused); fp8 is e4m3 (float8_e4m3fn,
largest finite 448), which keeps 3 mantissa bits at every magnitude. The model reads a weight as
q * scale in its compute dtype (model/params.py): XLA fuses that into the matmul's operand, so
the weights stay 8-bit in device memory.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mbd_jax.config import Quantization

SCALE_SUFFIX = "_scale"


@dataclasses.dataclass(frozen=True)
class Scheme:
    dtype: Any  # the stored weight's dtype
    max: float  # the largest magnitude it holds
    integer: bool  # values are rounded to integers (int8); fp8's cast rounds to its own grid


SCHEMES: dict[str, Scheme] = {
    "int8": Scheme(jnp.int8, 127.0, True),
    "fp8": Scheme(jnp.float8_e4m3fn, 448.0, False),
}
assert set(SCHEMES) == set(typing.get_args(Quantization)) - {"none"}


class Quantized(NamedTuple):
    """A quantized weight as a layer reads it: the 8-bit values and their float32 scales (one
    per output channel; for a projection shaped like its output axes, for stacked experts
    [E, 1, out])."""
    q: jax.Array
    scale: jax.Array


def scale_shape(shape: tuple[int, ...], contract: tuple[int, ...]) -> tuple[int, ...]:
    """The scale of a weight of `shape` whose `contract` axes a matmul contracts."""
    return tuple(1 if i in contract else n for i, n in enumerate(shape))


def quantize(w: jax.Array, scheme: str, contract: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """w: any float array -> (q in the scheme's dtype, w's shape; scale float32,
    scale_shape(w.shape, contract)), with q * scale ~ w."""
    s = SCHEMES[scheme]
    w32 = jnp.asarray(w).astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=contract, keepdims=True)
    scale = jnp.where(amax > 0, amax / s.max, 1.0)
    x = w32 / scale
    if s.integer:
        x = jnp.round(x)
    return jnp.clip(x, -s.max, s.max).astype(s.dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """q * scale in `dtype` (the model's compute dtype)."""
    return q.astype(dtype) * scale.astype(dtype)


def quantize_tree(params: Any, target: Any, shardings: Any = None) -> Any:
    """Float parameters -> the quantized tree `target` describes (ShapeDtypeStructs, e.g.
    param_shapes of a quantized config, in the same layout as `params`): every weight with a
    `_scale` beside it in `target` is quantized over the axes where that scale has size 1, the
    rest are kept. One weight at a time (each float weight may be freed as it goes), placed with
    `shardings` (a tree like `target`; None: default placement)."""
    out = {}
    for name, want in target.items():
        if isinstance(want, dict):
            out[name] = quantize_tree(params[name], want,
                                      None if shardings is None else shardings[name])
        elif name.endswith(SCALE_SUFFIX):
            continue
        elif name + SCALE_SUFFIX in target:
            scale = target[name + SCALE_SUFFIX]
            contract = tuple(i for i, n in enumerate(scale.shape) if n == 1)
            scheme = next(k for k, s in SCHEMES.items() if jnp.dtype(s.dtype) == want.dtype)
            out_sh = None if shardings is None else (shardings[name],
                                                     shardings[name + SCALE_SUFFIX])
            out[name], out[name + SCALE_SUFFIX] = _quantize_jit(scheme, contract, out_sh)(
                params[name])
        else:
            out[name] = params[name]
    return out


@functools.cache
def _quantize_jit(scheme: str, contract: tuple[int, ...], out_shardings: Any):
    return jax.jit(lambda w: quantize(w, scheme, contract), out_shardings=out_shardings)
