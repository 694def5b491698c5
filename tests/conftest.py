"""Shared fixtures: the tiny preset (and variants of it) with params cached per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# One persistent XLA compilation cache for the whole run, shared with every subprocess (servers,
# CLIs, multi-device runs): the same programs are compiled once, then read back. Set before JAX
# is imported (JAX reads its JAX_* settings then).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mbd-jax-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The tests' models are tiny: compiling them costs far more than running them, and LLVM's
# optimisation passes are most of a CPU compile. Without them the suite spends a quarter less
# time compiling; XLA:CPU's older fusion code generator (fusion emitters off) takes another third
# off each compile (tiny-random's server warm-up: 14.3 -> 9.3 s of compiling; its decode runs
# ~25% slower, which tiny test runs do not feel). The programs compute the same (every exactness
# test passes either way; benchmarks and `make run` keep the defaults). Subprocesses inherit it.
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if XLA_TEST_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # (xdist workers inherit it)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys

import pytest

from mbd_jax.config import MODEL_PRESET_DIR, ModelConfig, load_model_config
from mbd_jax.model.transformer import init_params


ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_on_8_cpu_devices(script: str):
    """Runs `script` in a fresh process with 8 forced CPU devices; returns the JSON it printed
    last (the test process itself keeps its single device)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{XLA_TEST_FLAGS} --xla_force_host_platform_device_count=8",
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@functools.cache
def tiny_cfg(**overrides) -> ModelConfig:
    cfg = load_model_config(MODEL_PRESET_DIR / "tiny-test.yaml")
    cfg = dataclasses.replace(cfg, **overrides)
    cfg.validate("test")
    return cfg


def layer_1(params: dict) -> dict:
    """Layer 1's parameters (the first MoE layer of the tiny presets): `layer_1` unrolled, its
    run `layers_1_*` scanned (each leaf stacked on a leading layer axis)."""
    return params.get("layer_1") or next(v for k, v in params.items() if k.startswith("layers_1_"))


@functools.cache
def tiny_params(**overrides):
    return init_params(tiny_cfg(**overrides))


@pytest.fixture(scope="session")
def cfg() -> ModelConfig:
    return tiny_cfg()


@pytest.fixture(scope="session")
def params():
    return tiny_params()
