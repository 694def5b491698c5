"""MultiTF / block-diffusion objective: layouts, noise, the dual-stream mask and the loss, each
against an independent reference (brute-force rules, NumPy, a single-stream forward)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.transformer import Transformer, block_causal_mask
from mbd_jax.train import objective
from tests.conftest import tiny_cfg, tiny_params


def brute_force_mask(groups: np.ndarray, block_size: int) -> np.ndarray:
    """The four rules of REFERENCE.md, one query/key pair at a time."""
    nb = len(groups)
    seq = nb * block_size
    first = {g: int(np.argmax(groups == g)) for g in set(groups.tolist())}
    out = np.zeros((2 * seq, 2 * seq), bool)
    for q, k in itertools.product(range(2 * seq), repeat=2):
        q_noisy, k_noisy = q < seq, k < seq
        qb, kb = (q % seq) // block_size, (k % seq) // block_size
        if q_noisy and k_noisy:
            out[q, k] = groups[qb] == groups[kb] and kb <= qb
        elif q_noisy:
            out[q, k] = kb < first[groups[qb]]
        elif not k_noisy:
            out[q, k] = kb <= qb
    return out


def all_layouts(n_blocks: int, g_max: int) -> list[np.ndarray]:
    return objective.layouts(n_blocks, g_max, n_random=3, rng=np.random.default_rng(0))


@pytest.mark.parametrize("n_blocks,g_max", [(5, 1), (5, 2), (7, 3), (6, 4)])
def test_layouts_cover_every_block_with_consecutive_groups(n_blocks, g_max):
    lays = all_layouts(n_blocks, g_max)
    want = 1 if g_max == 1 else sum(range(2, g_max + 1)) + 3  # systematic + random
    assert len(lays) == want
    for groups in lays:
        assert groups.shape == (n_blocks,) and groups[0] == 0
        steps = np.diff(groups)
        assert set(steps.tolist()) <= {0, 1}  # consecutive, numbered in order, none skipped
        sizes = np.bincount(groups)
        assert sizes.max() <= g_max and sizes.min() >= 1
    if g_max > 1:  # systematic: size g with shift s puts s blocks (or g when s = 0) in group 0
        pairs = [(g, shift) for g in range(2, g_max + 1) for shift in range(g)]
        for (g, shift), groups in zip(pairs, lays):
            sizes = np.bincount(groups)
            assert sizes[0] == (shift or min(g, n_blocks))
            assert np.all(sizes[1:-1] == g)


@pytest.mark.parametrize("n_blocks,g_max", [(4, 1), (5, 2), (6, 3)])
def test_dual_stream_mask_matches_the_rules(n_blocks, g_max):
    blk = 2
    lays = all_layouts(n_blocks, g_max)
    got = np.asarray(objective.dual_stream_mask(jnp.asarray(np.stack(lays)), blk))
    seq = n_blocks * blk
    for groups, m in zip(lays, got):
        np.testing.assert_array_equal(m, brute_force_mask(groups, blk))
        # the properties the issue names, asserted directly as well
        assert not m[seq:, :seq].any(), "clean saw noisy"
        for q in range(seq):
            qb = q // blk
            for kb in range(n_blocks):
                if groups[kb] >= groups[qb]:  # clean tokens of its own group or later
                    assert not m[q, seq + kb * blk: seq + (kb + 1) * blk].any()
            assert m[q, q], "a noisy token must see itself"


def test_chain_uniform_noise_and_exact_mask_counts():
    rng = np.random.default_rng(0)
    blk, seq = 4, 32
    clean = np.arange(seq, dtype=np.int32) + 10
    for trial in range(200):
        groups = objective.random_layout(seq // blk, 3, rng)
        t = objective.chain_uniform_t(groups, rng)
        t_eff = objective.T_HIGH - objective.RHO * (objective.T_HIGH - objective.T_LOW)
        assert np.all((t >= objective.T_LOW) & (t <= t_eff))
        for b in range(1, len(t)):
            if groups[b] == groups[b - 1]:
                assert t[b] >= t[b - 1], "noise must not decrease inside a group"
        prompt_len = int(rng.integers(0, 20))
        masked = objective.mask_blocks(clean, prompt_len, t, blk, rng)
        assert not masked[:prompt_len].any(), "prompt positions are never masked"
        for b in range(seq // blk):
            maskable = len(range(max(b * blk, prompt_len), (b + 1) * blk))
            assert masked[b * blk:(b + 1) * blk].sum() == int(maskable * float(t[b]))


@functools.partial(jax.jit, static_argnums=0)  # one program per length (op by op: 40 s)
def _jit_forward(cfg, params, tokens, positions, mask, groups=None):
    meta = ForwardMeta.explicit(positions[None], mask[None],
                                None if groups is None else groups[None])
    logits, _ = Transformer(cfg).apply({"params": params}, tokens[None], meta)
    return logits[0]


def _forward(cfg, params, tokens, positions, mask, groups=None):
    return np.asarray(_jit_forward(cfg, params, tokens, positions, mask, groups))


@pytest.mark.parametrize("model", ["attention", "hybrid-causal", "hybrid-bidirectional"])
@pytest.mark.parametrize("groups", [[0, 1, 2, 3], [0, 1, 1, 2], [0, 0, 1, 1]])
def test_noisy_stream_equals_what_decoding_shows_the_model(groups, model):
    """A noisy group's logits in the dual stream equal a plain block-causal forward over
    [clean blocks before the group ; the group's noisy blocks], which is what the Block Buffer
    holds when MultiBD decodes that group (one block per group = block diffusion). For the
    hybrid, in both block modes: its linear layers start each noisy group from the clean state
    and conv inputs before it (tests/test_hybrid.py checks that view against the state cache)."""
    if model == "attention":
        cfg, params = tiny_cfg(), tiny_params()
    else:
        from tests.test_hybrid import hybrid_cfg

        cfg, params = hybrid_cfg(model.removeprefix("hybrid-"))
    blk = cfg.block_size
    groups = np.array(groups, np.int32)
    seq = len(groups) * blk
    rng = np.random.default_rng(1)
    clean = rng.integers(10, cfg.vocab_size, size=seq).astype(np.int32)
    masked = rng.random(seq) < 0.5
    noisy = np.where(masked, cfg.mask_token_id, clean).astype(np.int32)
    pos = np.arange(seq, dtype=np.int32)
    mask = objective.dual_stream_mask(jnp.asarray(groups[None]), blk)[0]
    dual = _forward(cfg, params, np.concatenate([noisy, clean]), np.concatenate([pos, pos]), mask,
                    groups)
    for g in np.unique(groups):
        blocks = np.nonzero(groups == g)[0]
        lo, hi = blocks[0] * blk, (blocks[-1] + 1) * blk
        # the blocks after the group change nothing before them (block-causal), so every group's
        # reference is one full-length forward (one compiled program)
        single = np.concatenate([clean[:lo], noisy[lo:]])
        ref = _forward(cfg, params, single, pos, block_causal_mask(jnp.asarray(pos[None]), blk)[0])
        np.testing.assert_allclose(dual[lo:hi], ref[lo:hi], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("weighting,edit_share", [("llada2", 0.0), ("sdar", 0.0), ("llada2", 0.3)])
def test_loss_matches_numpy(weighting, edit_share):
    cfg, params = tiny_cfg(), tiny_params()
    rng = np.random.default_rng(2)
    seq = 4 * cfg.block_size
    rows = [(rng.integers(10, cfg.vocab_size, size=seq).astype(np.int32), int(p)) for p in (3, 9)]
    batch = objective.make_batch(rows, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                 g_max=2, n_random=1, rng=rng, edit_share=edit_share,
                                 vocab_size=cfg.vocab_size)
    edit = edit_share > 0
    answer = np.stack([np.arange(seq) >= rows[i // (len(batch.noisy) // 2)][1]
                       for i in range(len(batch.noisy))])
    np.testing.assert_array_equal(batch.filled, answer & ~batch.masked)
    corrupted = batch.noisy != batch.clean
    assert not (corrupted & ~batch.masked & ~batch.filled).any()  # the prompt is never touched
    if edit:  # about edit_share of the filled positions hold a random token
        assert 0.15 < (corrupted & batch.filled).sum() / batch.filled.sum() < 0.45
    else:
        assert not (corrupted & batch.filled).any()
    loss_fn = jax.jit(functools.partial(objective.loss_fn, model=Transformer(cfg),
                                        block_size=cfg.block_size, weighting=weighting, edit=edit))
    loss, (metrics, load) = loss_fn(params, batch={k: jnp.asarray(v)
                                                   for k, v in batch.as_dict().items()})
    # every token of both streams routed to k experts in each MoE layer
    loads = jax.tree.leaves(load)
    assert len(loads) == cfg.num_layers - cfg.first_k_dense
    for x in loads:
        assert float(np.sum(x)) == batch.noisy.size * 2 * cfg.num_experts_per_tok
    # reference: per-row forwards, NumPy log-softmax and weighting
    num = den = edit_num = 0.0
    for r in range(batch.noisy.shape[0]):
        mask = objective.dual_stream_mask(jnp.asarray(batch.groups[r:r + 1]), cfg.block_size)[0]
        pos = np.arange(seq, dtype=np.int32)
        logits = _forward(cfg, params, np.concatenate([batch.noisy[r], batch.clean[r]]),
                          np.concatenate([pos, pos]), mask)[:seq].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -logp[np.arange(seq), batch.clean[r]]
        w = batch.masked[r] / (batch.t[r] if weighting == "sdar" else 1.0)
        num += float((nll * w).sum())
        den += float(w.sum())
        edit_num += float((nll * batch.filled[r]).sum())
    assert int(metrics["masked"]) == int(batch.masked.sum()) > 0
    want = num / den + (edit_num / batch.filled.sum() if edit else 0.0)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_a_training_config_reaches_the_batch_with_its_edit_share():
    """TrainConfig.edit_share corrupts the trainer's batches (and only the answers' filled
    positions); a share outside [0, 1) is refused naming the field."""
    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import from_dict
    from mbd_jax.errors import UserError
    from mbd_jax.train.config import TrainConfig
    from mbd_jax.train.trainer import batch_for_step

    model = load_model("tiny-moe", with_weights=False)
    plain = TrainConfig(name="t", model="tiny-moe", tasks=("sort",), batch_size=8, seq_len=64)
    edit = dataclasses.replace(plain, edit_share=0.25)
    a = batch_for_step(plain, model.cfg, model.tokenizer, 3)
    b = batch_for_step(edit, model.cfg, model.tokenizer, 3)
    np.testing.assert_array_equal(a.clean, b.clean)
    assert not ((a.noisy != a.clean) & a.filled).any()
    assert ((b.noisy != b.clean) & b.filled).sum() > 0.1 * b.filled.sum()
    with pytest.raises(UserError, match=r"field 'edit_share' must be in \[0, 1\), got 1"):
        from_dict(TrainConfig, {"name": "t", "model": "m", "edit_share": 1}, where="t.yaml")
