"""The Pallas paged-attention kernel (model/paged_attention_kernel.py), run in Pallas' interpreter,
equals its reference, the pure-JAX online-softmax loop (layers.chunked_attention), over the
layouts the engine makes: mixed visible lengths, prefix pages shared between rows, free rows,
decode windows of N_buf 1, 2 and 4 blocks, a prefill chunk over one cache row, grouped-query
heads. A mutation of its block-causal rule makes it differ; an engine on it generates the tokens
of the chunked path."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from mbd_jax.model import layers, paged_attention_kernel
from mbd_jax.model.paged_attention_kernel import check_shapes, paged_attention
from mbd_jax.model.paged_kv import PagedKV
from tests.conftest import tiny_cfg, tiny_params

BLOCK, PAGE, KV_HEADS, HEAD_DIM = 8, 16, 2, 16
PAGES_PER_ROW, POOL_PAGES = 8, 40


def pool(seed: int, rows: int, page: int = PAGE):
    """A random pool and a page table whose rows 0 and 1 share their first two pages (a shared
    prompt prefix) and otherwise hold distinct pages in a random order."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((POOL_PAGES, page, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((POOL_PAGES, page, KV_HEADS, HEAD_DIM)).astype(np.float32)
    order = rng.permutation(POOL_PAGES)
    table = np.full((rows, PAGES_PER_ROW), POOL_PAGES, np.int32)
    taken = 0
    for r in range(rows):
        table[r] = order[taken: taken + PAGES_PER_ROW]
        taken += PAGES_PER_ROW - (2 if r == 0 else 0)
    table[1, :2] = table[0, :2]
    return jnp.asarray(k), jnp.asarray(v), jnp.asarray(table)


def reference(q, k, v, table, q_pos, visible_len, rows=None):
    kv = PagedKV(k=(k,), v=(v,), table=table)
    return layers.chunked_attention(q, kv, 0, q_pos, visible_len, BLOCK, k.shape[1], rows)


@pytest.mark.parametrize("n_buf", [1, 2, 4])
@pytest.mark.parametrize("heads", [2, 4])  # 1 and 2 query heads per kv head
def test_a_decode_window_equals_the_reference(n_buf, heads):
    """Four rows at mixed committed lengths (one at 0, one past a page boundary, two sharing
    prefix pages) decode a window of n_buf blocks: each row's queries sit in its own blocks after
    its committed prefix and see the keys of their block and before."""
    rows, t = 4, n_buf * BLOCK
    k, v, table = pool(n_buf * 10 + heads, rows)
    rng = np.random.default_rng(heads)
    cached = np.array([0, 24, 40, 72], np.int32)
    visible_len = jnp.asarray(cached + t)
    q_pos = jnp.asarray(cached[:, None] + np.arange(t, dtype=np.int32)[None])
    q = jnp.asarray(rng.standard_normal((rows, t, heads, HEAD_DIM)).astype(np.float32))
    got = paged_attention(q, k, v, table, q_pos, visible_len, BLOCK, interpret=True)
    np.testing.assert_allclose(got, reference(q, k, v, table, q_pos, visible_len), atol=2e-5)


def test_pages_larger_than_a_key_tile_are_read_tile_by_tile():
    """Pages of 128 positions are read in key tiles of 64 (shared memory on a GPU): lengths that
    end inside a page's first or second tile, and rows sharing a page, equal the reference."""
    assert 128 % paged_attention_kernel.KEY_TILE == 0 and paged_attention_kernel.KEY_TILE < 128
    k, v, table = pool(11, 3, page=128)
    t = 2 * BLOCK
    cached = np.array([40, 176, 328], np.int32)  # tiles 0-1, 2-3, 5-6 of the row's pages
    visible_len = jnp.asarray(cached + t)
    q_pos = jnp.asarray(cached[:, None] + np.arange(t, dtype=np.int32)[None])
    q = jnp.asarray(np.random.default_rng(12).standard_normal((3, t, 4, HEAD_DIM)), jnp.float32)
    got = paged_attention(q, k, v, table, q_pos, visible_len, BLOCK, interpret=True)
    np.testing.assert_allclose(got, reference(q, k, v, table, q_pos, visible_len), atol=2e-5)


def test_a_free_row_reads_nothing_and_the_others_are_unchanged():
    """A free row (visible length 0, no pages) gets zeros without a page read; the rows beside
    it equal the reference."""
    k, v, table = pool(3, 3)
    table = table.at[2].set(POOL_PAGES)  # row 2 holds no page
    t = 2 * BLOCK
    cached = np.array([16, 33, 0], np.int32)
    visible_len = jnp.asarray(np.where(np.arange(3) == 2, 0, cached + t).astype(np.int32))
    q_pos = jnp.asarray(cached[:, None] + np.arange(t, dtype=np.int32)[None])
    q = jnp.asarray(np.random.default_rng(4).standard_normal((3, t, 4, HEAD_DIM)), jnp.float32)
    got = np.asarray(paged_attention(q, k, v, table, q_pos, visible_len, BLOCK, interpret=True))
    want = np.asarray(reference(q, k, v, table, q_pos, visible_len))
    np.testing.assert_allclose(got[:2], want[:2], atol=2e-5)
    assert not got[2].any()


def test_pages_the_table_does_not_map_are_never_read():
    """A released row keeps a stale visible length while its table maps nothing (entry P): the
    kernel masks those keys (zeros out, where an unguarded load would read past the pool)."""
    k, v, table = pool(9, 2)
    table = table.at[1].set(POOL_PAGES)
    t = BLOCK
    cached = np.array([24, 40], np.int32)
    visible_len = jnp.asarray(cached + t)
    q_pos = jnp.asarray(cached[:, None] + np.arange(t, dtype=np.int32)[None])
    q = jnp.asarray(np.random.default_rng(10).standard_normal((2, t, 4, HEAD_DIM)), jnp.float32)
    got = np.asarray(paged_attention(q, k, v, table, q_pos, visible_len, BLOCK, interpret=True))
    want = np.asarray(reference(q, k, v, table, q_pos, visible_len))
    np.testing.assert_allclose(got[0], want[0], atol=2e-5)
    assert not got[1].any()


def test_a_prefill_chunk_over_one_cache_row_equals_the_reference():
    """A 48-token prefill chunk of cache row 2 alone (`rows`), at position 32 of its prompt:
    three query tiles of a kernel instance each, block-causal inside the chunk."""
    k, v, table = pool(5, 3)
    t, start = 48, 32
    q_pos = jnp.asarray(start + np.arange(t, dtype=np.int32)[None])
    visible_len = jnp.asarray([start + t], jnp.int32)
    rows = jnp.asarray([2], jnp.int32)
    q = jnp.asarray(np.random.default_rng(6).standard_normal((1, t, 4, HEAD_DIM)), jnp.float32)
    got = paged_attention(q, k, v, table, q_pos, visible_len, BLOCK, rows=rows, interpret=True)
    np.testing.assert_allclose(got, reference(q, k, v, table, q_pos, visible_len, rows), atol=2e-5)


def test_a_mutated_block_causal_rule_differs(monkeypatch):
    """The kernel's mask is what the comparison checks: letting a query see one key past its
    block makes it differ from the reference."""
    k, v, table = pool(7, 2)
    t = 2 * BLOCK
    cached = np.array([8, 24], np.int32)
    q_pos = jnp.asarray(cached[:, None] + np.arange(t, dtype=np.int32)[None])
    visible_len = jnp.asarray(cached + t)
    q = jnp.asarray(np.random.default_rng(8).standard_normal((2, t, 4, HEAD_DIM)), jnp.float32)
    want = reference(q, k, v, table, q_pos, visible_len)
    rule = paged_attention_kernel.block_causal  # the kernel's own name for the shared rule

    def one_more(q_pos, k_pos, visible_len, block_size):
        return rule(q_pos, k_pos - 1, visible_len + 1, block_size)

    monkeypatch.setattr(paged_attention_kernel, "block_causal", one_more)
    got = paged_attention(q, k, v, table, q_pos, visible_len, BLOCK, interpret=True)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() > 1e-2


def test_shapes_the_gpu_kernel_cannot_take_are_named():
    assert check_shapes(64, 128) is None
    assert "power of two" in check_shapes(48, 128) and "page" in check_shapes(48, 128)
    assert "head_dim" in check_shapes(64, 8)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_an_8_bit_pool_equals_the_reference(scheme):
    """An 8-bit pool (values and a scale per position and kv head) read by the kernel, which
    scales scores and probabilities rather than dequantizing pages, equals the chunked loop over
    the same pool (which dequantizes what it reads)."""
    from mbd_jax.model import quantize

    rows, t = 4, 2 * BLOCK
    k, v, table = pool(7, rows)
    (kq, ks), (vq, vs) = (quantize.quantize(a, scheme, (3,)) for a in (k, v))
    k_pool, v_pool = (kq, ks[..., 0]), (vq, vs[..., 0])
    cached = np.array([0, 24, 40, 72], np.int32)
    visible_len = jnp.asarray(cached + t)
    q_pos = jnp.asarray(cached[:, None] + np.arange(t, dtype=np.int32)[None])
    q = jnp.asarray(np.random.default_rng(1).standard_normal((rows, t, 4, HEAD_DIM))
                    .astype(np.float32))
    got = paged_attention(q, k_pool, v_pool, table, q_pos, visible_len, BLOCK, interpret=True)
    kv = PagedKV(k=(kq,), v=(vq,), table=table, k_scale=(k_pool[1],), v_scale=(v_pool[1],),
                 scheme=scheme)
    want = layers.chunked_attention(q, kv, 0, q_pos, visible_len, BLOCK, PAGE)
    np.testing.assert_allclose(got, want, atol=2e-5)
    float_pool = reference(q, k, v, table, q_pos, visible_len)  # the 8 bits change the result
    assert np.abs(np.asarray(got) - np.asarray(float_pool)).max() > 1e-4


@pytest.mark.parametrize("kv", ["none", "int8"])
def test_an_engine_on_the_kernel_generates_the_chunked_paths_tokens(kv):
    """The model's attention layers on the kernel (interpreted here), through admission,
    prefill chunks and MultiBD decode: the same tokens as the chunked path (with a float and an
    8-bit KV pool)."""
    prompts = [np.random.default_rng(i).integers(5, 200, n).tolist()
               for i, n in enumerate((5, 29, 70))]
    decode = DecodeConfig(buffer_size=2, max_new_tokens=24)
    want = Engine(tiny_cfg(kv_quantization=kv), tiny_params(), batch_size=2, buffer_size=2,
                  prefill_chunk=32).generate(prompts, decode)
    cfg = dataclasses.replace(tiny_cfg(kv_quantization=kv), attention_impl="pallas")
    got = Engine(cfg, tiny_params(), batch_size=2, buffer_size=2, prefill_chunk=32).generate(
        prompts, decode)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_shapes_the_gpu_kernel_cannot_take_fail_the_gpu_trace_with_a_clear_error():
    """Traced for a GPU platform, pages of 8 positions (under Triton's 16) are refused with the
    field named, before any lowering."""
    import jax

    from mbd_jax.errors import UserError
    from mbd_jax.model.cache import ModelCache
    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer

    cfg = dataclasses.replace(tiny_cfg(), attention_impl="pallas", platform="gpu",
                              attention_chunk=8, layer_loop="unrolled")  # tiny_params' layout
    cache = ModelCache.allocate(cfg, batch=1, capacity=64)
    tokens = jnp.zeros((1, BLOCK), jnp.int32)
    pos = jnp.arange(BLOCK, dtype=jnp.int32)[None]
    meta = ForwardMeta.cached(pos, jnp.zeros(1, jnp.int32), jnp.full(1, BLOCK, jnp.int32))
    with pytest.raises(UserError, match="attention_impl: pallas: page"):
        jax.eval_shape(lambda p: Transformer(cfg).apply({"params": p}, tokens, meta, cache),
                       tiny_params())
