"""The KV-buffer path (prefill + block by block) reproduces a full-sequence forward exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.transformer import Transformer, block_causal_mask
from tests.conftest import tiny_cfg, tiny_params

TOL = 1e-5  # float32; the two paths differ only in summation order


# row_prefill_min 8: prompt chunks of 8 or 16 tokens run over their own cache row, the 4-token
# ones share a call over all rows (both kinds in one admission); 64: every chunk is shared.
# pool: block routing (router_block_pool experts per window of a block; 0: off): each block's
# pool depends on its own tokens only, so the block-by-block path still equals the full forward.
@pytest.mark.parametrize("router,attention,moe_impl,loop,row_prefill_min,pool", [
    ("sigmoid_grouped", "chunked", "dense", "unrolled", 8, 0),
    ("softmax_topk", "chunked", "ragged", "unrolled", 64, 0),
    ("sigmoid_grouped", "dense", "ragged", "unrolled", 8, 0),
    ("softmax_topk", "chunked", "dense", "scan", 8, 0),
    ("sigmoid_grouped", "chunked", "looped", "unrolled", 8, 3),
    ("softmax_topk", "chunked", "tiled", "scan", 64, 4),
])
def test_buffer_path_equals_full_forward(router, attention, moe_impl, loop, row_prefill_min, pool):
    overrides = dict(router=router, attention_impl=attention, moe_impl=moe_impl, layer_loop=loop,
                     router_block_pool=pool)
    cfg, params = tiny_cfg(**overrides), tiny_params(**overrides)
    if router == "sigmoid_grouped":  # make the selection-only bias matter
        params = jax.tree.map(lambda x: x, params)
        for name, layer in params.items():
            if isinstance(layer, dict) and "moe" in layer:
                shape = layer["moe"]["expert_bias"].shape  # [E], or [layers, E] when scanned
                layer["moe"]["expert_bias"] = jax.random.normal(jax.random.PRNGKey(7), shape) * 0.05
    blk = cfg.block_size
    model = Transformer(cfg)
    apply = jax.jit(model.apply)  # one compile per shape; eager dispatch of every op is slow
    prompt_lens = [3, 8, 21, 40]  # rows with different prompt lengths (partial and full blocks)
    n_blocks_after = 4
    b = len(prompt_lens)
    total = max(prompt_lens) // blk * blk + n_blocks_after * blk
    rng = np.random.default_rng(0)
    seqs = rng.integers(5, cfg.vocab_size, (b, total)).astype(np.int32)

    # Reference: one full-sequence forward per row with the explicit block-causal mask.
    pos = jnp.broadcast_to(jnp.arange(total), (b, total))
    full, _ = apply({"params": params}, jnp.asarray(seqs),
                    ForwardMeta.explicit(pos, block_causal_mask(pos, blk)))

    # Buffer path: the engine's prefill writes each row's full prompt blocks ...
    engine = Engine(cfg, params, batch_size=b, prefill_chunk=16, row_prefill_min=row_prefill_min)
    engine.admit(engine.empty_state(), {i: (seqs[i, :n], DecodeConfig()) for i, n in enumerate(prompt_lens)})
    kv = engine.kv
    # ... then block after block, each row at its own offset, through the same forward.
    offset = np.array([n // blk * blk for n in prompt_lens], np.int32)
    worst = 0.0
    for _ in range(n_blocks_after):
        tokens = np.stack([seqs[i, o:o + blk] for i, o in enumerate(offset)])
        positions = offset[:, None] + np.arange(blk)
        meta = ForwardMeta.cached(jnp.asarray(positions), jnp.asarray(offset),
                                  jnp.asarray(offset + blk))
        logits, kv = apply({"params": params}, jnp.asarray(tokens), meta, kv)
        for i, o in enumerate(offset):
            ref = full[i, o:o + blk]
            worst = max(worst, float(jnp.max(jnp.abs(logits[i] - ref))))
        offset = offset + blk
    assert worst <= TOL, f"max abs logit diff {worst}"


def test_stored_kv_equals_full_forward_kv(cfg, params):
    """The K/V written by prefill at each position equal those of a forward over the same tokens
    written in one go (the buffer holds exactly the clean prefix), whether a chunk's call covers
    every row or one row at a time; a row-at-a-time prefill leaves the other rows' entries be."""
    blk = cfg.block_size
    b, n = 2, 5 * blk
    rng = np.random.default_rng(1)
    seqs = rng.integers(5, cfg.vocab_size, (b + 1, n)).astype(np.int32)
    rows = {0: (seqs[0], DecodeConfig()), 1: (seqs[1], DecodeConfig())}
    one = Engine(cfg, params, batch_size=b, prefill_chunk=8 * blk)  # one call over both rows
    one.admit(one.empty_state(), rows)
    # 5 calls of 1 block per row, each over that row alone; row 2 was prefilled before
    per_row = Engine(cfg, params, batch_size=b + 1, prefill_chunk=blk, row_prefill_min=blk)
    per_row.admit(per_row.empty_state(), {2: (seqs[2], DecodeConfig())})
    row_2 = [np.asarray(a[:, 2, :n]) for a in per_row.kv.positional.rows_view()]  # [L, n, K, Dh]
    per_row.admit(per_row.empty_state(), rows)
    for a, c in zip(one.kv.positional.rows_view(), per_row.kv.positional.rows_view()):  # [L, B, S, K, Dh] each
        assert float(jnp.max(jnp.abs(a[:, :, :n] - c[:, :b, :n]))) <= TOL
    for before, after in zip(row_2, per_row.kv.positional.rows_view()):
        np.testing.assert_array_equal(np.asarray(after[:, 2, :n]), before)
