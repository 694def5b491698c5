"""`mbd-jax plan` compiles an engine for GPUs that are not here and reports what it holds: on one
H200 the parameters' and the KV pool's bytes are what the shapes give by hand, the verdict
follows the budget (a target file of a 2 MB device: does not fit, exit 1), and bad targets,
topologies and meshes are one error line each. Runs the command in its own process with the CUDA
plugin of .venv/gpu-compile (tests/test_gpu_compile.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mbd_jax.config import load_model_config
from mbd_jax.config.paths import MODEL_PRESET_DIR
from mbd_jax.model import sizes
from tests.test_gpu_compile import PLUGIN_DIR
from tests.live_server import ROOT


def plan(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{PLUGIN_DIR}{os.pathsep}{ROOT}")
    env.pop("JAX_PLATFORMS", None)  # the command keeps JAX off the (absent) GPU driver itself
    return subprocess.run([sys.executable, "-m", "mbd_jax", "plan", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)


def test_plan_reports_the_bytes_the_shapes_give(tmp_path):
    assert (PLUGIN_DIR / "jax_plugins").is_dir(), "run `make test` (it installs .venv/gpu-compile)"
    r = plan("--model", "tiny-moe", "--devices-per-host", "1", "--batch", "4",
             "--buffer-size", "2", "--prefill-chunk", "64", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    cfg = load_model_config(MODEL_PRESET_DIR / "tiny-moe.yaml")
    # by hand: float32 parameters; k and v of every attention layer for every pool position,
    # and the page table (int32, a row's pages)
    assert report["param_bytes_per_device"] == 4 * sizes.num_params(cfg)
    capacity, page = report["capacity"], cfg.attention_chunk
    positions = 4 * capacity
    kv = 2 * cfg.num_layers * positions * cfg.num_kv_heads * cfg.head_dim * 4
    assert report["pages"] == positions // page
    assert report["kv_bytes_per_device"] == kv + 4 * 4 * (capacity // page)
    assert capacity % page == 0 and capacity >= cfg.max_seq_len + 64
    decode = report["programs"]["decode"]
    held = report["param_bytes_per_device"] + report["kv_bytes_per_device"]
    assert decode["argument_bytes"] >= held
    assert decode["total_bytes"] < 0.01 * report["hbm_bytes"] and report["fits"]
    step = report["decode_step"]
    assert step["bound"] == "HBM bandwidth" and 0 < step["step_ms"] < 1  # tiny: bytes, not FLOPs
    assert report["rows_that_fit"] > 4
    # both linear in the KV bytes: the positions per row at batch 4 are the rows' capacity
    # scaled by rows that fit / 4 (within one row's worth)
    per_batch = report["rows_that_fit"] * capacity / 4
    assert abs(report["context_that_fits"] - per_batch) <= capacity / 4 + 1
    # prefill: at least two FLOPs per active non-embedding weight per prompt token
    assert report["prefill"]["flops_per_token"] > 2 * (
        sizes.active_params_per_token(cfg) - cfg.vocab_size * cfg.hidden_size)
    # the same engine on a target file whose device holds 2 MB: does not fit, exit 1
    target = tmp_path / "small.txtpb"
    target.write_text(re.sub(r"device_memory_size: \d+", "device_memory_size: 2000000",
                             (ROOT / "configs" / "gpu-targets" / "h200.txtpb").read_text()))
    small = plan("--model", "tiny-moe", "--target", str(target), "--devices-per-host", "1",
                 "--batch", "4", "--buffer-size", "2", "--prefill-chunk", "64")
    assert small.returncode == 1 and "DOES NOT FIT" in small.stdout, small.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--target", "h300"], "target 'h300': expected one of h100, h200"),
    (["--devices-per-host", "0"], "argument --devices-per-host: must be >= 1, got 0"),
    (["--mesh", "expert=3"], "--mesh 'expert=3'"),
    (["--budget", "2"], "--budget 2.0: expected a share of HBM in (0, 1]"),
    (["--prefill-chunk", "20"], "prefill_chunk (20) must be a positive multiple of block_size"),
])
def test_plan_refuses_bad_targets_topologies_and_meshes(args, message):
    r = plan("--model", "tiny-moe", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("error:")
                or "error:" in line]) == 1, r.stderr


def test_the_modelled_step_reads_the_experts_uniform_routing_hits():
    """The decode model reads the dense weights, and of the routed experts the share a step's
    tokens hit: at LLaDA2-mini's shape (8 of 256 per token) it equals a simulation of tokens
    each picking 8 distinct experts at random, within 2% of the bytes, for 1 to 512 tokens."""
    from mbd_jax import plan as planner

    cfg = load_model_config(MODEL_PRESET_DIR / "llada2-mini.yaml")
    target = planner.Target("test", 141 << 30, 4.8e12, {planner.BF16: 1e15})
    total, active = sizes.num_params(cfg), sizes.active_params_per_token(cfg)
    rng = np.random.default_rng(0)
    for tokens in (1, 32, 64, 512):
        picks = [rng.permuted(np.arange(cfg.num_experts))[: cfg.num_experts_per_tok]
                 for _ in range(tokens) for _ in range(50)]
        shares = [len(np.unique(np.concatenate(picks[i * tokens:(i + 1) * tokens])))
                  / cfg.num_experts for i in range(50)]
        routed = (total - active) / total
        want = total * 2 * ((1 - routed) + routed * float(np.mean(shares)))
        step = planner.decode_step(cfg, target, 1, total * 2, 0, 1, tokens, 0, 1)
        assert step["bytes_read_per_device"] == pytest.approx(want, rel=0.02), tokens


def test_block_routing_reads_the_experts_its_pools_hold():
    """With LLaDA2.2's block routing (48 of 256 experts per 32-token window) the modelled step
    reads a simulation's share of distinct experts: windows each picking a pool of 48 at
    random, the tokens inside it. One 32-token block reads 19% of the routed experts, not 64%."""
    import dataclasses

    from mbd_jax import plan as planner

    cfg = dataclasses.replace(load_model_config(MODEL_PRESET_DIR / "llada2-mini.yaml"),
                              router_block_pool=48)
    rng = np.random.default_rng(0)
    for rows, tokens in ((1, 32), (1, 64), (8, 64), (16, 32)):
        windows = rows * tokens // cfg.block_size
        shares = [len(np.unique(np.concatenate([rng.permuted(np.arange(256))[:48]
                                                for _ in range(windows)]))) / 256
                  for _ in range(50)]
        assert planner.experts_hit(cfg, rows, tokens) == pytest.approx(np.mean(shares), rel=0.03)
    plain = dataclasses.replace(cfg, router_block_pool=0)
    assert planner.experts_hit(cfg, 1, 32) == pytest.approx(48 / 256)
    assert planner.experts_hit(plain, 1, 32) == pytest.approx(0.637, abs=0.001)


def test_llada2_mini_compiles_for_two_h100s():
    """The H100 target compiles a real model (under XLA's exact H100 name, compile-only machines
    failed with "Error loading CUDA libraries": configs/gpu-targets/h100_sxm.txtpb), and fits:
    LLaDA2-mini's bf16 experts split over two devices, the rest on both."""
    r = plan("--model", "llada2-mini", "--target", "h100", "--devices-per-host", "2",
             "--mesh", "expert=2", "--batch", "1", "--buffer-size", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert "H100" in report["target"] and report["fits"]
    cfg = load_model_config(MODEL_PRESET_DIR / "llada2-mini.yaml")
    assert 2 * sizes.num_params(cfg) / 2 < report["param_bytes_per_device"] < 2 * sizes.num_params(cfg)


def test_plan_compiles_a_canvas_model_for_eight_h200s():
    """tiny-dgemma's canvas engine compiled for 8 H200s (experts on 2, heads on 4): the
    parameters and the pool are what the shapes give split by the mesh, and a canvas is its
    passes plus the fused commit."""
    import jax

    from mbd_jax import canvas_model

    r = plan("--model", "tiny-dgemma", "--devices-per-host", "8", "--mesh", "expert=2,tensor=4",
             "--batch", "2", "--context", "256", "--denoising-steps", "8", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    cfg = canvas_model.load("tiny-dgemma", with_weights=False).cfg
    assert set(report["programs"]) == {"round", "commit", "prefill"} and report["fits"]
    # the pool: every layer's k and v at every position of both rows, KV heads split where
    # tensor (4) divides them (none here: 2 and 1 KV heads), float32
    kv = sum(2 * 2 * 256 * k * d * 4 for k, d in map(cfg.head, range(cfg.num_layers)))
    assert report["kv_bytes_per_device"] == kv
    total = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(canvas_model.param_shapes(cfg)))
    assert report["param_bytes_per_device"] < total / 2  # experts and heads split
    canvas, step = report["canvas"], report["decoder_pass"]
    assert canvas["ms"] > 8 * step["ms"] and canvas["steps"] == 8
    # fp8 weights (their scales split like them): the matrices in one byte, not four
    r = plan("--model", "tiny-dgemma", "--devices-per-host", "8", "--mesh", "expert=2,tensor=4",
             "--batch", "2", "--context", "256", "--quantize", "fp8", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    fp8 = json.loads(r.stdout)
    assert fp8["quantization"] == "fp8"
    assert fp8["param_bytes_per_device"] < 0.5 * report["param_bytes_per_device"]
    assert fp8["decoder_pass"]["bytes_read_per_device"] < step["bytes_read_per_device"]
