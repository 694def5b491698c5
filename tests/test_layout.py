"""The scanned layer loop (model/layout.py) equals the unrolled one, reads and writes the same
model directories, and keeps the compiled program's size flat in depth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mbd_jax.checkpoint import load_model, save_model
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from mbd_jax.model import layout
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.transformer import Transformer, block_causal_mask, init_params
from tests.conftest import tiny_cfg

TOL = 1e-5


@pytest.fixture
def cfg():
    """tiny-random's three layers: the dense one, then a run of two MoE layers to scan (the
    suite's two-layer model has no run longer than one)."""
    return tiny_cfg(num_layers=3)


def loops(cfg):
    return (dataclasses.replace(cfg, layer_loop="unrolled"),
            dataclasses.replace(cfg, layer_loop="scan"))


def test_runs_group_consecutive_layers_of_one_kind():
    assert layout.runs(tiny_cfg(num_layers=3)) == [(0, 1), (1, 3)]  # first_k_dense 1, then MoE
    assert layout.runs(tiny_cfg(num_layers=3, first_k_dense=0)) == [(0, 3)]
    assert layout.runs(tiny_cfg(num_layers=3, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                first_k_dense=0)) == [(0, 3)]


def test_auto_is_unrolled_on_cpu_and_scanned_elsewhere():
    assert layout.resolve_loop("auto", "cpu") == "unrolled"
    assert layout.resolve_loop("auto", "gpu") == "scan"
    assert layout.resolve_loop("auto", "tpu") == "scan"
    assert layout.resolve_loop("scan", "cpu") == "scan"


def test_scanned_params_are_the_unrolled_ones_stacked(cfg):
    unrolled, scanned = loops(cfg)
    flat, stacked = init_params(unrolled), init_params(scanned)
    assert set(stacked) == {"embed", "final_norm", "lm_head", "layers_0_1", "layers_1_3"}
    assert stacked["layers_1_3"]["moe"]["experts_up"].shape == \
        (2,) + flat["layer_1"]["moe"]["experts_up"].shape
    back = layout.to_canonical(stacked, scanned)
    assert jax.tree.structure(back) == jax.tree.structure(flat)
    # the same draws (another key would differ by O(1)); the normal transform may round an ulp
    # apart between the two programs under the suite's XLA flags (tests/conftest.py)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(flat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_scanned_forward_equals_unrolled_on_both_paths(cfg):
    """The explicit-mask path (training) and the KV-buffer path (prefill + decode) give the same
    logits and the same KV with the layers scanned or unrolled."""
    unrolled, scanned = loops(cfg)
    pu, ps = init_params(unrolled), init_params(scanned)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(5, cfg.vocab_size, (2, 24)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    mask = block_causal_mask(pos, cfg.block_size)
    fwd = jax.jit(lambda c, p: Transformer(c).apply({"params": p}, tokens,
                                                    ForwardMeta.explicit(pos, mask))[0],
                  static_argnums=0)  # compiled, not op by op (which costs far more here)
    ref = np.asarray(fwd(unrolled, pu))
    np.testing.assert_allclose(np.asarray(fwd(scanned, ps)), ref, atol=TOL)
    # Buffer path: both write the same KV, and their logits equal the full-sequence ones.
    meta = ForwardMeta.cached(pos, jnp.zeros(2, jnp.int32), jnp.full(2, 24, jnp.int32))
    cached = jax.jit(lambda c, p: Transformer(c).apply(
        {"params": p}, tokens, meta, ModelCache.allocate(c, 2, 256)), static_argnums=0)
    out = [cached(c, p) for c, p in ((unrolled, pu), (scanned, ps))]
    for logits, _ in out:
        np.testing.assert_allclose(np.asarray(logits), ref, atol=TOL)
    np.testing.assert_allclose(np.asarray(out[1][1].positional.k), np.asarray(out[0][1].positional.k), atol=TOL)
    np.testing.assert_allclose(np.asarray(out[1][1].positional.v), np.asarray(out[0][1].positional.v), atol=TOL)


@pytest.mark.slow  # the default run has it under a mesh: tests/test_mesh.py's scanned engine
def test_scanned_engine_generates_what_the_unrolled_one_does():
    """The shipped model loaded with either loop (a canonical checkpoint stacked at load) decodes
    the same tokens with MultiBD, and the scanned engine compiles nothing for a second batch of
    the same shapes (the warmed-up case under a mesh: tests/test_mesh.py)."""
    from mbd_jax import compile_stats

    # token prompts outside the task formats: the trained model would stop at once; past EOS
    # every row decodes all 24 tokens
    d = DecodeConfig(buffer_size=2, max_new_tokens=24, ignore_eos=True)
    prompts = [[11, 12, 13], [7, 8, 9, 10, 11, 12]]
    got = {}
    for loop in ("unrolled", "scan"):
        model = load_model("tiny-mbd", runtime={"layer_loop": loop})
        engine = Engine(model.cfg, model.params, batch_size=2, buffer_size=2, prefill_chunk=16)
        got[loop] = [r.token_ids for r in engine.generate(prompts, d)]
        c0 = compile_stats.compiles()
        again = [r.token_ids for r in engine.generate(prompts[::-1], d)][::-1]
        assert compile_stats.compiles() == c0 and again == got[loop], loop
    assert got["scan"] == got["unrolled"]
    assert [len(t) for t in got["scan"]] == [24, 24]


def test_a_scanned_model_saves_the_canonical_layout(tmp_path, cfg):
    """save_model un-stacks: the directory written from scanned params loads unrolled, leaf for
    leaf equal; and loads back scanned to the same stacked params."""
    unrolled, scanned = loops(cfg)
    ps = jax.tree.map(lambda x: x * 1.5, init_params(scanned))
    out = save_model(tmp_path / "m", dataclasses.replace(scanned, tokenizer=None), ps)
    flat = load_model(str(out), runtime={"layer_loop": "unrolled"}).params
    assert "layer_2" in flat and "layers_1_3" not in flat
    for a, b in zip(jax.tree.leaves(layout.to_canonical(ps, scanned)), jax.tree.leaves(flat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = load_model(str(out), runtime={"layer_loop": "scan"}).params
    for a, b in zip(jax.tree.leaves(ps), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _program_size(cfg) -> int:
    """Instructions in the optimised decode-forward program (one block, KV buffer path)."""
    params = jax.eval_shape(lambda: init_params(cfg))
    kv = jax.eval_shape(lambda: ModelCache.allocate(cfg, 1, 256))
    t = jax.ShapeDtypeStruct((1, cfg.block_size), jnp.int32)
    r = jax.ShapeDtypeStruct((1,), jnp.int32)
    fwd = jax.jit(lambda p, x, q, c, o, v: Transformer(cfg).apply(
        {"params": p}, x, ForwardMeta.cached(q, o, v), c))
    text = fwd.lower(params, t, t, kv, r, r).compile().as_text()
    return sum(1 for line in text.splitlines() if " = " in line)


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_scanned_program_size_is_flat_in_depth(loop):
    """The compiled forward of a 12-layer model is no bigger than a 3-layer one's when scanned,
    and about 4x bigger unrolled (the measure behind compile time growing with depth)."""
    small, deep = (tiny_cfg(num_layers=n, layer_loop=loop) for n in (3, 12))
    ratio = _program_size(deep) / _program_size(small)
    if loop == "scan":
        assert ratio < 1.05, ratio
    else:
        assert ratio > 3.0, ratio


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_param_shapes_are_what_init_params_returns(loop):
    """The abstract parameters the loader restores into and shards by (one abstract init of the
    runtime model) have init_params' tree, shapes and dtypes in either layout."""
    from mbd_jax.model.transformer import param_logical_axes, param_shapes

    cfg = tiny_cfg(num_layers=3, layer_loop=loop)
    want, got = jax.eval_shape(lambda: init_params(cfg)), param_shapes(cfg)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert [(g.shape, g.dtype) for g in jax.tree.leaves(got)] == [
        (w.shape, w.dtype) for w in jax.tree.leaves(want)]
    axes = jax.tree.leaves(param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, P))
    assert [len(a) for a in axes] == [len(w.shape) for w in jax.tree.leaves(want)]
