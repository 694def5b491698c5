"""The engine's GPU programs compile, on this CPU machine: decode and prefill of a tiny MoE preset
(on the chunked attention loop and on the Pallas kernel; with bf16, int8 and fp8 weights) and a
tiny MoE hybrid, for an 8 x H200
topology with `expert` and `tensor` axes, through XLA:GPU's whole pipeline
(engine/deviceless.py). Runs in its own process: the CUDA plugin lives
in .venv/gpu-compile (`make test` installs it), outside this process's JAX."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.live_server import ROOT

PLUGIN_DIR = ROOT / ".venv" / "gpu-compile"

SCRIPT = r"""
import dataclasses, json, re, time
from mbd_jax import plan
from mbd_jax.config import load_model_config
from mbd_jax.config.paths import MODEL_PRESET_DIR
from mbd_jax.engine import deviceless
from mbd_jax.parallel import mesh as meshlib

devices = deviceless.topology_devices("h200", hosts=1, per_host=8)
mesh = meshlib.make_mesh({"data": 1, "expert": 4, "tensor": 2}, devices)
out = {"device_kind": devices[0].device_kind, "platform": devices[0].platform}
# (preset, attention, weights: the preset's, or bf16 / int8 / fp8 for the quantization checks)
for preset, attention, weights in (("tiny-moe", "chunked", None),
                                   ("tiny-moe-hybrid-causal", "chunked", None),
                                   ("tiny-moe", "pallas", None), ("tiny-moe", "chunked", "bf16"),
                                   ("tiny-moe", "chunked", "int8"), ("tiny-moe", "chunked", "fp8"),
                                   ("tiny-moe", "pallas", "int8")):
    cfg = dataclasses.replace(load_model_config(MODEL_PRESET_DIR / f"{preset}.yaml"),
                              moe_impl="auto",  # the preset fixes tiled for training
                              attention_impl=attention)
    if weights is not None:
        scheme = "none" if weights == "bf16" else weights  # the weights and the KV pool
        cfg = dataclasses.replace(cfg, param_dtype="bfloat16", compute_dtype="bfloat16",
                                  quantization=scheme, kv_quantization=scheme)
    preset += "" if attention == "chunked" else f" {attention}"
    preset += "" if weights is None else f" {weights}"
    shape = deviceless.EngineShape(batch_size=4, buffer_size=2, prefill_chunk=64)
    layout = deviceless.engine_layout(cfg, mesh, shape)
    for name, program in deviceless.compile_engine(cfg, mesh, shape).items():
        text, memory = program.compiled.as_text(), program.compiled.memory_analysis()
        out[f"{preset} {name}"] = {
            "collectives": sorted(set(re.findall(
                r"\b(all-reduce|all-gather|all-to-all|reduce-scatter)(?:-start)?\(", text))),
            "ragged_dot": "ragged" in text, "triton": "__triton" in text,
            "collective_counts": {c: len(re.findall(rf"\b{c}(?:-start)?\(", text)) for c in (
                "all-reduce", "all-gather", "all-to-all", "reduce-scatter")},
            "kernel_calls": len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', text)),
            "kernel_named": "paged_block_causal_attention" in text,
            "gemm_operands": plan.gemm_operands(text), "param_bytes": layout.param_bytes,
            "kv_bytes": layout.kv_bytes,
            "argument_bytes": memory.argument_size_in_bytes, "input_bytes": program.input_bytes,
            "temp_bytes": memory.temp_size_in_bytes}
print(json.dumps(out))
"""


CANVAS_SCRIPT = r"""
import json, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from mbd_jax import canvas_model
from mbd_jax.config.diffusion_gemma import CanvasDecoding
from mbd_jax.decoding import canvas_loop
from mbd_jax.engine import deviceless
from mbd_jax.model import diffusion_gemma as dg
from mbd_jax.parallel import mesh as meshlib

devices = deviceless.topology_devices("h200", hosts=1, per_host=1)
one = NamedSharding(meshlib.make_mesh({"data": 1, "expert": 1, "tensor": 1}, devices), P())
on_gpu = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), t)
cfg, b = canvas_model.load("tiny-dgemma", with_weights=False).cfg, 4
p = canvas_loop.CanvasParams.of([CanvasDecoding()] * b)
st = canvas_loop.start_canvas(cfg, p, jnp.zeros(b, jnp.int32), jnp.zeros(b, bool), 1)
out = {"platform": devices[0].platform, "device_kind": devices[0].device_kind}
for name, commit in (("denoise", None), ("denoise+commit", jnp.zeros((b, cfg.canvas_length), jnp.int32))):
    step = jax.jit(lambda params, p, st, cache, at, commit: canvas_loop.denoise(
        params, cfg, p, st, cache, at, commit))
    c = step.lower(on_gpu(canvas_model.param_shapes(cfg)), on_gpu(p), on_gpu(st),
                   on_gpu(dg.allocate_cache(cfg, b, 128)), on_gpu(jnp.zeros(b, jnp.int32)),
                   None if commit is None else on_gpu(commit)).compile()
    out[name] = {"triton": "__triton" in c.as_text(), "while": "while" in c.as_text(),
                 "temp_bytes": c.memory_analysis().temp_size_in_bytes}
print(json.dumps(out))
"""


def compiled(script: str = SCRIPT) -> dict:
    """What `script` (default: SCRIPT) reports of each compiled program."""
    assert (PLUGIN_DIR / "jax_plugins").is_dir(), "run `make test` (it installs .venv/gpu-compile)"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{PLUGIN_DIR}{os.pathsep}{ROOT}")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_decode_and_prefill_compile_for_an_h200_mesh():
    out = compiled()
    assert out["platform"] == "gpu" and "H200" in out["device_kind"]
    for preset in ("tiny-moe", "tiny-moe-hybrid-causal"):
        for name in ("decode", "prefill"):
            p = out[f"{preset} {name}"]
            # the GPU program: grouped-matmul experts (the CPU one loops over experts) and
            # Triton fusions (XLA:GPU's)
            assert p["ragged_dot"] and p["triton"], (preset, name, p)
            # tensor parallel sums partial products
            assert "all-reduce" in p["collectives"], (preset, name, p)
            assert 0 < p["temp_bytes"] < 64 << 20, (preset, name, p)
        # every input held as its sharding says (prefill reads no output head: jit drops it)
        decode, prefill = out[f"{preset} decode"], out[f"{preset} prefill"]
        assert decode["argument_bytes"] == decode["input_bytes"], decode
        assert 0.9 * prefill["input_bytes"] < prefill["argument_bytes"] < prefill["input_bytes"]
    # no all-to-all in the attention model's step: the expert shards combine by all-reduce
    # (parallel/expert.py) and the sampler's top-k / top-p cut the split vocabulary by
    # reductions (the sort they replaced was the all-to-all once seen here; the hybrid's come
    # from its linear-attention layers' head concatenation)
    assert out["tiny-moe decode"]["collective_counts"]["all-to-all"] == 0, out["tiny-moe decode"]

    # attention_impl: pallas puts the Triton kernel in both programs, per shard (its kv heads
    # split on `tensor` like the pool, so it adds no collective), and leaves the rest as it was
    for name in ("decode", "prefill"):
        kernel, loop = out[f"tiny-moe pallas {name}"], out[f"tiny-moe {name}"]
        assert kernel["kernel_named"] and kernel["kernel_calls"] >= 1, kernel
        assert not loop["kernel_named"] and loop["kernel_calls"] == 0, loop
        assert kernel["collective_counts"] == loop["collective_counts"], (kernel, loop)
        assert kernel["argument_bytes"] == loop["argument_bytes"], (kernel, loop)
        assert 0 < kernel["temp_bytes"] < 64 << 20, kernel


    # 8-bit weights and KV pool (int8, fp8) against the same model in bf16: the parameters take
    # about half the bytes (embeddings, norms and routers stay bf16), the pool (Dh + 4) / 2Dh
    # (a float32 scale per vector; Dh 32 here), and the programs hold both as stored (the
    # argument bytes drop by as much), make no dequantized copy of the weights, and the GEMMs
    # take the 8-bit weights as operands (the cast fused into the Triton GEMM's loads; the
    # experts' ragged_dot scales each row's product by its expert's scales)
    for scheme, eight_bit in (("int8", "s8"), ("fp8", "f8e4m3fn")):
        for name in ("decode", "prefill"):
            q, ref = out[f"tiny-moe {scheme} {name}"], out[f"tiny-moe bf16 {name}"]
            assert q["param_bytes"] < 0.6 * ref["param_bytes"], (scheme, q, ref)
            assert q["kv_bytes"] < 0.65 * ref["kv_bytes"], (scheme, q, ref)
            assert (ref["argument_bytes"] - q["argument_bytes"] == ref["param_bytes"]
                    - q["param_bytes"] + ref["kv_bytes"] - q["kv_bytes"]), (scheme, name, q, ref)
            # a dequantized copy of the weights would add twice what they save; the scales'
            # gathers of the grouped matmul add far less
            saved = ref["param_bytes"] - q["param_bytes"]
            assert q["temp_bytes"] <= ref["temp_bytes"] + saved // 2, (scheme, name, q, ref)
            assert q["gemm_operands"].get(eight_bit, 0) >= 4, (scheme, name, q)  # q, k, v, o
            assert set(ref["gemm_operands"]) == {"bf16"}, ref
    # the Pallas kernel reads an 8-bit pool as stored (Triton lowers its scaled loads)
    for name in ("decode", "prefill"):
        kernel = out[f"tiny-moe pallas int8 {name}"]
        assert kernel["kernel_named"] and kernel["kernel_calls"] >= 1, kernel
        assert kernel["argument_bytes"] == out[f"tiny-moe int8 {name}"]["argument_bytes"], kernel


def test_the_canvas_family_compiles_for_an_h200():
    """DiffusionGemma's denoising loop (tiny-dgemma), alone and with a commit in its first
    forward, through XLA:GPU's pipeline for one H200: a device while-loop with Triton fusions."""
    out = compiled(CANVAS_SCRIPT)
    assert out["platform"] == "gpu" and "H200" in out["device_kind"]
    for name in ("denoise", "denoise+commit"):
        assert out[name]["triton"] and out[name]["while"], (name, out[name])
        assert 0 < out[name]["temp_bytes"] < 64 << 20, (name, out[name])
