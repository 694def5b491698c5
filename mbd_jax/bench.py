"""Decode benchmark: tokens/s, TPF, step latency, compile time, memory, and model-FLOP utilisation.

Every buffer size runs on the same prompts in one process; compare variants as ratios within a run.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax import compile_stats
from mbd_jax.config import DecodeConfig, ModelConfig
from mbd_jax.engine import Engine
from mbd_jax.model import layout, sizes


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Measured dense float32 matmul throughput of the default device, GFLOP/s (median)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


def step_flops(cfg: ModelConfig, batch: int, window: int, context: float) -> float:
    """Useful model FLOPs of one decode forward: 2 x active (non-embedding) parameters per token,
    plus, per attention layer, scores and values over `context` visible keys, and per
    linear-attention layer the delta rule's state work (decay, read, correction, write: about
    6 x Hv x Dk x Dv per token, whatever the context) (routed experts only)."""
    per_token = 2 * (sizes.active_params_per_token(cfg) - cfg.vocab_size * cfg.hidden_size)
    if cfg.tie_word_embeddings:  # the head reuses the embedding table
        per_token += 2 * cfg.vocab_size * cfg.hidden_size
    linear = cfg.count_layers("linear_attention")
    attn = 4 * context * cfg.num_heads * cfg.head_dim * (cfg.num_layers - linear)
    if linear:
        sm = cfg.sequence_module
        attn += 6 * sm.num_value_heads * sm.key_head_dim * sm.value_head_dim * linear
    return batch * window * (per_token + attn)


def peak_memory_mb() -> float:
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # host RSS (Linux: KiB)


def _timed_runs(engine: Engine, prompts: list[list[int]], d: DecodeConfig, repeats: int
                ) -> tuple[list[float], ...]:
    """`repeats` generate calls: (decode step seconds, tokens/s, TPF, NFE, bubble share,
    seconds) per run (step seconds: one per decode step of every run)."""
    step_times, tok_s, tpf, nfe, bubbles, gen_s = [], [], [], [], [], []
    for _ in range(repeats):
        before = engine.stats()
        t = time.perf_counter()
        res = engine.generate(prompts, d)
        dt = time.perf_counter() - t
        gen_s.append(dt)
        tok_s.append(sum(len(r.token_ids) for r in res) / dt)
        tpf.append(statistics.mean(r.tpf for r in res))
        nfe.append(statistics.mean(r.nfe for r in res))
        bubbles.append(sum(r.bubble_forwards for r in res) / max(sum(r.nfe for r in res), 1))
        step_times += [s / k for s, k in engine.stats().calls_since(before) if k > 0]
    return step_times, tok_s, tpf, nfe, bubbles, gen_s


def bench_decode(cfg: ModelConfig, params: Any, *, batch: int, prompt_len: int, new_tokens: int,
                 buffer_sizes: list[int], decode: DecodeConfig, repeats: int, seed: int = 0,
                 prefill_chunk: int = 256, moe_impls: list[str] | None = None,
                 layer_loops: list[str] | None = None, attention_impls: list[str] | None = None,
                 mesh=None, progress=None) -> dict[str, Any]:
    """Every (expert path, layer loop, attention, buffer size) on the same prompts, in this process, on
    `mesh`; `params` are in `cfg`'s layout; `progress` (a callable taking a message) hears about
    each variant as it starts."""
    rng = np.random.default_rng(seed)
    banned = {cfg.mask_token_id, *cfg.eos_token_ids}
    allowed = np.array([i for i in range(cfg.vocab_size) if i not in banned], np.int32)
    prompts = [rng.choice(allowed, prompt_len).tolist() for _ in range(batch)]
    gflops = matmul_gflops()
    rows = []
    variants = [(impl, loop, att, n) for impl in (moe_impls or [cfg.moe_impl])
                for loop in (layer_loops or [cfg.layer_loop])
                for att in (attention_impls or [cfg.attention_impl]) for n in buffer_sizes]
    base_cfg = cfg
    for i, (impl, loop, att, n_buf) in enumerate(variants):
        if progress is not None:
            progress(f"variant {i + 1}/{len(variants)}: moe_impl {impl}, layer loop {loop}, "
                     f"attention {att}, N_buf {n_buf} (compile, then {repeats} timed runs)")
        cfg = dataclasses.replace(base_cfg, moe_impl=impl, layer_loop=loop, attention_impl=att)
        d = dataclasses.replace(decode, buffer_size=n_buf, max_new_tokens=new_tokens,
                                ignore_eos=True)  # every row decodes new_tokens
        variant_params = layout.relayout(params, base_cfg, cfg)
        c0, s0 = compile_stats.compiles(), compile_stats.compile_seconds()
        t0 = time.perf_counter()
        engine = Engine(cfg, variant_params, batch_size=batch, buffer_size=n_buf,
                        prefill_chunk=prefill_chunk, mesh=mesh)
        engine.warmup(progress)
        warm_s = time.perf_counter() - t0
        compiles_warm = compile_stats.compiles() - c0
        compile_s = compile_stats.compile_seconds() - s0
        c1 = compile_stats.compiles()
        step_times, tok_s, tpf, nfe, bubbles, gen_s = _timed_runs(engine, prompts, d, repeats)
        step = statistics.median(step_times)
        context = prompt_len + new_tokens / 2  # mean visible keys over the run
        flops = step_flops(cfg, batch, n_buf * cfg.block_size, context)
        rows.append({
            "moe_impl": impl,
            "moe_paths": engine.moe_paths,  # the path each decode program ran (measure: timed)
            "experts_split": engine.experts_split,  # per-expert weights (model/layout.py)
            "layer_loop": layout.resolve_loop(loop, engine.cfg.platform),
            "attention_impl": att,
            "buffer_size": n_buf,
            "tokens_per_s": statistics.median(tok_s),
            "tpf": statistics.median(tpf),
            "nfe": statistics.median(nfe),
            "bubble_share": statistics.median(bubbles),
            "step_ms": step * 1e3,
            "generate_s": statistics.median(gen_s),
            "compile_s": compile_s,
            "warmup_s": warm_s,
            "compiles_warmup": compiles_warm,
            "compiles_after_warmup": compile_stats.compiles() - c1,
            "step_gflop": flops / 1e9,
            "achieved_gflops": flops / step / 1e9,
            "utilisation": flops / step / 1e9 / gflops,
            "peak_memory_mb": peak_memory_mb(),
            "kv_mb": engine.stats().kv_bytes / 2**20,
        })
    return {
        "model": base_cfg.name, "params": sizes.num_params(base_cfg),
        "active_params": sizes.active_params_per_token(base_cfg),
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
        "decode": dataclasses.asdict(decode), "device": str(jax.devices()[0].device_kind),
        "backend": engine.mesh.devices.flat[0].platform, "matmul_gflops": gflops, "rows": rows,
        "mesh": dict(engine.mesh.shape), "devices": engine.mesh.size,
    }


def format_table(report: dict[str, Any]) -> str:
    head = (f"{report['model']} ({report['params'] / 1e6:.1f}M params, "
            f"{report['active_params'] / 1e6:.1f}M active), batch {report['batch']}, prompt "
            f"{report['prompt_len']}, new {report['new_tokens']}, {report['backend']}, matmul "
            f"{report['matmul_gflops']:.0f} GFLOP/s, mesh "
            f"{','.join(f'{k}={v}' for k, v in report['mesh'].items())}")
    cols = ["moe_impl", "layer_loop", "attention_impl", "buffer_size", "tokens_per_s", "tpf", "bubble_share", "step_ms", "compile_s",
            "achieved_gflops", "utilisation", "peak_memory_mb", "compiles_after_warmup"]
    lines = [head, " ".join(f"{c:>14}" for c in cols)]
    for r in report["rows"]:
        lines.append(" ".join(f"{r[c]:>14.4g}" if isinstance(r[c], float) else f"{r[c]:>14}"
                              for c in cols))
    return "\n".join(lines)
