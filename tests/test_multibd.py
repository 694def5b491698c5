"""MultiBD: the Block Buffer running set, its exact cache, invariants, bubbles, edit mode, factor rule."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax.config import DecodeConfig
from mbd_jax.decoding import block_buffer, policy
from mbd_jax.engine import Engine
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.transformer import Transformer

PROMPTS = [list(range(10, 10 + n)) for n in (3, 8, 13, 20)]
MULTI = DecodeConfig(max_new_tokens=40, buffer_size=2, add_block_threshold=0.0,
                     semi_complete_threshold=0.5)


@pytest.fixture(scope="module")
def debug_engine(cfg, params):
    """N_buf = 2, every step checks the invariants (a violation raises)."""
    return Engine(cfg, params, batch_size=4, buffer_size=2, prefill_chunk=32, debug=True)


def eos_params(cfg, params):
    """A model whose head prefers EOS with confidence ~1 at every position."""
    p = jax.tree.map(lambda x: x, params)
    p["embed"] = p["embed"].at[:, 0].add(1000.0)
    p["lm_head"] = p["lm_head"].at[0, cfg.eos_token_ids[0]].set(50.0)
    return p


def test_never_adding_early_is_singlebd(cfg, params, debug_engine):
    """add_block_threshold > 1: the next block only starts once the buffer is empty, which is
    SingleBD: the same tokens and forwards as the N_buf = 1 program."""
    single = Engine(cfg, params, batch_size=4, buffer_size=1, prefill_chunk=32)
    want = single.generate(PROMPTS, DecodeConfig(max_new_tokens=40))
    got = debug_engine.generate(PROMPTS, dataclasses.replace(MULTI, add_block_threshold=1.5))
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert (g.nfe, g.bubble_forwards, g.max_active_blocks) == (w.nfe, w.bubble_forwards, 1)


@pytest.mark.parametrize("activation", ["progress", "eager"])
def test_multibd_cache_is_exact(cfg, params, debug_engine, activation):
    """After MultiBD generation, the KV stored for every committed position equals the KV of one
    clean forward over the final tokens (float32, 1e-5); with eager activation too, where the
    second block is noisy from the first forward on."""
    eng = debug_engine
    prompts = [np.asarray(p, np.int32) for p in PROMPTS]
    decode = dataclasses.replace(MULTI, block_activation=activation)
    state = eng.run_decode(eng.admit(eng.empty_state(), {i: (p, decode) for i, p in enumerate(prompts)}))
    host = jax.device_get(state)
    assert int(host.max_active.max()) == 2  # blocks really overlapped
    # The reference: one clean forward per row over its committed tokens, all rows in one
    # compiled call (a row reads only its first cached_len positions, so what follows them in the
    # canvas changes nothing there).
    cached = host.cached_len[:4]
    n_max = int(cached.max())
    for row in range(4):
        prompt_blocks = len(PROMPTS[row]) // cfg.block_size * cfg.block_size
        assert cached[row] >= prompt_blocks + 2 * cfg.block_size  # two decoded blocks committed
        assert (host.canvas[row, :cached[row]] != cfg.mask_token_id).all()
    meta = ForwardMeta.cached(jnp.broadcast_to(jnp.arange(n_max), (4, n_max)),
                              jnp.zeros(4, jnp.int32), jnp.asarray(cached, jnp.int32))
    forward = jax.jit(lambda p, t, m: Transformer(cfg).apply(
        {"params": p}, t, m, ModelCache.allocate(cfg, 4, eng.capacity))[1])
    ref = forward(params, jnp.asarray(host.canvas[:4, :n_max]), meta)
    for row in range(4):
        n = int(cached[row])
        for got, want in zip(eng.kv.positional.rows_view(), ref.positional.rows_view()):  # [L, B, S, K, Dh]
            diff = float(jnp.max(jnp.abs(got[:, row, :n] - want[:, row, :n])))
            assert diff <= 1e-5, f"row {row}: {diff}"


@pytest.mark.parametrize("decode", [
    MULTI,
    dataclasses.replace(MULTI, policy="fixed_steps", steps_per_block=2),
    dataclasses.replace(MULTI, policy="factor", factor=2.0, temperature=0.9, seed=4),
    dataclasses.replace(MULTI, sampling_mode="edit", edit_threshold=0.05, accept_threshold=0.1),
    dataclasses.replace(MULTI, sampling_mode="edit", edit_confirm="context", edit_threshold=0.05,
                        accept_threshold=0.1),
    dataclasses.replace(MULTI, block_activation="eager", accept_threshold=0.5),
    dataclasses.replace(MULTI, buffer_size=1),
], ids=["threshold", "fixed_steps", "factor-sampled", "edit", "edit-context", "eager", "n1"])
def test_invariants_hold_every_step(debug_engine, decode):
    res = debug_engine.generate(PROMPTS, decode)  # raises if any step broke an invariant
    assert all(r.finish_reason in ("length", "stop") for r in res)


def test_invariant_checker_catches_a_broken_state(debug_engine):
    eng = debug_engine
    prompts = [np.asarray(p, np.int32) for p in PROMPTS]
    state = eng.initial_state(prompts, [MULTI] * 4)
    ok = block_buffer.check_invariants(state, block_size=8, n_slots=2, mask_token_id=eng.cfg.mask_token_id)
    assert not bool(jnp.any(ok))
    broken = state.replace(cached_len=state.cached_len.at[1].set(8 + 3),  # not block aligned
                           n_to_cache=state.n_to_cache.at[2].set(1))  # a TO_CACHE slot with MASKs
    bad = block_buffer.check_invariants(broken, block_size=8, n_slots=2, mask_token_id=eng.cfg.mask_token_id)
    assert bad.tolist() == [False, True, True, False]
    with pytest.raises(RuntimeError, match="invariant broken in rows \\[1, 2\\]"):
        eng.run_decode(broken, max_calls=1)


def test_multibd_removes_bubbles_and_raises_tpf(debug_engine):
    single = debug_engine.generate(PROMPTS, dataclasses.replace(MULTI, buffer_size=1))
    multi = debug_engine.generate(PROMPTS, MULTI)
    b1 = sum(r.bubble_forwards for r in single)
    b2 = sum(r.bubble_forwards for r in multi)
    tpf1 = sum(r.tokens_unmasked for r in single) / sum(r.nfe for r in single)
    tpf2 = sum(r.tokens_unmasked for r in multi) / sum(r.nfe for r in multi)
    # N_buf = 1: every completed block but the last costs one storing forward.
    assert all(r.bubble_forwards == r.blocks - 1 for r in single)
    assert b2 < b1 and tpf2 > tpf1


def test_edit_mode_rewrites_a_token_the_model_changed_its_mind_on(cfg, params):
    """A generated position holds token 50; the model now wants EOS there with confidence ~1.
    Edit mode rewrites it (and the text ends at once); naive mode keeps it; an edit threshold
    above the confidence keeps it too."""
    eng = Engine(cfg, eos_params(cfg, params), batch_size=1, buffer_size=2, prefill_chunk=32)
    prompt = [np.arange(10, 13, dtype=np.int32)]  # 3 prompt tokens: position 3 is generated

    def run(decode):
        state = eng.admit(eng.empty_state(), {0: (prompt[0], decode)})
        state = state.replace(canvas=state.canvas.at[0, 3].set(50))
        (r,) = eng.results(eng.run_decode(state), 1, 0.0)
        return r

    edit = DecodeConfig(max_new_tokens=16, sampling_mode="edit", edit_threshold=0.5)
    r = run(edit)
    assert r.edits == 1 and r.token_ids == [] and r.finish_reason == "stop"
    r = run(dataclasses.replace(edit, sampling_mode="naive"))
    assert r.edits == 0 and r.token_ids == [50]
    r = run(dataclasses.replace(edit, edit_threshold=1.0))
    assert r.edits == 0 and r.token_ids == [50]


def fast_dllm_factor(conf, f):
    """Reference: sort descending, take the largest n with (m+1)(1-c_m) <= f for all m < n."""
    order = np.argsort(-conf, kind="stable")
    take = []
    for m, i in enumerate(order):
        if m > 0 and (m + 1) * (1 - conf[i]) > f:
            break
        take.append(i)
    return sorted(take)


@pytest.mark.parametrize("f", [0.3, 1.0, 2.5])
def test_factor_rule_matches_reference(f):
    rng = np.random.default_rng(0)
    b, n, blk = 3, 2, 8
    conf = rng.uniform(0.2, 1.0, (b, n * blk)).astype(np.float32)
    maskable = np.ones((b, n * blk), bool)
    got = np.asarray(policy.select(
        jnp.asarray(conf), jnp.asarray(maskable), jnp.ones((b, n)), jnp.full(b, policy.POLICY_FACTOR),
        jnp.full(b, 0.95), jnp.ones(b, jnp.int32), jnp.full(b, f), jnp.full(b, 0.9), n))
    for r in range(b):
        for s in range(n):
            sl = slice(s * blk, (s + 1) * blk)
            assert np.nonzero(got[r, sl])[0].tolist() == fast_dllm_factor(conf[r, sl], f)
