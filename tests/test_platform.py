"""Every platform choice comes from the platform the program is built for (ModelConfig.platform,
which an engine takes from its mesh), never from the host's default backend: on this CPU host a
config built for a GPU traces the GPU program, and the CPU program is what it was."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from mbd_jax.config import (ConfigError, DecodeConfig, ModelConfig, config_dict, from_dict,
                            load_model_config)
from mbd_jax.config.paths import MODEL_PRESET_DIR
from mbd_jax.engine import Engine
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.gated_deltanet import _chunk
from mbd_jax.model.transformer import Transformer, init_params, param_shapes

CFG = dataclasses.replace(load_model_config(MODEL_PRESET_DIR / "tiny-moe-hybrid-causal.yaml"),
                          moe_impl="auto")  # the preset fixes tiled for training


def decode_jaxpr(cfg) -> str:
    """The decode forward (one window of two blocks over the cache) of `cfg`, traced."""
    params = param_shapes(cfg)
    kv = jax.eval_shape(lambda: ModelCache.allocate(cfg, 2, 256))
    t = 2 * cfg.block_size
    tokens = jax.ShapeDtypeStruct((2, t), jnp.int32)

    def forward(p, x, cache):
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
        meta = ForwardMeta.cached(pos, jnp.zeros(2, jnp.int32), jnp.full(2, t, jnp.int32))
        return Transformer(cfg).apply({"params": p}, x, meta, cache)

    return str(jax.make_jaxpr(forward)(params, tokens, kv))


def test_a_gpu_build_traces_the_gpu_program_on_a_cpu_host():
    gpu, cpu = (dataclasses.replace(CFG, platform=p) for p in ("gpu", "cpu"))
    # the expert path: grouped matmuls (ragged_dot) on a GPU, the loop over hit experts on CPU
    gpu_text, cpu_text = decode_jaxpr(gpu), decode_jaxpr(cpu)
    assert "ragged_dot" in gpu_text and "ragged_dot" not in cpu_text
    # the layer loop: scanned runs of identical layers on a GPU, unrolled on CPU
    assert set(param_shapes(gpu)) == {"embed", "final_norm", "lm_head", "layers_0_1",
                                      "layers_1_3", "layers_3_4"}
    assert {f"layer_{i}" for i in range(4)} <= set(param_shapes(cpu))
    # the delta rule: the configured chunk on a GPU, one block per step on CPU
    sm = CFG.sequence_module
    assert _chunk(sm.chunk_size, CFG.block_size, 256, "gpu") == sm.chunk_size
    assert _chunk(sm.chunk_size, CFG.block_size, 256, "cpu") == CFG.block_size
    # unset: the first device's platform, the CPU program as before
    assert jax.devices()[0].platform == "cpu" and decode_jaxpr(CFG) == cpu_text


def test_a_platform_outside_jax_s_is_refused_at_load():
    data = {**config_dict(CFG), "platform": "npu"}
    with pytest.raises(ConfigError, match="platform"):
        from_dict(ModelConfig, data, where="model.yaml")


def test_an_engine_builds_for_its_mesh_platform():
    engine = Engine(CFG, init_params(CFG), batch_size=1, prefill_chunk=64)
    assert engine.cfg.platform == "cpu" and engine.moe_paths["all rows"] == "looped"
    out = engine.generate([[5, 6, 7]], DecodeConfig(max_new_tokens=8))[0]
    assert len(out.token_ids) >= 1
