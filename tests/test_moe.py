"""Routers against a plain NumPy per-token reference; the grouped-matmul path against dense."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax.model import moe


def np_softmax_topk(logits, k, norm, scale):
    ids, ws = [], []
    for row in logits:
        p = np.exp(row - row.max())
        p /= p.sum()
        top = sorted(range(len(p)), key=lambda e: -p[e])[:k]
        w = np.array([p[e] for e in top])
        if norm:
            w = w / w.sum()
        ids.append(top)
        ws.append(w * scale)
    return np.array(ids), np.array(ws)


def np_sigmoid_grouped(logits, bias, k, n_group, topk_group, norm, scale):
    ids, ws = [], []
    e = logits.shape[1]
    size = e // n_group
    for row in logits:
        s = 1.0 / (1.0 + np.exp(-row.astype(np.float64)))
        choice = s + bias
        group_scores = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_scores[g])[:topk_group]
        eligible = [x for g in groups for x in range(g * size, (g + 1) * size)]
        top = sorted(eligible, key=lambda x: -choice[x])[:k]
        w = np.array([s[x] for x in top])
        if norm:
            w = w / w.sum()
        ids.append(top)
        ws.append(w * scale)
    return np.array(ids), np.array(ws)


def _same_choice(ids, ws, ref_ids, ref_ws):
    """Compares as sets per token (order among equal experts does not matter)."""
    for i in range(len(ids)):
        got = dict(zip(np.asarray(ids[i]).tolist(), np.asarray(ws[i]).tolist()))
        want = dict(zip(ref_ids[i].tolist(), ref_ws[i].tolist()))
        assert got.keys() == want.keys(), f"token {i}: experts {sorted(got)} != {sorted(want)}"
        for e in want:
            assert abs(got[e] - want[e]) < 1e-5, f"token {i} expert {e}: {got[e]} != {want[e]}"


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_numpy(norm):
    logits = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32) * 2
    ids, ws = moe.route_softmax_topk(jnp.asarray(logits), 4, norm, 1.0)
    _same_choice(ids, ws, *np_softmax_topk(logits, 4, norm, 1.0))


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
def test_sigmoid_grouped_matches_numpy(n_group, topk_group):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(64, 32)).astype(np.float32) * 2
    bias = (rng.normal(size=32) * 0.3).astype(np.float32)  # changes the selection, not the weights
    ids, ws = moe.route_sigmoid_grouped(jnp.asarray(logits), jnp.asarray(bias), 6, n_group,
                                        topk_group, True, 2.5)
    ref_ids, ref_ws = np_sigmoid_grouped(logits, bias, 6, n_group, topk_group, True, 2.5)
    _same_choice(ids, ws, ref_ids, ref_ws)
    # The bias must have mattered somewhere, or this test would not test it.
    no_bias_ids, _ = np_sigmoid_grouped(logits, np.zeros(32), 6, n_group, topk_group, True, 2.5)
    assert any(set(a) != set(b) for a, b in zip(ref_ids.tolist(), no_bias_ids.tolist()))


def random_moe(seed: int, n: int, d: int, f: int, e: int, k: int, scale: float):
    """Tokens x [n, d], expert weights (scaled normal) and softmax top-k routing."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(e, d, f)) * scale, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(e, f, d)) * scale, jnp.float32)
    ids, ws = moe.route_softmax_topk(jnp.asarray(rng.normal(size=(n, e)), jnp.float32), k, True)
    return x, wg, wu, wd, ids, ws


def test_every_expert_path_is_a_config_choice():
    import typing

    from mbd_jax.config import MoeImpl

    assert set(typing.get_args(MoeImpl)) == set(moe.EXPERT_IMPLS) | {"auto", "measure"}


@pytest.mark.parametrize("n", [5, 96])  # 15 copies: a decode-sized call; 288: several tiles
@pytest.mark.parametrize("impl", ["ragged", "tiled", "looped"])
def test_grouped_experts_equal_dense(impl, n):
    """Tolerance 1e-5 absolute in float32 (outputs are O(1)); only the summation order differs."""
    d, f, e, k = 32, 24, 8, 3
    x, wg, wu, wd, ids, ws = random_moe(2, n, d, f, e, k, 0.2)
    dense = moe.experts_dense(x, ids, ws, wg, wu, wd)
    ragged = jax.jit(moe.EXPERT_IMPLS[impl])(x, ids, ws, wg, wu, wd)
    assert float(jnp.max(jnp.abs(dense))) > 0.1
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(dense), atol=1e-5, rtol=0)
    # And against a per-token NumPy loop.
    xs, i_, w_ = np.asarray(x), np.asarray(ids), np.asarray(ws)
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    ref = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            ex = i_[t, j]
            h = silu(xs[t] @ np.asarray(wg[ex])) * (xs[t] @ np.asarray(wu[ex]))
            ref[t] += w_[t, j] * (h @ np.asarray(wd[ex]))
    np.testing.assert_allclose(np.asarray(dense), ref, atol=1e-4, rtol=1e-4)


def test_tiled_experts_with_idle_and_crowded_experts():
    """Most experts get no token, one gets most copies (several tiles): still equal to dense."""
    rng = np.random.default_rng(5)
    n, d, f, e = 50, 16, 12, 8
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(e, d, f)) * 0.3, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(e, f, d)) * 0.3, jnp.float32)
    ids = jnp.asarray(np.stack([np.full(n, 6), np.where(np.arange(n) < 3, 1, 2)], 1), jnp.int32)
    ws = jnp.asarray(rng.uniform(0.1, 1.0, (n, 2)), jnp.float32)
    dense = np.asarray(moe.experts_dense(x, ids, ws, wg, wu, wd))
    np.testing.assert_allclose(np.asarray(moe.experts_tiled(x, ids, ws, wg, wu, wd, tile=8)),
                               dense, atol=1e-5)
    # The looped path's tile here is 16 rows (100 copies / 8 experts): expert 6 takes 4 tiles and
    # a tile's tail rows belong to the next expert, so they must not be overwritten.
    assert moe._loop_tile(2 * n, e) == 16
    for w in ((wg, wu, wd), (tuple(wg), tuple(wu), tuple(wd))):  # stacked, then per expert
        np.testing.assert_allclose(np.asarray(jax.jit(moe.experts_looped)(x, ids, ws, *w)),
                                   dense, atol=1e-5)


@pytest.mark.parametrize("n", [5, 96])
@pytest.mark.parametrize("impl", list(moe.EXPERT_IMPLS))
def test_per_expert_weights_equal_stacked(impl, n):
    """Every expert path takes the per-expert layout (a tuple of E arrays, what an engine on one
    CPU device keeps): the same output as the dense path over the stacked weights."""
    x, wg, wu, wd, ids, ws = random_moe(7, n, 32, 24, 8, 3, 0.2)
    want = np.asarray(moe.experts_dense(x, ids, ws, wg, wu, wd))
    got = jax.jit(moe.EXPERT_IMPLS[impl])(x, ids, ws, tuple(wg), tuple(wu), tuple(wd))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [1, 3, 40])
def test_looped_experts_differentiate_like_dense(n):
    """The looped path's loops have traced trip counts; its gradient (the dense path's, through
    custom_vjp) equals the dense path's gradient for every float input, jitted or not."""
    x, wg, wu, wd, ids, ws = random_moe(n, n, 16, 12, 8, 2, 0.3)

    def loss(fn):
        return lambda x, ws, wg, wu, wd: jnp.sum(jnp.sin(fn(x, ids, ws, wg, wu, wd)))

    got = jax.jit(jax.grad(loss(moe.experts_looped), argnums=range(5)))(x, ws, wg, wu, wd)
    want = jax.grad(loss(moe.experts_dense), argnums=range(5))(x, ws, wg, wu, wd)
    for a, b in zip(got, want):
        assert float(jnp.abs(b).max()) > 1e-3
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    # Per-expert weights: each expert's gradient arrives as its own array.
    split = jax.jit(jax.grad(loss(moe.experts_looped), argnums=range(5)))(
        x, ws, tuple(wg), tuple(wu), tuple(wd))
    for a, b in zip(split[2:], want[2:]):
        assert isinstance(a, tuple) and len(a) == 8
        np.testing.assert_allclose(np.stack(a), np.asarray(b), atol=1e-5)


EP_IMPLS = {**moe.EXPERT_IMPLS,
            "tiled_steps": functools.partial(moe.experts_tiled, tiles_per_step=2)}


@pytest.mark.parametrize("impl", list(EP_IMPLS))
def test_expert_shards_sum_to_the_whole(impl):
    """Expert parallelism's math on one device: each of 4 shards holds 2 of 8 experts and gets the
    local id 2 (= its expert count) for copies routed elsewhere; the shards' outputs sum to the
    unsharded result, and a shard's output is not the whole (the sentinel really drops copies)."""
    e, shards = 8, 4
    x, wg, wu, wd, ids, ws = random_moe(3, 40, 16, 12, e, 2, 0.3)
    whole = moe.experts_dense(x, ids, ws, wg, wu, wd)
    fn = jax.jit(EP_IMPLS[impl])
    per = e // shards
    parts = []
    for s in range(shards):
        first = s * per
        here = (ids >= first) & (ids < first + per)
        local_ids = jnp.where(here, ids - first, per)
        sl = slice(first, first + per)
        parts.append(np.asarray(fn(x, local_ids, ws, wg[sl], wu[sl], wd[sl])))
    np.testing.assert_allclose(sum(parts), np.asarray(whole), atol=1e-5, rtol=0)
    assert np.abs(parts[0] - np.asarray(whole)).max() > 0.1


def test_tiled_steps_skip_empty_tiles_and_differentiate_like_dense():
    """tiles_per_step (the EP form of the tiled path): equal to dense, with the gradient of dense
    (the loop is a lax.map of lax.cond), also when most copies are routed elsewhere."""
    e = 8
    x, wg, wu, wd, ids, ws = random_moe(4, 30, 16, 12, e, 2, 0.3)
    ids = jnp.where(ids < 2, ids, e)  # a shard holding experts 0-1 of a larger set
    stepped = functools.partial(moe.experts_tiled, tiles_per_step=2, tile=4)
    loss = lambda fn: lambda x, wg: jnp.sum(jnp.sin(fn(x, ids, ws, wg, wu, wd)))  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(stepped)(x, ids, ws, wg, wu, wd)),
                               np.asarray(moe.experts_dense(x, ids, ws, wg, wu, wd)), atol=1e-5)
    got = jax.jit(jax.grad(loss(stepped), argnums=(0, 1)))(x, wg)
    want = jax.grad(loss(moe.experts_dense), argnums=(0, 1))(x, wg)
    for a, b in zip(got, want):
        assert float(jnp.abs(b).max()) > 1e-3
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_auto_expert_path_is_chosen_per_backend():
    from mbd_jax.model.moe import resolve_impl

    assert resolve_impl("auto", "cpu") == "looped"  # reads only the hit experts' weights
    assert resolve_impl("auto", "gpu") == "ragged" and resolve_impl("auto", "tpu") == "ragged"
    assert resolve_impl("dense", "cpu") == "dense"


def test_measure_runs_each_decode_program_on_its_faster_path():
    """moe_impl `measure`: auto's path until the warm-up, which times every candidate on both
    decode programs (all rows; one running row alone), runs each on its faster one, decodes
    what the dense path decodes and compiles nothing after it."""
    from mbd_jax import compile_stats
    from mbd_jax.config import DecodeConfig, measured_candidates, resolve_auto
    from mbd_jax.engine import Engine
    from tests.conftest import tiny_cfg, tiny_params

    assert resolve_auto("moe_impl", "measure", "cpu") == "looped"
    assert measured_candidates("moe_impl", "cpu") == ("looped", "dense")
    assert set(measured_candidates("moe_impl", "gpu")) <= set(moe.EXPERT_IMPLS)
    engine = Engine(tiny_cfg(moe_impl="measure"), tiny_params(), batch_size=2, buffer_size=2,
                    prefill_chunk=16)
    assert engine.moe_paths == {"all rows": "looped", "one row": "looped"}
    heard = []
    engine.warmup(progress=heard.append)
    assert set(engine.moe_timings) == {"all rows", "one row"}
    for program, ms in engine.moe_timings.items():
        assert set(ms) == {"looped", "dense"} and min(ms.values()) > 0
        assert engine.moe_paths[program] == min(ms, key=ms.get)
    # the expert weights' layout follows the all-rows path (per-expert arrays for looped)
    split = engine.moe_paths["all rows"] == "looped"
    assert engine.experts_split is split
    assert isinstance(engine.params["layer_1"]["moe"]["experts_gate"], tuple) is split
    assert any(line.startswith("expert paths: all rows ") for line in heard)
    d = DecodeConfig(buffer_size=2, max_new_tokens=20, ignore_eos=True)
    prompts = [[11, 12, 13], [7, 8, 9, 10]]
    c0 = compile_stats.compiles()
    both = [r.token_ids for r in engine.generate(prompts, d)]
    alone = engine.generate(prompts[:1], d)[0].token_ids  # the one-row program
    assert compile_stats.compiles() == c0
    dense = Engine(tiny_cfg(moe_impl="dense"), tiny_params(), batch_size=2, buffer_size=2,
                   prefill_chunk=16)
    want = [r.token_ids for r in dense.generate(prompts, d)]
    assert both == want and alone == want[0] and len(alone) == 20


def test_engine_keeps_per_expert_weights_where_the_looped_path_runs_on_one_cpu_device():
    """The per-expert layout (model/layout.py) is chosen for the looped path on one CPU device
    only, and an engine in it decodes what an engine over the stacked weights decodes, with
    nothing compiled after the warm-up."""
    from mbd_jax import compile_stats
    from mbd_jax.config import DecodeConfig
    from mbd_jax.engine import Engine
    from mbd_jax.model import layout
    from mbd_jax.parallel import mesh as meshlib
    from tests.conftest import tiny_cfg, tiny_params

    one_cpu, auto = meshlib.single_device_mesh(), tiny_cfg(moe_impl="auto")
    assert layout.splits_experts(auto, one_cpu)  # auto = looped on CPU
    assert layout.splits_experts(tiny_cfg(moe_impl="measure"), one_cpu)
    assert not layout.splits_experts(tiny_cfg(moe_impl="dense"), one_cpu)
    assert not layout.splits_experts(auto, one_cpu, moe_impl="dense")  # a path measure times
    assert not layout.splits_experts(tiny_cfg(moe_impl="auto", layer_loop="scan"), one_cpu)
    assert not layout.splits_experts(
        dataclasses.replace(auto, num_experts=layout.SPLIT_EXPERTS_MAX * 2), one_cpu)
    d = DecodeConfig(buffer_size=2, max_new_tokens=24, ignore_eos=True)
    prompts = [[11, 12, 13], [7, 8, 9, 10, 30, 40, 50, 60, 20]]
    out = {}
    for split in (True, False):
        engine = Engine(auto, tiny_params(), batch_size=2, buffer_size=2, prefill_chunk=16,
                        split_experts=split)
        assert engine.experts_split is split
        moe_params = engine.params["layer_1"]["moe"]
        assert isinstance(moe_params["experts_gate"], tuple) is split
        engine.warmup()
        c0 = compile_stats.compiles()
        out[split] = [r.token_ids for r in engine.generate(prompts, d)]
        assert compile_stats.compiles() == c0
    assert out[True] == out[False] and len(out[True][0]) == 24


def test_auto_model_equals_the_dense_reference():
    import numpy as np

    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer, block_causal_mask
    from tests.conftest import tiny_cfg, tiny_params

    tokens = np.arange(3, 19, dtype=np.int32)[None] % 200 + 5
    pos = np.arange(16, dtype=np.int32)[None]
    mask = block_causal_mask(pos, tiny_cfg().block_size)
    out = {impl: jax.jit(Transformer(tiny_cfg(moe_impl=impl)).apply)(
        {"params": tiny_params()}, tokens, ForwardMeta.explicit(pos, mask))[0]
        for impl in ("auto", "dense")}
    assert float(jnp.abs(out["dense"]).max()) > 0.1
    np.testing.assert_allclose(out["auto"], out["dense"], atol=1e-5)


@pytest.mark.parametrize("n", [1, 4, 37])
def test_dense_experts_match_a_numpy_per_token_loop(n):
    """The GEMM-shaped dense path against the plain definition: each token's k copies through
    their experts, weighted and summed; copies with id E (held elsewhere) contribute nothing."""
    rng = np.random.default_rng(n)
    e, d, f, k = 6, 16, 8, 3
    x = rng.standard_normal((n, d)).astype(np.float32)
    wg, wu = (rng.standard_normal((e, d, f)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((e, f, d)).astype(np.float32)
    ids = rng.integers(0, e + 1, size=(n, k)).astype(np.int32)  # e = "not here"
    w = rng.random((n, k)).astype(np.float32)
    want = np.zeros((n, d), np.float32)
    for t in range(n):
        for c in range(k):
            if ids[t, c] == e:
                continue
            g = x[t] @ wg[ids[t, c]]
            h = g / (1 + np.exp(-g)) * (x[t] @ wu[ids[t, c]])
            want[t] += w[t, c] * (h @ wd[ids[t, c]])
    got = moe.experts_dense(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), jnp.asarray(wg),
                            jnp.asarray(wu), jnp.asarray(wd))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
