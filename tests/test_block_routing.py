"""Block routing (LLaDA2.2, model/moe.py block_pools): per window of a row's consecutive
positions each expert scores its best token, the window's `pool` best experts are the only ones
its tokens may take. Checked against a NumPy reference; a pool of every expert changes nothing;
rows never share a window. (tests/test_exact_cache.py: with pools on, the block-by-block path
still equals the full forward on several expert paths.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax.config import ConfigError
from mbd_jax.model import moe
from tests.conftest import tiny_cfg


def reference(choice: np.ndarray, positions: np.ndarray, window: int, pool: int, k: int
              ) -> np.ndarray:
    """Each token's top-k experts (as a sorted set) inside its window's pool, in NumPy."""
    b, t, e = choice.shape
    out = np.zeros((b, t, k), np.int64)
    for r in range(b):
        windows: list[list[int]] = []
        for i in range(t):
            if i == 0 or positions[r, i] // window != positions[r, i - 1] // window \
                    or positions[r, i] <= positions[r, i - 1]:
                windows.append([])
            windows[-1].append(i)
        for members in windows:
            best = choice[r, members].max(axis=0)  # [E]
            allowed = np.argsort(-best, kind="stable")[:pool]
            for i in members:
                masked = np.full(e, -np.inf)
                masked[allowed] = choice[r, i, allowed]
                out[r, i] = np.sort(np.argsort(-masked, kind="stable")[:k])
    return out


@pytest.mark.parametrize("router", ["sigmoid_grouped", "softmax_topk"])
def test_pools_match_the_numpy_reference(router):
    rng = np.random.default_rng(0)
    b, t, e, k, window, pool = 2, 20, 8, 2, 8, 3
    logits = rng.normal(size=(b * t, e)).astype(np.float32)
    bias = rng.normal(size=e).astype(np.float32) * 0.1
    # row 0 starts mid-window (positions 4..23: windows of 4, 8, 8 tokens); row 1 holds a block
    # and a second copy of it at the same positions (MultiTF's clean + noisy), then the next
    positions = np.stack([np.arange(4, 24), np.r_[np.arange(8, 16), np.arange(8, 16),
                                                  np.arange(16, 20)]]).astype(np.int32)
    if router == "sigmoid_grouped":
        choice = np.asarray(moe.selection_scores(jnp.asarray(logits), jnp.asarray(bias)))
    else:
        choice = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    allowed = moe.block_pools(jnp.asarray(choice.reshape(b, t, e)), jnp.asarray(positions),
                              window, pool)
    if router == "sigmoid_grouped":
        ids, weights = moe.route_sigmoid_grouped(jnp.asarray(logits), jnp.asarray(bias), k, 4, 2,
                                                 True, 2.5, allowed)
        plain, _ = moe.route_sigmoid_grouped(jnp.asarray(logits), jnp.asarray(bias), k, 1, 1,
                                             True, 2.5)
        scores = 1 / (1 + np.exp(-logits))  # the weights: unbiased, normalised, scaled
        chosen = np.take_along_axis(scores, np.asarray(ids), axis=-1)
        np.testing.assert_allclose(np.asarray(weights), 2.5 * chosen / chosen.sum(-1, keepdims=True),
                                   rtol=1e-6)
    else:
        ids, _ = moe.route_softmax_topk(jnp.asarray(logits), k, True, 1.0, allowed)
        plain, _ = moe.route_softmax_topk(jnp.asarray(logits), k, True)
    want = reference(choice.reshape(b, t, e), positions, window, pool, k)
    got = np.sort(np.asarray(ids).reshape(b, t, k), axis=-1)
    np.testing.assert_array_equal(got, want)
    assert (np.sort(np.asarray(plain), -1).reshape(b, t, k) != got).any()  # the pools mattered
    per_window = {len({*got[0, :4].ravel()}), len({*got[0, 4:12].ravel()})}
    assert max(per_window) <= pool


def test_a_pool_of_every_expert_is_plain_routing_and_rows_never_share_a_window():
    rng = np.random.default_rng(1)
    b, t, e = 2, 16, 8
    logits = jnp.asarray(rng.normal(size=(b * t, e)).astype(np.float32))
    positions = jnp.asarray(np.stack([np.arange(16), np.arange(16)]).astype(np.int32))
    everything = moe.block_pools(jax.nn.softmax(logits).reshape(b, t, e), positions, 8, e)
    np.testing.assert_array_equal(np.asarray(moe.route_softmax_topk(logits, 2, True, 1.0,
                                                                    everything)[0]),
                                  np.asarray(moe.route_softmax_topk(logits, 2, True)[0]))
    # row 1's scores change; row 0's pools (hence its experts) do not
    other = logits.at[t:].set(jnp.asarray(rng.normal(size=(t, e)).astype(np.float32)))
    pools = [np.asarray(moe.block_pools(jax.nn.softmax(x).reshape(b, t, e), positions, 8, 3))
             for x in (logits, other)]
    np.testing.assert_array_equal(pools[0][:t], pools[1][:t])


def test_a_pool_smaller_than_k_or_larger_than_the_experts_is_refused():
    for pool in (1, 9):
        with pytest.raises(ConfigError, match="router_block_pool"):
            tiny_cfg(router_block_pool=pool)
    assert tiny_cfg(router_block_pool=2).router_block_pool == 2
