"""`mbd-jax plan`: whether a model fits, and how fast it should step, on GPUs that are not here.

The engine's real decode and prefill programs are compiled for the target's topology
(engine/deviceless.py) and read back: per device, the parameters' and the KV pool's bytes (from
their shardings), XLA's argument / output / temporary bytes, the total against the device's
HBM and the budget, and the collectives the program runs. A decode step's time is modelled, not
measured: useful FLOPs (bench.step_flops) over the devices' peak matrix rate, and the bytes a step
must read (the parameters a step touches, the visible KV) over HBM bandwidth; the larger bound
names what binds. Left out: collectives' time, kernel efficiency (no autotuning without a device),
the host. A program too large for the device is compiled against an enlarged memory size and
reported as not fitting, with its numbers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax

from mbd_jax.bench import step_flops
from mbd_jax.config import ModelConfig
from mbd_jax.engine import deviceless
from mbd_jax.errors import UserError
from mbd_jax.model import sizes
from mbd_jax.parallel import mesh as meshlib

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
BF16 = 16  # xla.PrimitiveType of the matrix-unit rate used as the peak (the compute dtype's)
F32 = 11


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_flops: dict[int, float]  # matrix-unit FLOP/s per device, by xla.PrimitiveType


def target_facts(text: str) -> Target:
    """The numbers a target description gives (device_memory_size, memory_bandwidth, the
    matrix units' rate per element type: 2 FLOPs per multiply-add)."""
    def field(name: str) -> str:
        m = re.search(rf"^\s*{name}:\s*(.+)$", text, re.M)
        if m is None:
            raise UserError(f"target description: no field '{name}'")
        return m.group(1).strip().strip('"')

    cores = int(field("core_count"))
    matrix = text[text.index("matrix_unit_description"):] if "matrix_unit_description" in text \
        else ""
    peaks = {int(k): 2 * float(ghz) * 1e9 * int(units) * int(ops) * cores
             for k, ghz, units, ops in re.findall(
                 r"key:\s*(\d+)\s*value\s*{\s*clock_rate_ghz:\s*([\d.]+)\s*units_per_core:\s*(\d+)"
                 r"\s*ops_per_clock:\s*(\d+)", matrix)}
    return Target(field("name"), int(field("device_memory_size")),
                  float(field("memory_bandwidth")), peaks)


def program_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """What XLA says a compiled program holds per device (its total: what it needs at once)."""
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "aliased_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
            "total_bytes": total}


def gemm_operands(text: str) -> dict[str, int]:
    """The GEMM fusions of a compiled XLA:GPU program (its as_text()) counted by the narrowest
    element type among their operands: "s8" or "f8e4m3fn" where an 8-bit weight enters the GEMM
    as it is (the cast fused into the operand loads), "bf16" where only 16-bit operands do."""
    widths = {"s8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "f32": 4}
    params = dict(re.findall(r"^%([\w.\-]+) \((.*?)\) ->", text, re.M))
    counts: dict[str, int] = {}
    for called in re.findall(r'calls=%([\w.\-]+).*"kind":"__\w*gemm\w*"', text):
        types = [t for t in re.findall(r"\b([a-z]+\d+\w*)\[", params.get(called, ""))
                 if t in widths]
        if types:
            narrowest = min(types, key=lambda t: widths[t])
            counts[narrowest] = counts.get(narrowest, 0) + 1
    return counts


def _collectives(program: deviceless.Program) -> dict[str, int]:
    text = program.compiled.as_text()
    counts = {c: len(re.findall(rf"\b{c}(?:-start)?\(", text)) for c in COLLECTIVES}
    return {c: n for c, n in counts.items() if n}


def experts_hit(cfg: ModelConfig, batch: int, window: int) -> float:
    """The expected share of routed experts a decode step of `batch` rows x `window` tokens
    reads, routing taken as uniform: each token picks k of E; with block routing, each routing
    window of a row picks a pool of C of E and its tokens stay inside it (LLaDA2.2: 48 of 256
    per 32-token block against up to 256 for 32 tokens x 8 picks)."""
    if not cfg.num_experts:
        return 1.0
    if cfg.router_block_pool:
        windows = batch * -(-window // (cfg.router_block_window or cfg.block_size))
        return 1 - (1 - cfg.router_block_pool / cfg.num_experts) ** windows
    return 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** (batch * window)


def decode_step(cfg: ModelConfig, target: Target, n_devices: int, param_bytes: int, kv_bytes: int,
                batch: int, window: int, context: int, capacity: int) -> dict[str, Any]:
    """The modelled time of one decode forward (see the module docstring)."""
    flops = step_flops(cfg, batch, window, context)
    peak = target.peak_flops.get(BF16 if cfg.compute_dtype == "bfloat16" else F32, 0.0)
    compute_s = flops / (n_devices * peak) if peak else float("inf")
    # weights a step reads: every dense one, and of the routed experts those its tokens hit (the
    # expected share of distinct experts when each token picks k of E uniformly); the KV of the
    # visible positions
    total, active = sizes.num_params(cfg), sizes.active_params_per_token(cfg)
    routed = max(total - active, 0) / max(total, 1)
    hit = experts_hit(cfg, batch, window)
    read = param_bytes * ((1 - routed) + routed * hit) + kv_bytes * min(1.0, context / capacity)
    hbm_s = read / target.hbm_bytes_per_s
    return {"flops": flops, "bytes_read_per_device": int(read),
            "compute_ms": compute_s * 1e3, "hbm_ms": hbm_s * 1e3,
            "step_ms": max(compute_s, hbm_s) * 1e3,
            "bound": "compute" if compute_s >= hbm_s else "HBM bandwidth"}


def plan(cfg: ModelConfig, target: str, hosts: int, per_host: int, mesh_spec: str,
         shape: deviceless.EngineShape, context: int | None = None, budget: float = 0.9,
         say: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """The report of `mbd-jax plan` (the module docstring) as one JSON-ready dict."""
    facts = target_facts(deviceless.target_text(target))
    devices = deviceless.topology_devices(target, hosts, per_host)
    mesh = meshlib.make_mesh(meshlib.parse_mesh(mesh_spec or "data=1,expert=1,tensor=-1",
                                                len(devices)), devices)
    say(f"compiling for {len(devices)} x {facts.name} (mesh {dict(mesh.shape)}) ...")
    enlarged = False
    try:
        layout = deviceless.engine_layout(cfg, mesh, shape)
        programs = deviceless.compile_engine(cfg, mesh, shape)
    except Exception as e:  # noqa: BLE001 - XLA reports a program over the device's memory oddly
        if not deviceless.too_large(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"XLA:GPU could not compile the engine for {facts.name}: "
                            f"{first}") from None
        say("the program does not fit the device; compiling against 16x its memory to size it")
        enlarged = True
        devices = deviceless.topology_devices(target, hosts, per_host, memory_scale=16)
        mesh = meshlib.make_mesh(dict(mesh.shape), devices)
        layout = deviceless.engine_layout(cfg, mesh, shape)
        programs = deviceless.compile_engine(cfg, mesh, shape)
    report: dict[str, Any] = {
        "model": cfg.name, "target": facts.name, "devices": len(devices),
        "mesh": dict(mesh.shape), "hbm_bytes": facts.hbm_bytes, "budget": budget,
        **dataclasses.asdict(shape), "capacity": layout.capacity, "pages": layout.pages,
        "param_bytes_per_device": layout.param_bytes, "kv_bytes_per_device": layout.kv_bytes,
        "programs": {}}
    for name, program in programs.items():
        memory = program_memory(program.compiled)
        report["programs"][name] = {**memory, "hbm_share": memory["total_bytes"] / facts.hbm_bytes,
                                    "collectives": _collectives(program),
                                    "gemm_operands": gemm_operands(program.compiled.as_text())}
    peak = max(p["total_bytes"] for p in report["programs"].values())
    report["fits"] = not enlarged and peak <= budget * facts.hbm_bytes
    window = shape.buffer_size * cfg.block_size
    report["decode_step"] = decode_step(
        cfg, facts, len(devices), layout.param_bytes, layout.kv_bytes, shape.batch_size, window,
        min(context or cfg.max_seq_len, cfg.max_seq_len), layout.capacity)
    # rows that fit beside the rest, at this program's bytes per row of KV (linear in rows), and
    # the positions per row that fit at this batch (linear in positions)
    per_row = layout.kv_bytes / shape.batch_size
    spare = budget * facts.hbm_bytes - (peak - layout.kv_bytes)
    report["rows_that_fit"] = max(int(spare // per_row), 0) if per_row else None
    report["context_that_fits"] = max(int(spare / layout.kv_bytes * layout.capacity), 0) \
        if per_row else None
    report["prefill"] = prefill_cost(cfg, facts, len(devices), shape.prefill_chunk)
    return report


def prefill_cost(cfg: ModelConfig, target: Target, n_devices: int, chunk: int) -> dict[str, float]:
    """Useful FLOPs per prompt token of a prefill chunk (its keys: the chunk itself, block-causal
    at the prompt's start, counted whole), and the compute time per 1,000 tokens over every
    device's matrix units: a lower bound (prefill is compute bound long before decode is)."""
    per_token = step_flops(cfg, 1, chunk, chunk) / chunk
    peak = target.peak_flops.get(BF16 if cfg.compute_dtype == "bfloat16" else F32, 0.0)
    ms = 1e3 * 1000 * per_token / (n_devices * peak) if peak else float("inf")
    return {"flops_per_token": per_token, "compute_ms_per_1k_tokens": ms}


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def table(report: dict[str, Any]) -> str:
    """The report for a reader: memory per program, the modelled step, the verdict."""
    lines = [f"{report['model']} on {report['devices']} x {report['target']} "
             f"(mesh {report['mesh']}), batch {report['batch_size']}, N_buf "
             f"{report['buffer_size']}, {report['capacity']} positions per row",
             f"per device: parameters {_size(report['param_bytes_per_device'])}, "
             f"KV {_size(report['kv_bytes_per_device'])}",
             "| program | arguments | temporaries | total | of HBM | collectives | GEMMs by "
             "narrowest operand |",
             "|---|---|---|---|---|---|---|"]
    for name, p in report["programs"].items():
        coll = ", ".join(f"{c} x{n}" for c, n in p["collectives"].items()) or "none"
        gemms = ", ".join(f"{t} x{n}" for t, n in sorted(p["gemm_operands"].items())) or "none"
        lines.append(f"| {name} | {_size(p['argument_bytes'])} | {_size(p['temp_bytes'])} | "
                     f"{_size(p['total_bytes'])} | {100 * p['hbm_share']:.2f}% | {coll} | "
                     f"{gemms} |")
    s = report["decode_step"]
    lines.append(f"decode step (modelled, not measured): {s['step_ms']:.3f} ms, {s['bound']} "
                 f"bound (compute {s['compute_ms']:.3f} ms, HBM {s['hbm_ms']:.3f} ms; "
                 "collectives and kernel efficiency not modelled)")
    p = report["prefill"]
    lines.append(f"prefill (modelled): {p['flops_per_token'] / 1e9:.2f} GFLOP per prompt token, "
                 f"at least {p['compute_ms_per_1k_tokens']:.2f} ms per 1,000 tokens (compute)")
    verdict = "fits" if report["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict} within {100 * report['budget']:.0f}% of HBM; rows that fit at this "
                 f"context: {report['rows_that_fit']}; positions per row that fit at this batch: "
                 f"{report['context_that_fits']}")
    return "\n".join(lines)


def jax_for_planning() -> None:
    """Plans compile for devices that are not here: JAX must not look for a GPU driver."""
    jax.config.update("jax_platforms", "cpu")
