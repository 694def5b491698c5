"""How the layers run, and the parameter layout that follows from it.

Canonical layout: one subtree per layer, `layer_{i}`. Model directories store it, conversion
fills it, and the unrolled forward reads it.

Scanned layout: the forward runs one `nn.scan` per run of identical layers (same kind: token
mixer and MLP, ModelConfig.layer_kind), so XLA compiles one layer per run and compile time stays
flat in depth. Its tree holds one subtree per run, `layers_{start}_{stop}`, each leaf the layer
leaves stacked on a leading axis (logical axis name "layers").

Which one runs is `ModelConfig.layer_loop`; `auto` is per backend (config.AUTO): XLA:CPU copies
each scanned iteration's whole weight slice (all experts of a MoE layer) before use, so CPU runs
unrolled; GPU and TPU scan (docs/lab/performance-history.md has both sides of the CPU measurement).

Per-expert weights: for the same reason XLA:CPU copies one expert's slice of a stacked
[E, D, F] weight before each GEMM that reads it. An engine running the looped expert path on one
CPU device therefore keeps each routed expert's weights as arrays of their own (split_experts: a
tuple of E arrays in place of each stacked leaf), which the looped path reads in place
(model/moe.py). Only engines do this; checkpoints, conversion and training keep the stacked form.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig, resolve_auto
from mbd_jax.model import moe, quantize

# Every MoE layer runs a `lax.switch` with a branch per expert over per-expert weights, so the
# program grows with the expert count; past this many experts the stacked form stays.
SPLIT_EXPERTS_MAX = 64


def resolve_loop(name: str, backend: str | None = None) -> str:
    """The layer loop `name` stands for on `backend` (config.AUTO)."""
    return resolve_auto("layer_loop", name, backend)


def scanned(cfg: ModelConfig) -> bool:
    return resolve_loop(cfg.layer_loop, cfg.platform) == "scan"


def canonical(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the unrolled loop: its parameter tree is the canonical layout."""
    return dataclasses.replace(cfg, layer_loop="unrolled")


def runs(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[start, stop) of each maximal run of consecutive layers of the same kind."""
    out, start = [], 0
    for i in range(1, cfg.num_layers + 1):
        if i == cfg.num_layers or cfg.layer_kind(i) != cfg.layer_kind(start):
            out.append((start, i))
            start = i
    return out


def run_name(start: int, stop: int) -> str:
    return f"layers_{start}_{stop}"


def is_stacked(path: tuple) -> bool:
    """Whether the parameter at this key path (jax.tree_util's) lives in a scanned run, i.e. has
    a leading layer axis."""
    return any(str(getattr(k, "key", k)).startswith("layers_") for k in path)


def to_runtime(params: dict, cfg: ModelConfig) -> dict:
    """Canonical params -> the layout `cfg`'s forward reads (a new tree; traceable)."""
    if not scanned(cfg):
        return params
    out = {k: v for k, v in params.items() if not k.startswith("layer_")}
    for start, stop in runs(cfg):
        layers = [params[f"layer_{i}"] for i in range(start, stop)]
        out[run_name(start, stop)] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return out


def to_canonical(params: dict, cfg: ModelConfig) -> dict:
    """The runtime layout of `cfg` -> canonical params (a new tree; traceable)."""
    if not scanned(cfg):
        return params
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    for start, stop in runs(cfg):
        stacked = params[run_name(start, stop)]
        for i in range(start, stop):
            out[f"layer_{i}"] = jax.tree.map(lambda x, j=i - start: x[j], stacked)
    return out


def convert(params: Any, cfg: ModelConfig, fn, shardings: Any = None) -> Any:
    """Applies to_runtime / to_canonical as one compiled program (out_shardings: the target's);
    a no-op without a scan. The source and the result are both alive until it returns."""
    if not scanned(cfg):
        return params
    return jax.jit(lambda p: fn(p, cfg), out_shardings=shardings)(params)


def relayout(params: Any, src: ModelConfig, dst: ModelConfig) -> Any:
    """Params in `src`'s runtime layout -> `dst`'s (same weights; benches comparing loops)."""
    if scanned(src) == scanned(dst):
        return params
    return jax.jit(lambda p: to_runtime(to_canonical(p, src), dst))(params)


def splits_experts(cfg: ModelConfig, mesh, moe_impl: str | None = None) -> bool:
    """Whether an engine of `cfg` on `mesh` running expert path `moe_impl` (default: cfg's) keeps
    per-expert weights (the module docstring): the looped path, unrolled layers, one CPU device,
    at most SPLIT_EXPERTS_MAX experts."""
    return (0 < cfg.num_experts <= SPLIT_EXPERTS_MAX and not scanned(cfg) and mesh.size == 1
            and mesh.devices.flat[0].platform == "cpu"
            and moe.resolve_impl(moe_impl or cfg.moe_impl, "cpu") == "looped")


def split_experts(params: Any) -> Any:
    """Each stacked routed-expert leaf [E, ...] (a quantized weight's scale too) -> a tuple of E
    arrays (copies)."""
    def split(path, x):
        name = str(getattr(path[-1], "key", path[-1])).removesuffix(quantize.SCALE_SUFFIX)
        return tuple(jnp.unstack(x)) if name in moe.EXPERT_WEIGHTS else x
    return jax.tree_util.tree_map_with_path(split, params)


def stack_experts(params: Any) -> Any:
    """The inverse of split_experts: each per-expert tuple -> one stacked array (a copy)."""
    return jax.tree.map(moe.stacked, params, is_leaf=lambda x: isinstance(x, tuple))
