"""The 8-bit KV pool (model/paged_kv.py, cfg.kv_quantization): what it stores against NumPy, its
entries' byte form through gather and load, the prefix store's RAM and disk tiers serving it
exactly at about half a 16-bit entry's bytes, the hybrids' states left in float32, and bad
settings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mbd_jax.cache.prefix_store import PrefixStore
from mbd_jax.checkpoint import load_model
from mbd_jax.config import ConfigError, DecodeConfig, with_runtime
from mbd_jax.engine import Engine
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.paged_kv import PagedKV
from tests.conftest import tiny_cfg, tiny_params
from tests.test_prefix_cache import first_step_logits, prompts

FORMATS = {"int8": (np.int8, 127.0), "fp8": (ml_dtypes.float8_e4m3fn, 448.0)}


def _reference(x: np.ndarray, scheme: str) -> np.ndarray:
    """NumPy: each vector (last axis) scaled by its absmax to the format's largest value, cast
    (int8: rounded), and read back."""
    dtype, top = FORMATS[scheme]
    amax = np.abs(x).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    y = x / scale
    y = np.clip(np.round(y), -top, top).astype(dtype) if scheme == "int8" else y.astype(dtype)
    return y.astype(np.float32) * scale


@pytest.mark.parametrize("scheme", sorted(FORMATS))
@pytest.mark.parametrize("stacked", [False, True])
def test_pool_stores_each_vector_with_its_own_scale(scheme, stacked):
    """Writes into a quantized pool read back as NumPy's per-vector quantization; a rewrite of
    the same positions (a later denoising step) replaces values and scales; rows and positions
    not written stay zero; gather's byte entries load into another pool unchanged."""
    cfg = tiny_cfg(kv_quantization=scheme)
    rng = np.random.default_rng(0)
    pool = PagedKV.allocate(cfg, 2, batch=2, capacity=128, pages=4, dtype=jnp.float32,
                            stacked=stacked)
    assert pool.k_scale is not None and pool.entry_dtype == np.uint8
    shape = (1, 8, cfg.num_kv_heads, cfg.head_dim)  # row 1, positions [8, 16)
    meta = ForwardMeta.cached(jnp.arange(8, 16)[None], jnp.array([8]), jnp.array([16]),
                              rows=jnp.array([1]))
    for draw in range(2):  # the second write replaces the first
        k = (rng.standard_normal(shape) * np.logspace(-2, 1, cfg.head_dim)).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        pool = pool.write(1, jnp.asarray(k), jnp.asarray(v), meta)
    keys, values = (np.asarray(a) for a in pool.rows_view())  # [La, B, S, K, Dh]
    np.testing.assert_allclose(keys[1, 1, 8:16], _reference(k[0], scheme), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(values[1, 1, 8:16], _reference(v[0], scheme), rtol=1e-6, atol=1e-7)
    assert not keys[0].any() and not keys[1, 0].any() and not keys[1, 1, :8].any()

    entries = pool.gather(jnp.array([1]), jnp.array([8]), 8)
    assert entries.shape == (1, *PagedKV.entry_shape(cfg, 2, 8)) == (1, 2, 2, 8, 2, 20)
    other = PagedKV.allocate(cfg, 2, batch=2, capacity=128, pages=4, dtype=jnp.float32,
                             stacked=stacked).load(entries[0], jnp.array(0), jnp.array(16))
    np.testing.assert_array_equal(np.asarray(other.rows_view()[0])[:, 0, 16:24], keys[:, 1, 8:16])
    np.testing.assert_array_equal(np.asarray(other.gather(jnp.array([0]), jnp.array([16]), 8)),
                                  np.asarray(entries))


def make_engine(cfg, store=None):
    engine = Engine(cfg, tiny_params(), batch_size=2, buffer_size=2, prefill_chunk=32,
                    prefix_store=store)
    engine.warmup()
    return engine


@pytest.mark.parametrize("scheme", sorted(FORMATS))
def test_prefix_store_serves_the_quantized_pool_exactly_at_a_fraction_of_the_bytes(tmp_path, scheme):
    """With an 8-bit pool, cache hits from RAM and, after a restart, from disk give the tokens and
    logits a cold prefill does, bit for bit; a stored block takes (Dh + 4) bytes per vector:
    20 / 64 of the float32 pool's here, 20 / 32 of a bfloat16 one's (about half at Dh 128)."""
    cfg = tiny_cfg(kv_quantization=scheme)
    shared, other = prompts()
    d = DecodeConfig(buffer_size=2, max_new_tokens=16)
    cold = make_engine(cfg)
    cold_out = [r.token_ids for r in cold.generate([shared, other], d)]
    cold_logits = [first_step_logits(cold, p) for p in (shared, other)]

    store = PrefixStore("tiny", 8, ram_bytes=1 << 24, storage_path=tmp_path, disk_bytes=1 << 24)
    warm = make_engine(cfg, store)
    assert warm.generate([shared], d)[0].token_ids == cold_out[0]
    warm.offloader.flush()
    assert [r.token_ids for r in warm.generate([shared, other], d)] == cold_out
    assert store.stats.hits == 5 + 4
    np.testing.assert_array_equal(first_step_logits(warm, other), cold_logits[1])
    shape, dtype = store.entry_spec[""]  # the blocks
    float_shape = ModelCache.block_shape(dataclasses.replace(cfg, kv_quantization="none"), 8)
    assert dtype == np.uint8 and shape[:-1] == float_shape[:-1]
    assert np.prod(shape) / (4 * np.prod(float_shape)) == 20 / 64

    warm.offloader.close()
    again = make_engine(cfg, PrefixStore("tiny", 8, ram_bytes=1 << 24, storage_path=tmp_path,
                                         disk_bytes=1 << 24))
    assert [r.token_ids for r in again.generate([shared, other], d)] == cold_out
    np.testing.assert_array_equal(first_step_logits(again, shared), cold_logits[0])


def test_hybrid_keeps_its_recurrent_state_in_float32():
    """A hybrid with an int8 KV pool: attention's pool is 8-bit, the linear layers' states and
    conv tails stay float32 (they carry every past token), and it decodes."""
    model = load_model("tiny-moe-hybrid-causal", runtime={"kv_quantization": "int8"})
    engine = Engine(model.cfg, model.params, batch_size=2, buffer_size=2)
    kinds = engine.kv.entries
    assert kinds["full_attention"].dtype == jnp.int8
    assert {a.dtype for a in jax.tree.leaves(kinds["linear_attention"])} == {jnp.dtype(jnp.float32)}
    (r,) = engine.generate([[1, 20, 31, 42]], DecodeConfig(max_new_tokens=8, ignore_eos=True))
    assert len(r.token_ids) == 8


def test_bad_kv_settings_are_refused_by_name():
    cfg = tiny_cfg()
    with pytest.raises(ConfigError, match="kv_quantization"):
        with_runtime(cfg, {"kv_quantization": "int4"}, "runtime")
