"""`mbd-jax plan` for the canvas family (DiffusionGemma): the canvas engine's real programs
(engine/canvas_programs.py: the denoising round, the commit, a prefill chunk) compiled for the
target's topology with no device here, their per-device memory read back, and the modelled
time of one canvas: `steps` decoder passes and its commit at the given batch and context.

A pass's time is the larger of its useful FLOPs over the devices' peak matrix rate and the
bytes it must read over HBM bandwidth (plan.py's model): the weights a pass touches (every
dense one; of the routed experts the expected share its tokens hit), the KV the program reads
(a global layer a row's whole page span, a sliding layer the pages of its window), the LM head
and the self-conditioning over the whole vocabulary at every canvas position. Collectives, kernel
efficiency and the host are left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mbd_jax import canvas_model, plan as mask_plan
from mbd_jax.config import Quantization
from mbd_jax.config.diffusion_gemma import STABILITY_LIMIT, CanvasDecoding, DiffusionGemmaConfig
from mbd_jax.decoding.canvas_loop import SAMPLER_ROWS, CanvasParams, start_canvas
from mbd_jax.engine import canvas_programs, deviceless
from mbd_jax.engine.canvas_programs import Layout
from mbd_jax.errors import UserError
from mbd_jax.model import diffusion_gemma as dg
from mbd_jax.parallel import mesh as meshlib

PAGE = canvas_programs.PAGE_SIZE  # the canvas engine's default


@dataclasses.dataclass(frozen=True)
class CanvasShape:
    batch_size: int = 1
    context: int = 32768  # positions per row the pool holds
    buffer_size: int = 2  # 2: each commit rides on the next canvas's first pass
    prefill_chunk: int = 256
    quantization: Quantization = "none"  # the weights: bf16, or 8-bit (int8 / fp8) with scales


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def compile_canvas(cfg: DiffusionGemmaConfig, mesh: jax.sharding.Mesh, shape: CanvasShape
                   ) -> tuple[dict[str, jax.stages.Compiled], dict[str, int]]:
    """({"round", "commit", "prefill"}: compiled programs, {param_bytes, kv_bytes} per
    device) of a canvas engine of `shape` on `mesh`."""
    cfg = dataclasses.replace(cfg, platform=meshlib.platform(mesh))
    b, c, per_row = shape.batch_size, cfg.canvas_length, -(-shape.context // PAGE)
    rep = meshlib.replicated(mesh)
    shapes = canvas_model.param_shapes(cfg, shape.quantization)
    params = _abstract(shapes, meshlib.tree_shardings(canvas_model.logical_axes(shapes), shapes,
                                                      mesh))
    pool = jax.eval_shape(lambda: dg.allocate_pool(cfg, b * per_row, PAGE))
    layout = Layout.of(pool, mesh)
    layers = [{n: jax.ShapeDtypeStruct(x[n].shape, x[n].dtype, sharding=s) for n in ("k", "v")}
              for x, s in zip(pool, layout.layers)]
    arr = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=rep)  # noqa: E731
    p = jax.tree.map(lambda x: arr(x.shape, x.dtype), CanvasParams.of([CanvasDecoding()] * b))
    st = jax.tree.map(lambda x: arr(x.shape, x.dtype), jax.eval_shape(
        lambda p: start_canvas(cfg, p, jnp.zeros(b, jnp.int32), jnp.ones(b, bool),
                               STABILITY_LIMIT), p))
    rows, flags, table = arr((b,), jnp.int32), arr((b,), jnp.bool_), arr((b, per_row), jnp.int32)
    commit = arr((b, c), jnp.int32)
    fused = commit if shape.buffer_size == 2 else None
    compiled = {
        "round": canvas_programs.denoise_round.lower(
            params, cfg, layout, p, st, layers, table, rows, rows, flags, flags, fused, flags,
            arr((), jnp.int32), SAMPLER_ROWS).compile(),
        "commit": canvas_programs.encode.lower(params, cfg, layout, layers, table, commit, rows,
                                               flags).compile(),
        "prefill": canvas_programs.encode.lower(
            params, cfg, layout, layers, arr((1, per_row), jnp.int32),
            arr((1, shape.prefill_chunk), jnp.int32), arr((1,), jnp.int32),
            arr((1,), jnp.bool_)).compile()}
    per_device = {"param_bytes": deviceless.per_device_bytes(params),
                  "kv_bytes": deviceless.per_device_bytes(layers)}
    return compiled, per_device


def _param_split(cfg: DiffusionGemmaConfig, quantization: Quantization = "none",
                 size=lambda x: math.prod(x.shape)) -> tuple[int, int, int]:
    """(all parameters, the routed experts', the embedding's), counted by `size` (default:
    elements; `_bytes` for bytes in their dtypes)."""
    shapes = canvas_model.param_shapes(cfg, quantization)
    total = sum(size(x) for x in jax.tree.leaves(shapes))
    experts = sum(size(x) for layer in shapes["layers"]
                  for x in jax.tree.leaves(layer["experts"]))
    return total, experts, size(shapes["embed"])


def _bytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _keys_read(cfg: DiffusionGemmaConfig, layer: int, context: int, tokens: int) -> int:
    """Cached positions a layer's attention reads (model/diffusion_gemma._span): a global
    layer the row's whole span, a sliding one the pages of its window when fewer."""
    window = (-(-(cfg.sliding_window - 1 + tokens) // PAGE) + 1) * PAGE
    sliding = cfg.layer_types[layer] == "sliding_attention"
    return min(window, context) if sliding else context


def pass_cost(cfg: DiffusionGemmaConfig, target: mask_plan.Target, n_devices: int,
              param_bytes: int, kv_bytes: int, batch: int, tokens: int, context: int,
              quantization: Quantization = "none") -> dict[str, Any]:
    """The modelled time of one forward of `tokens` per row (a canvas, or a canvas and the
    commit riding on it) at `context` cached positions (the module docstring)."""
    total, experts, embed = _param_split(cfg)
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    active = total - experts - embed + experts * k / e  # per token, the head counted apart
    d, v, n = cfg.hidden_size, cfg.vocab_size, batch * tokens
    attention = sum(4 * n * (_keys_read(cfg, i, context, tokens) + tokens) * cfg.num_heads
                    * cfg.head(i)[1] for i in range(cfg.num_layers))
    flops = 2 * active * n + attention + 2 * 2 * v * d * batch * cfg.canvas_length  # head, SC
    peak = target.peak_flops.get(mask_plan.BF16 if cfg.dtype == "bfloat16" else mask_plan.F32, 0)
    compute_s = flops / (n_devices * peak) if peak else float("inf")
    hit = 1 - (1 - k / e) ** n
    kv_read = kv_bytes * sum(_keys_read(cfg, i, context, tokens) * math.prod(cfg.head(i))
                             for i in range(cfg.num_layers)) / sum(
        context * math.prod(cfg.head(i)) for i in range(cfg.num_layers))
    all_bytes, expert_bytes, _ = _param_split(cfg, quantization, _bytes)
    routed = expert_bytes / all_bytes
    read = param_bytes * ((1 - routed) + routed * hit) + kv_read
    hbm_s = read / target.hbm_bytes_per_s
    return {"flops": flops, "bytes_read_per_device": int(read), "compute_ms": compute_s * 1e3,
            "hbm_ms": hbm_s * 1e3, "ms": max(compute_s, hbm_s) * 1e3,
            "bound": "compute" if compute_s >= hbm_s else "HBM bandwidth"}


def plan(cfg: DiffusionGemmaConfig, target: str, per_host: int, mesh_spec: str,
         shape: CanvasShape, steps: int = 16, budget: float = 0.9,
         say: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """The report of `mbd-jax plan` on a canvas model, one JSON-ready dict."""
    facts = mask_plan.target_facts(deviceless.target_text(target))
    devices = deviceless.topology_devices(target, 1, per_host)
    mesh = meshlib.make_mesh(meshlib.parse_mesh(mesh_spec or "data=1,expert=1,tensor=-1",
                                                len(devices)), devices)
    say(f"compiling the canvas engine for {len(devices)} x {facts.name} (mesh {dict(mesh.shape)})")
    enlarged = False
    try:
        programs, held = compile_canvas(cfg, mesh, shape)
    except Exception as e:  # noqa: BLE001 - XLA reports a program over the device's memory oddly
        if not deviceless.too_large(e):
            raise UserError(f"XLA:GPU could not compile the canvas engine for {facts.name}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else e}") from None
        say("the program does not fit the device; compiling against 16x its memory to size it")
        enlarged = True
        devices = deviceless.topology_devices(target, 1, per_host, memory_scale=16)
        mesh = meshlib.make_mesh(dict(mesh.shape), devices)
        programs, held = compile_canvas(cfg, mesh, shape)
    report: dict[str, Any] = {"model": cfg.name, "target": facts.name, "devices": len(devices),
                              "mesh": dict(mesh.shape), "hbm_bytes": facts.hbm_bytes,
                              "budget": budget, **dataclasses.asdict(shape),
                              "param_bytes_per_device": held["param_bytes"],
                              "kv_bytes_per_device": held["kv_bytes"], "programs": {}}
    for name, program in programs.items():
        memory = mask_plan.program_memory(program)
        report["programs"][name] = {**memory, "hbm_share": memory["total_bytes"] / facts.hbm_bytes}
    peak = max(p["total_bytes"] for p in report["programs"].values())
    report["fits"] = not enlarged and peak <= budget * facts.hbm_bytes
    cost = lambda tokens: pass_cost(cfg, facts, len(devices), held["param_bytes"],  # noqa: E731
                                    held["kv_bytes"], shape.batch_size, tokens, shape.context,
                                    shape.quantization)
    c = cfg.canvas_length
    step, first = cost(c), cost(2 * c if shape.buffer_size == 2 else c)
    commit = 0.0 if shape.buffer_size == 2 else cost(c)["ms"]
    canvas_ms = first["ms"] + (steps - 1) * step["ms"] + commit
    report["decoder_pass"] = step
    report["canvas"] = {"steps": steps, "ms": canvas_ms,
                        "tokens_per_s": shape.batch_size * c / canvas_ms * 1e3}
    return report


def table(report: dict[str, Any]) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [f"{report['model']} on {report['devices']} x {report['target']} mesh "
             f"{report['mesh']}: batch {report['batch_size']}, context {report['context']}, "
             f"buffer_size {report['buffer_size']}, weights {report['quantization']}",
             f"  parameters {gib(report['param_bytes_per_device'])} / device, KV pool "
             f"{gib(report['kv_bytes_per_device'])} / device"]
    for name, p in report["programs"].items():
        lines.append(f"  {name:8s} {gib(p['total_bytes'])} ({p['hbm_share']:.0%} of HBM)")
    s, cv = report["decoder_pass"], report["canvas"]
    lines.append(f"  decoder pass {s['ms']:.2f} ms ({s['bound']}); a canvas of {cv['steps']} "
                 f"passes + commit {cv['ms']:.1f} ms, {cv['tokens_per_s']:.0f} tokens/s")
    lines.append("  fits" if report["fits"] else "  DOES NOT FIT within the budget")
    return "\n".join(lines)
