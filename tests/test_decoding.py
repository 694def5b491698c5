"""The jitted decoding loop end to end: batching, compilation, stop rules, policies, sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax import compile_stats
from mbd_jax.config import DecodeConfig
from mbd_jax.decoding import block_buffer, loop
from mbd_jax.engine import Engine, admission, programs
from mbd_jax.errors import UserError
from mbd_jax.model.transformer import Transformer

PROMPTS = [list(range(10, 10 + n)) for n in (3, 8, 13, 20)]  # partial and full prompt blocks


@pytest.fixture(scope="module")
def engine4(cfg, params):
    # chunks of 16 and 32 tokens run one row at a time, 8-token ones share a call: the batch and
    # warm-engine tests below cover both kinds (the one-row engines they compare with share)
    eng = Engine(cfg, params, batch_size=4, buffer_size=2, prefill_chunk=32, row_prefill_min=16)
    eng.warmup()
    return eng


@pytest.mark.parametrize("decode", [
    DecodeConfig(max_new_tokens=20),
    DecodeConfig(max_new_tokens=20, buffer_size=2, add_block_threshold=0.0, semi_complete_threshold=0.5),
], ids=["singlebd", "multibd"])
def test_batch_invariance(cfg, params, engine4, decode):
    """Each row decodes the same tokens alone (batch of 1) as in a batch of mixed lengths."""
    batched = engine4.generate(PROMPTS, decode)
    alone_engine = Engine(cfg, params, batch_size=1, buffer_size=2, prefill_chunk=32)
    for prompt, got in zip(PROMPTS, batched):
        (alone,) = alone_engine.generate([prompt], decode)
        assert got.token_ids == alone.token_ids
        assert (got.nfe, got.tokens_unmasked) == (alone.nfe, alone.tokens_unmasked)
        assert len(got.token_ids) == 20 and got.finish_reason == "length"


def test_one_running_row_decodes_alone_like_a_one_row_engine(cfg, params, engine4):
    """A row running alone in a 4-row engine (here row 2, so the row table matters) decodes over
    its own cache row only, on a warmed program, and gives a 1-row engine's tokens and counts."""
    decode = DecodeConfig(max_new_tokens=20, buffer_size=2, add_block_threshold=0.0)
    prompt = np.asarray(PROMPTS[1], np.int32)
    (alone,) = Engine(cfg, params, batch_size=1, buffer_size=2, prefill_chunk=32).generate(
        [prompt], decode)
    before = compile_stats.compiles()
    state = engine4.run_decode(engine4.admit(engine4.empty_state(), {2: (prompt, decode)}))
    got = engine4.results(state, 3, 0.0)[2]
    assert compile_stats.compiles() == before
    assert got.token_ids == alone.token_ids and len(got.token_ids) == 20
    assert (got.nfe, got.tokens_unmasked, got.max_active_blocks) == (
        alone.nfe, alone.tokens_unmasked, alone.max_active_blocks)


def test_a_finished_row_stops_setting_the_attention_length(engine4):
    """A decode forward's attention runs to the longest visible row: rows that are done (finished
    or free) read one position, whatever they held, while the running rows read their committed
    prefix and their window."""
    cfg = engine4.cfg
    state = engine4.run_decode(engine4.admit(engine4.empty_state(), {
        0: ([11] * 40, DecodeConfig(max_new_tokens=8)), 2: ([12] * 9, DecodeConfig(max_new_tokens=8))}))
    state = engine4.admit(state, {2: ([13] * 20, DecodeConfig(max_new_tokens=8))})
    host = jax.device_get(state)
    assert host.done.tolist() == [True, True, False, True] and host.cached_len[0] >= 40
    meta = jax.device_get(loop.decode_meta(state, 2 * cfg.block_size, cfg.block_size))
    want_2 = host.cached_len[2] + host.n_valid[2] * cfg.block_size
    assert meta.visible_len.tolist() == [1, 1, want_2, 1]
    assert meta.write.tolist() == [False, False, True, False]


def test_a_step_forwards_only_the_slots_in_use_with_the_same_result(cfg, params):
    """The loop's narrow steps forward only the first `slots_in_use` blocks of a 3-block buffer
    (one while a row's next block has not opened, two, then three). Step by step they leave the
    state the full-window step leaves, and a cache the following steps read alike (the DUMMY
    slots' entries are past every visible length: later forwards write them before anything
    reads them)."""
    eng = Engine(cfg, params, batch_size=4, buffer_size=3, prefill_chunk=32)
    decode = DecodeConfig(max_new_tokens=40, buffer_size=3, add_block_threshold=0.0)
    state = eng.admit(eng.empty_state(), {1: (PROMPTS[1], decode), 3: (PROMPTS[2], decode)})
    apply_fn = Transformer(cfg, eng.mesh).apply
    step = jax.jit(lambda s, kv, k: loop.decode_step(
        eng.params, s, kv, apply_fn=apply_fn, cfg=cfg, n_slots=3, compute_slots=k),
        static_argnums=2)
    full = narrow = (state, eng.kv)
    widths = []
    for _ in range(12):
        widths.append(int(loop.slots_in_use(narrow[0])))
        full, narrow = step(*full, None), step(*narrow, widths[-1])
        want, got = jax.device_get(full[0]), jax.device_get(narrow[0])
        for name in ("canvas", "n_valid", "n_to_cache", "cached_len", "n_unmasked", "done"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), name)
        np.testing.assert_allclose(got.logprob, want.logprob, atol=1e-5)
    assert {1, 2, 3} <= set(widths), widths


def test_warm_engine_compiles_nothing_new(engine4):
    """After warm-up, prompts of other lengths (same buckets) and other per-request decoding
    settings run on the programs already compiled."""
    before = compile_stats.compiles()
    engine4.generate([list(range(10, 10 + n)) for n in (5, 9, 17, 30)], DecodeConfig(max_new_tokens=12))
    engine4.generate([[11, 12], [13] * 25], [
        DecodeConfig(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=3),
        DecodeConfig(max_new_tokens=30, policy="fixed_steps", steps_per_block=2, buffer_size=2),
    ])
    assert compile_stats.compiles() - before == 0


def test_prefill_rounds_give_long_chunks_a_call_of_their_own():
    """Block 4, prefill_chunk 32, row_prefill_min 16: rows with 4 and 8 tokens left share one
    8-token call; 20 and 70 tokens left take a 32-token call each; rows done or not admitted
    make none. Each row advances by what it had left, at most its call's length."""
    bucket_of = lambda n: admission.bucket(n, 4, 32)  # noqa: E731
    full = np.array([8, 8, 24, 80, 40, 0], np.int32)
    start = np.array([8, 4, 4, 10, 32, 0], np.int32)
    rows = np.array([True, True, True, True, True, False])
    left = [0, 4, 20, 70, 8, 0]
    assert [bucket_of(n) for n in left[1:5]] == [4, 32, 32, 8]
    calls, after = admission.next_round(full, start, rows, bucket_of, 16)
    assert [(c.tokens, c.row) for c in calls] == [(8, None), (32, 2), (32, 3)]
    assert calls[0].rows.tolist() == [False, True, False, False, True, False]
    assert after.tolist() == [8, 8, 24, 42, 40, 0]


def test_a_one_shot_warmup_compiles_exactly_what_its_prompts_run(cfg, params):
    """`generate` and `eval` warm up only the prefill buckets their prompts use (block 8,
    prefill_chunk 16: buckets 8 and 16); the compile counter sees every program."""
    programs.clear()  # as in a fresh process: nothing shared from an earlier test's engine
    engine = Engine(cfg, params, batch_size=3, buffer_size=1, prefill_chunk=16)
    prompts = [list(range(10, 19)), [11] * 5]  # 8 and 0 full-block tokens: one 8-token chunk
    assert engine.prefill_buckets_for(prompts) == [8]
    assert engine.prefill_buckets_for([[11] * 40, [12] * 9]) == [8, 16]  # 16, 16, then 8
    assert engine.prefill_buckets_for([[11] * 7]) == []
    with pytest.raises(UserError, match="positive multiple of block_size"):
        Engine(cfg, params, batch_size=1, prefill_chunk=0)  # bench --prefill-chunk 0
    before = compile_stats.compiles()
    engine.warmup(buckets=engine.prefill_buckets_for(prompts))
    warm = compile_stats.compiles()
    assert warm - before >= 3  # the 8-token prefill, the row merge, the decode loop
    engine.generate(prompts, DecodeConfig(max_new_tokens=6))
    assert compile_stats.compiles() == warm
    engine.generate([[11] * 40], DecodeConfig(max_new_tokens=6))  # the 16-token prefill: new
    assert compile_stats.compiles() > warm


def test_an_engine_rebuilt_with_the_same_shapes_shares_its_programs(cfg, params):
    """Engines of one model, mesh and shapes share their jitted programs (engine/programs.py):
    the second one's warm-up traces and compiles nothing (not even a persistent-cache read) and
    it decodes what the first decodes; another N_buf or batch builds programs of its own."""
    programs.clear()
    prompts, d = [list(range(10, 21)), [12] * 4], DecodeConfig(max_new_tokens=12, buffer_size=2)
    first = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=16)
    first.warmup()
    want = [r.token_ids for r in first.generate(prompts, d)]
    before = compile_stats.compiles()
    again = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=16)
    again.warmup()
    assert compile_stats.compiles() == before
    assert [r.token_ids for r in again.generate(prompts, d)] == want
    assert [r.token_ids for r in first.generate(prompts, d)] == want  # its own pool, untouched
    assert compile_stats.compiles() == before
    for other in (Engine(cfg, params, batch_size=2, buffer_size=1, prefill_chunk=16),
                  Engine(cfg, params, batch_size=3, buffer_size=2, prefill_chunk=16)):
        assert other.runner._decode is not first.runner._decode and (
            other.runner._prefill is not first.runner._prefill)


def test_fixed_steps_forward_counts_singlebd_vs_multibd(engine4):
    """blk 8, 4 tokens per step, 24 new tokens from a block-aligned prompt.
    SingleBD: 2 steps per block plus a storing forward between blocks = 8 forwards, 2 bubbles.
    MultiBD (N=2, the next block starts at once): storing overlaps refinement = 5 forwards."""
    prompt = [list(range(10, 18))]
    single = DecodeConfig(max_new_tokens=24, policy="fixed_steps", steps_per_block=2)
    multi = dataclasses.replace(single, buffer_size=2, add_block_threshold=0.0,
                                semi_complete_threshold=0.0)
    (s,) = engine4.generate(prompt, single)
    (m,) = engine4.generate(prompt, multi)
    assert (s.nfe, s.bubble_forwards, s.tokens_unmasked, s.max_active_blocks) == (8, 2, 24, 1)
    assert (m.nfe, m.bubble_forwards, m.tokens_unmasked, m.max_active_blocks) == (5, 0, 24, 2)
    assert s.tpf == 3.0 and m.tpf == pytest.approx(24 / 5)
    # Eager activation: blocks 1 and 2 from the first forward (2 steps fill both), a third
    # forward stores them and unmasks nothing, the third block (the only one before the limit)
    # then takes two: 5 forwards, one of them a bubble.
    eager = dataclasses.replace(multi, block_activation="eager")
    (e,) = engine4.generate(prompt, eager)
    assert (e.nfe, e.bubble_forwards, e.tokens_unmasked, e.max_active_blocks) == (5, 1, 24, 2)
    # 40 tokens: after that storing forward both slots open again (blocks 3 and 4), two fill
    # them, one stores them, and block 5 takes two more: 8 forwards, two bubbles.
    (e,) = engine4.generate(prompt, dataclasses.replace(eager, max_new_tokens=40))
    assert (e.nfe, e.bubble_forwards, e.tokens_unmasked, e.max_active_blocks) == (8, 2, 40, 2)


@pytest.mark.parametrize("max_new,progress,eager", [(24, 1, 2), (9, 1, 2), (8, 1, 1)])
def test_eager_activation_opens_every_slot_before_the_limit(engine4, max_new, progress, eager):
    """A row starts with one active block, or under eager activation with every slot whose block
    starts before its limit (prompt of 8: the first block starts at 8, the second at 16)."""
    d = DecodeConfig(max_new_tokens=max_new, buffer_size=2)
    prompt = [np.arange(10, 18, dtype=np.int32)]
    for decode, want in ((d, progress), (dataclasses.replace(d, block_activation="eager"), eager)):
        st = engine4.initial_state(prompt, [decode])
        assert int(st.n_valid[0]) == want, decode.block_activation


def test_max_nfe_stops_with_the_filled_prefix(engine4):
    (r,) = engine4.generate([PROMPTS[1]], DecodeConfig(max_new_tokens=64, max_nfe=3))
    assert r.finish_reason == "max_nfe" and r.nfe == 3
    assert len(r.token_ids) <= r.tokens_unmasked == 3  # threshold never met: top-1 per step


def test_sampling_is_seeded(engine4):
    d = DecodeConfig(max_new_tokens=16, temperature=1.0, seed=1)
    a = engine4.generate([PROMPTS[0]], d)[0].token_ids
    b = engine4.generate([PROMPTS[0]], d)[0].token_ids
    c = engine4.generate([PROMPTS[0]], dataclasses.replace(d, seed=2))[0].token_ids
    g = engine4.generate([PROMPTS[0]], DecodeConfig(max_new_tokens=16))[0].token_ids
    assert a == b
    assert a != c and a != g


def test_eos_stops_generation(cfg, params):
    """A model whose head always prefers EOS: the first generated position is EOS, the text ends
    there, and the EOS itself is not returned."""
    eos = cfg.eos_token_ids[0]
    p = jax.tree.map(lambda x: x, params)
    p["embed"] = p["embed"].at[:, 0].add(1000.0)  # the residual stream points along dim 0 ...
    p["lm_head"] = p["lm_head"].at[0, eos].set(50.0)  # ... which the head maps to EOS
    eng = Engine(cfg, p, batch_size=2, buffer_size=1, prefill_chunk=16)
    res = eng.generate([PROMPTS[0], PROMPTS[3]], DecodeConfig(max_new_tokens=40))
    for r in res:
        assert r.finish_reason == "stop" and r.token_ids == [] and r.nfe == 1


def _state_after(engine, prompt_len, window_tokens, n_valid, limit=100, decode=None, before=None,
                 edited=()):
    """Runs `advance` on a hand-made window (blk 8, N 2) and returns the new state. `before`: the
    window as the forward found it (default: as admitted, all MASK); `edited`: window positions
    the forward rewrote."""
    cfg = engine.cfg
    prompt = np.arange(10, 10 + prompt_len, dtype=np.int32)
    decode = decode or DecodeConfig(buffer_size=2)
    st = engine.initial_state([prompt], [dataclasses.replace(decode, max_new_tokens=limit - prompt_len)])
    st = st.replace(n_valid=jnp.array([n_valid]))
    if before is not None:
        st = st.replace(canvas=block_buffer.put_window(st, jnp.asarray([before], jnp.int32), st.canvas))
    old = block_buffer.window(st, 16)
    new = jnp.asarray([window_tokens], jnp.int32)
    edit = jnp.zeros_like(new, bool).at[0, list(edited)].set(True)
    return block_buffer.advance(st, new, (new != old) & ~edit, edit, new, block_size=8, n_slots=2,
                                eos_ids=cfg.eos_token_ids, mask_token_id=cfg.mask_token_id)


def test_stop_waits_for_the_prefix_before_eos(engine4):
    m, e = engine4.cfg.mask_token_id, engine4.cfg.eos_token_ids[0]
    # prompt 8 tokens: window = positions 8..23. EOS at position 11 but position 9 still masked.
    st = _state_after(engine4, 8, [20, m, 21, e, m, m, m, m] + [m] * 8, n_valid=1)
    assert not bool(st.done[0])
    # Prefix filled: done, output ends after the EOS, whatever follows it.
    st = _state_after(engine4, 8, [20, 22, 21, e, m, m, m, m] + [m] * 8, n_valid=1)
    assert bool(st.done[0]) and int(st.stop_pos[0]) == 12
    assert int(st.finish[0]) == block_buffer.FINISH_STOP
    # No EOS: a complete first block becomes TO_CACHE and the next block is activated.
    st = _state_after(engine4, 8, list(range(20, 28)) + [m] * 8, n_valid=1)
    assert not bool(st.done[0])
    assert (int(st.n_to_cache[0]), int(st.n_valid[0])) == (1, 2)


@pytest.mark.parametrize("confirm", ["always", "context"])
def test_edit_mode_confirms_blocks_by_rule(engine4, confirm):
    """Edit mode: with "always" a block is final only after a forward that changed nothing in it;
    with "context" also when the forward that wrote it saw every earlier block complete and
    unedited, so only a block written ahead of an unfinished one waits for a confirming forward."""
    m, e = engine4.cfg.mask_token_id, engine4.cfg.eos_token_ids[0]
    d = DecodeConfig(buffer_size=2, sampling_mode="edit", edit_confirm=confirm)
    ahead = confirm == "context"  # what the context rule finalises that "always" does not
    b0, b1 = list(range(20, 28)), list(range(30, 38))
    # Both blocks written by one forward: block 0 saw the whole prompt, block 1 a masked block 0.
    st = _state_after(engine4, 8, b0 + b1, n_valid=2, decode=d)
    assert int(st.n_to_cache[0]) == (1 if ahead else 0)
    # Block 0 was complete before the forward that wrote block 1: both final under "context".
    st = _state_after(engine4, 8, b0 + b1, n_valid=2, decode=d, before=b0 + [m] * 8)
    assert int(st.n_to_cache[0]) == (2 if ahead else 1)
    # The same forward also edited block 0: neither block is final, under either rule.
    st = _state_after(engine4, 8, [21] + b0[1:] + b1, n_valid=2, decode=d, before=b0 + [m] * 8,
                      edited=[0])
    assert int(st.n_to_cache[0]) == 0
    # A one-block answer written with the prompt complete ends at once under "context"; "always"
    # spends one more forward to confirm it.
    st = _state_after(engine4, 8, [20, 21, e] + [m] * 13, n_valid=1, decode=d)
    assert bool(st.done[0]) == ahead
    # Naive mode finalises all of these as soon as they are full (the reference point).
    st = _state_after(engine4, 8, b0 + b1, n_valid=2, decode=dataclasses.replace(d, sampling_mode="naive"))
    assert int(st.n_to_cache[0]) == 2


def test_bad_prompts_name_the_limit(engine4):
    cfg = engine4.cfg
    with pytest.raises(UserError, match="empty prompt"):
        engine4.generate([[]])
    with pytest.raises(UserError, match=f"max_seq_len is {cfg.max_seq_len}"):
        engine4.generate([[11] * cfg.max_seq_len])
    with pytest.raises(UserError, match="mask id"):
        engine4.generate([[11, cfg.mask_token_id]])
    with pytest.raises(UserError, match="buffer_size 3 exceeds"):
        engine4.generate([[11]], DecodeConfig(buffer_size=3))
    # Nothing was corrupted: the engine still produces the same output as before.
    a = engine4.generate([PROMPTS[0]], DecodeConfig(max_new_tokens=8))
    b = engine4.generate([PROMPTS[0]], DecodeConfig(max_new_tokens=8))
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 8


def test_prefill_chunks_interleave_with_running_rows(cfg, params):
    """Row 0 keeps decoding between the prefill chunks of a long prompt admitted into row 1 (a free
    row's decode stores nothing, so it never writes over the prompt being prefilled); both
    rows end exactly as in an offline batch."""
    # no prefix pages shared: the reference run below would otherwise leave the long prompt's
    # first page in the pool, and the admission would map it instead of prefilling it
    eng = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=16, share_prefixes=False)
    long_prompt = [10 + i % 400 for i in range(93)]  # 88 positions of full blocks: 6 chunks
    d = DecodeConfig(max_new_tokens=24)
    want = eng.generate([PROMPTS[0], long_prompt], d)
    state = eng.admit(eng.empty_state(), {0: (PROMPTS[0], d)})
    admission = eng.begin_admit({1: (long_prompt, d)})
    interleaved = 0
    while not eng.prefill_step(admission):
        state = eng.decode_call(state, 2)
        interleaved += 1
    state = eng.finish_admit(state, admission)
    while not np.all(jax.device_get(state.done)):
        state = eng.decode_call(state, 8)
    got = eng.results(state, 2, 0.0)
    assert interleaved >= 4
    assert [r.token_ids for r in got] == [w.token_ids for w in want]


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_and_top_p_keep_the_numpy_reference_set(ties):
    """Per row: the top_k most likely tokens (0: all), cut further to the smallest set whose
    mass reaches top_p, tokens tied with the last one kept included; everything else is masked
    out of sampling. The searched cutoffs equal sorting's on random logits, with ties, a masked
    (NEG_INF) token, k past the vocabulary and p of 1."""
    from mbd_jax.decoding.policy import _truncate
    from mbd_jax.model.layers import NEG_INF
    rng = np.random.default_rng(1 if ties else 0)
    for _ in range(5):
        logits = rng.normal(size=(6, 3, 50)).astype(np.float32) * 2
        if ties:
            logits = np.round(logits * 2) / 2  # many equal logits
        logits[:, :, 7] = NEG_INF
        top_k = np.array([0, 1, 5, 7, 80, 0], np.int32)
        top_p = np.array([0.5, 1.0, 1.0, 0.6, 0.95, 1.0], np.float32)
        kept = np.asarray(_truncate(jnp.asarray(logits), jnp.asarray(top_k),
                                    jnp.asarray(top_p))) > -1e29
        for b in range(6):
            for w in range(3):
                x = logits[b, w].astype(np.float64)
                order = np.argsort(-x, kind="stable")
                p = np.exp(x - x.max())
                p = p[order] / p.sum()
                n = int(np.sum(np.cumsum(p) - p < top_p[b]))
                if top_k[b]:
                    n = min(n, top_k[b])
                want = np.flatnonzero((x >= x[order[n - 1]]) & (x > NEG_INF / 2))
                got = np.flatnonzero(kept[b, w] & (x > NEG_INF / 2))
                assert got.tolist() == want.tolist(), (b, w)


def test_logprobs_equal_a_full_sequence_forward_at_commit_time(cfg, params):
    """With the whole block committed in one step (fixed_steps, 1 step per block), each token was
    written when its block was all masks: its log-probability must equal a full-sequence forward
    (block-causal mask, no cache) of prompt + earlier blocks + a masked block, mask excluded."""
    from mbd_jax.model.layers import NEG_INF
    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer, block_causal_mask

    blk = cfg.block_size
    prompt = list(range(10, 10 + 2 * blk))
    engine = Engine(cfg, params, batch_size=1, buffer_size=1, prefill_chunk=32)
    (r,) = engine.generate([prompt], DecodeConfig(policy="fixed_steps", steps_per_block=1,
                                                  max_new_tokens=3 * blk))
    assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids) > blk
    apply = jax.jit(Transformer(cfg).apply)
    want = []
    for k in range(0, len(r.token_ids), blk):
        seq = prompt + r.token_ids[:k] + [cfg.mask_token_id] * blk
        pos = jnp.arange(len(seq))[None]
        logits, _ = apply({"params": params}, jnp.asarray([seq]),
                          ForwardMeta.explicit(pos, block_causal_mask(pos, blk)))
        logits = logits[0, len(prompt) + k:].at[:, cfg.mask_token_id].set(NEG_INF)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        block = r.token_ids[k: k + blk]
        want += [float(logp[j, t]) for j, t in enumerate(block)]
    np.testing.assert_allclose(r.logprobs, want, atol=1e-4)
    assert all(lp <= 0 for lp in r.logprobs)
