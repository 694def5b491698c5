"""Shared fixtures: the tiny preset (and variants of it) with params cached per session."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from mbd_jax.config import MODEL_PRESET_DIR, ModelConfig, load_model_config
from mbd_jax.model.transformer import init_params


@functools.cache
def tiny_cfg(**overrides) -> ModelConfig:
    cfg = load_model_config(MODEL_PRESET_DIR / "tiny-random.yaml")
    cfg = dataclasses.replace(cfg, **overrides)
    cfg.validate("test")
    return cfg


@functools.cache
def tiny_params(**overrides):
    return init_params(tiny_cfg(**overrides))


@pytest.fixture(scope="session")
def cfg() -> ModelConfig:
    return tiny_cfg()


@pytest.fixture(scope="session")
def params():
    return tiny_params()
