"""Attention paths and rotary embedding against independent references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.paged_kv import PagedKV
from mbd_jax.model import layers, rope
from tests.conftest import tiny_cfg, tiny_params


def np_rope(x, pos, theta, rot):
    half = rot // 2
    inv = 1.0 / theta ** (np.arange(half) * 2.0 / rot)
    out = x.astype(np.float64).copy()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            a = pos[b, t] * inv
            x1, x2 = x[b, t, :, :half], x[b, t, :, half:rot]
            out[b, t, :, :half] = x1 * np.cos(a) - x2 * np.sin(a)
            out[b, t, :, half:rot] = x2 * np.cos(a) + x1 * np.sin(a)
    return out


def test_partial_rope_matches_numpy_and_keeps_the_rest():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 1000, (2, 5))
    cfg = tiny_cfg(head_dim=16, rotary_fraction=0.5, rope_theta=600000.0)  # 8 dims rotated
    got = np.asarray(rope.apply_rope(jnp.asarray(x), jnp.asarray(pos), *rope.frequencies(cfg)))
    np.testing.assert_allclose(got, np_rope(x, pos, 600000.0, 8), atol=1e-4)
    np.testing.assert_array_equal(got[..., 8:], x[..., 8:])


def shuffled_pages(kv: PagedKV, seed: int) -> PagedKV:
    """The same cache with its pool pages in a random order (the table follows them) and one
    spare page of noise: what a page allocator may hand out."""
    n = kv.num_pages
    perm = np.random.default_rng(seed).permutation(n + 1)  # new slot of each old page (+ spare)
    def move(pool):
        spare = np.full((1,) + pool.shape[1:], 7.0, np.float32)
        out = np.empty((n + 1,) + pool.shape[1:], np.float32)
        out[perm] = np.concatenate([np.asarray(pool), spare])
        return jnp.asarray(out)

    moved = lambda t: tuple(map(move, t)) if isinstance(t, tuple) else jnp.stack(  # noqa: E731
        [move(x) for x in t])
    return PagedKV(k=moved(kv.k), v=moved(kv.v), table=jnp.asarray(perm[np.asarray(kv.table)]))


def test_chunked_attention_equals_dense_over_the_paged_pool():
    rng = np.random.default_rng(1)
    b, t, h, k, dh, s, blk, chunk = 3, 8, 4, 2, 8, 128, 8, 32
    q = jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32)
    kb = jnp.asarray(rng.normal(size=(b, s, k, dh)), jnp.float32)
    vb = jnp.asarray(rng.normal(size=(b, s, k, dh)), jnp.float32)
    # The pool holds two layers; layer 1 is kb / vb, layer 0 is noise that must not be read.
    noise = jnp.asarray(rng.normal(size=(b, s, k, dh)), jnp.float32)
    dense_rows = PagedKV.from_rows(jnp.stack([noise, kb]), jnp.stack([noise, vb]), page=chunk)
    attend = jax.jit(layers.chunked_attention, static_argnums=(5, 6))
    # Rows at different offsets (the last spans 3 chunks), each seeing up to its last query
    # (prefill) except where noted. The loop's unmasked part runs for the first chunk in the
    # second set only: in the first a row starts in it, in the third one row's queries see
    # further than the others' and one row sees a single key (a finished row).
    for start, visible in ((np.array([0, 40, 96]), None),
                           (np.array([72, 40, 96]), None),
                           (np.array([72, 8, 96]), np.array([80, 128, 104])),
                           (np.array([72, 40, 96]), np.array([80, 1, 104]))):
        pos = jnp.asarray(start[:, None] + np.arange(t))
        visible = jnp.asarray(start + t if visible is None else visible)
        dense = layers.dense_attention(q, kb, vb, layers.block_causal_visible(pos, jnp.arange(s),
                                                                              visible, blk))
        for kv in (dense_rows, shuffled_pages(dense_rows, 0)):  # the page table is what is read
            chunked = attend(q, kv, jnp.int32(1), pos, visible, blk, chunk)
            np.testing.assert_allclose(np.asarray(chunked), np.asarray(dense), atol=1e-5)
    # A row whose output is not used (a finished row reading one key) does not hold the others
    # back from the unmasked part; the used rows still equal dense, the unused one stays finite.
    start, visible = np.array([72, 40, 96]), jnp.asarray([80, 1, 104])
    pos = jnp.asarray(start[:, None] + np.arange(t))
    used = jnp.asarray([True, False, True])
    dense = layers.dense_attention(q, kb, vb, layers.block_causal_visible(pos, jnp.arange(s),
                                                                          visible, blk))
    chunked = jax.jit(layers.chunked_attention, static_argnums=(5, 6))(
        q, dense_rows, jnp.int32(1), pos, visible, blk, chunk, None, used)
    np.testing.assert_allclose(np.asarray(chunked)[[0, 2]], np.asarray(dense)[[0, 2]], atol=1e-5)
    assert np.isfinite(np.asarray(chunked)[1]).all()
    # ... and it read the first chunk whole (past its one visible key): the unmasked part ran
    assert not np.allclose(np.asarray(chunked)[1], np.asarray(dense)[1], atol=1e-3)
    # And dense against a direct NumPy softmax for one query.
    bi, ti, hi = 2, 3, 1
    p = int(pos[bi, ti])
    n_vis = min((p // blk + 1) * blk, int(visible[bi]))
    keys = np.asarray(kb[bi, :n_vis, hi // 2])
    sc = keys @ np.asarray(q[bi, ti, hi]) / np.sqrt(dh)
    w = np.exp(sc - sc.max())
    w /= w.sum()
    np.testing.assert_allclose(np.asarray(dense[bi, ti, hi]), w @ np.asarray(vb[bi, :n_vis, hi // 2]), atol=1e-5)


def test_kv_write_puts_each_row_at_its_offset_in_one_layer():
    """Both forms of the pool (stacked for scanned layers, per layer for unrolled ones), with
    pages in order or shuffled, write the same positions and leave the other layers alone; a row
    the metadata does not select for writing keeps what it had; a position without a page is
    dropped."""
    zeros = jnp.zeros((3, 2, 16, 1, 1), jnp.float32)  # [L, B, S, K, Dh]
    new = jnp.ones((2, 3, 1, 1), jnp.float32) * jnp.array([1.0, 2.0])[:, None, None, None]
    meta = ForwardMeta.cached(jnp.zeros((2, 3), jnp.int32), jnp.array([0, 5]), jnp.full(2, 16))
    stacked = PagedKV.from_rows(zeros, zeros, page=4)
    per_layer = PagedKV.from_rows(tuple(zeros), tuple(zeros), page=4)
    assert stacked.stacked and not per_layer.stacked
    only_row_1 = meta.replace(write=jnp.array([False, True]))
    for start in (stacked, per_layer, shuffled_pages(stacked, 1), shuffled_pages(per_layer, 2)):
        kv = jax.jit(PagedKV.write, static_argnums=1)(start, 1, new, -new, meta)
        k, v = (np.asarray(a)[..., 0, 0] for a in kv.rows_view())  # [L, B, S]
        k0 = np.asarray(start.rows_view()[0])[..., 0, 0]
        assert k[1, 0].tolist() == [1, 1, 1] + k0[1, 0, 3:].tolist()
        assert k[1, 1].tolist() == k0[1, 1, :5].tolist() + [2, 2, 2] + k0[1, 1, 8:].tolist()
        np.testing.assert_array_equal(v[1, :, :8], -k[1, :, :8])
        np.testing.assert_array_equal(k[[0, 2]], k0[[0, 2]])  # other layers untouched
        again = kv.write(1, 5 * new, -5 * new, only_row_1)
        k2 = np.asarray(again.rows_view()[0])[..., 0, 0]
        assert k2[1, 0].tolist() == k[1, 0].tolist()  # not selected: unchanged
        assert k2[1, 1].tolist() == k0[1, 1, :5].tolist() + [10, 10, 10] + k0[1, 1, 8:].tolist()
    # row 1 without the page of positions 4..7: its write (5..7) is dropped, not put elsewhere,
    # and reading that page gives zeros
    holed = stacked.with_table(stacked.table.at[1, 1].set(stacked.num_pages))
    kv = holed.write(1, new, -new, meta)
    pool = np.asarray(kv.k)[..., 0, 0]  # [L, P, page]
    assert pool[1].sum() == 3 and pool[[0, 2]].sum() == 0  # row 0's three 1s only
    assert not np.asarray(kv.rows_view()[0])[1, 1].any()


def test_every_parameter_carries_logical_axes():
    """The sharding rules map these names to mesh axes: every parameter has one name per dim,
    experts are on 'expert', heads on 'heads' / 'kv_heads', the vocab on 'vocab'."""
    from flax.traverse_util import flatten_dict

    from mbd_jax.model.transformer import param_logical_axes

    cfg, params = tiny_cfg(num_layers=3), tiny_params(num_layers=3)  # a run of two MoE layers
    axes = flatten_dict(param_logical_axes(cfg))
    shapes = flatten_dict(params)
    assert axes.keys() == shapes.keys()
    for path, spec in axes.items():
        assert len(tuple(spec)) == shapes[path].ndim, path
    canonical = flatten_dict(param_logical_axes(dataclasses.replace(cfg, layer_loop="unrolled")))
    assert tuple(canonical[("layer_1", "moe", "experts_gate")]) == ("expert", "embed", "mlp")
    assert tuple(canonical[("layer_0", "attn", "q_proj")]) == ("embed", "heads", "head_dim")
    assert tuple(canonical[("layer_0", "attn", "k_proj")]) == ("embed", "kv_heads", "head_dim")
    # scanned runs put "layers" in front of each stacked parameter's names
    scanned = flatten_dict(param_logical_axes(dataclasses.replace(cfg, layer_loop="scan")))
    assert tuple(scanned[("layers_1_3", "moe", "experts_gate")]) == ("layers", "expert", "embed",
                                                                     "mlp")
    assert tuple(scanned[("layers_0_1", "attn", "q_proj")]) == ("layers", "embed", "heads",
                                                                "head_dim")
    assert tuple(axes[("embed",)]) == ("vocab", "embed")
