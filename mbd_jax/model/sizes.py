"""A model's size, counted from its parameters' shapes (one abstract init: nothing allocated),
so every layer kind counts without a formula of its own."""

from __future__ import annotations

import dataclasses
import math

import jax

from mbd_jax.config import ModelConfig
from mbd_jax.model.transformer import param_logical_axes, param_shapes


def _sizes(cfg: ModelConfig) -> list[tuple[int, bool]]:
    """(size, is a routed expert's weight) of every parameter. Counted in the scanned layout
    (the same parameters, and a trace of each distinct layer once), unquantized (a quantized
    weight's scales are not parameters of the model)."""
    scanned = dataclasses.replace(cfg, layer_loop="scan", quantization="none")
    shapes = jax.tree.leaves(param_shapes(scanned))
    axes = jax.tree.leaves(param_logical_axes(scanned),
                           is_leaf=lambda x: isinstance(x, tuple))
    return [(math.prod(s.shape), "expert" in a and "mlp" in a) for s, a in zip(shapes, axes)]


def num_params(cfg: ModelConfig) -> int:
    return sum(size for size, _ in _sizes(cfg))


def active_params_per_token(cfg: ModelConfig) -> int:
    """Parameters a token touches: the routed experts count num_experts_per_tok of num_experts
    (the shared experts, the router and everything else in full)."""
    share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    return round(sum(size * (share if routed else 1) for size, routed in _sizes(cfg)))
