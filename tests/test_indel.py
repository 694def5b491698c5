"""Levenshtein editing (decoding/indel.py): each op's effect on a block against a list-based
reference, the progress rule, the final round, the anti-loop rule on hand-made logits, and on a
model that predicts the actions often: the invariants every step and a KV cache equal to a full
forward of the final text."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mbd_jax.config import DecodeConfig
from mbd_jax.decoding import block_buffer, indel, loop
from mbd_jax.engine import Engine, admission
from mbd_jax.errors import UserError
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.transformer import Transformer
from tests.conftest import tiny_cfg, tiny_params

M = 4  # tiny-test's mask id
DELETE, SPLIT = 5, 6
D, S = indel.OP_DELETE, indel.OP_SPLIT


def reference_apply(block: list[int], ops: list[int], lo: int, hi: int) -> list[int]:
    """One block after its ops, by list edits: the positions [lo, hi) move, the rest stay."""
    out = []
    for tok, op in zip(block[lo:hi], ops[lo:hi]):
        out += [M] * (op == S) + [tok] * (op != D)
    out = (out + [M] * (hi - lo))[: hi - lo]
    return block[:lo] + out + block[hi:]


def run_apply(blocks, ops, regions):
    win = jnp.asarray([sum(blocks, [])], jnp.int32)
    vals = win.astype(jnp.float32) / 100
    region = jnp.asarray([sum(regions, [])])
    got, moved = indel.apply(win, vals, jnp.asarray([sum(ops, [])], jnp.int32), region,
                             len(blocks), M)
    return np.asarray(got[0]).tolist(), np.asarray(moved[0])


def test_delete_shifts_left_and_split_inserts_a_mask_inside_the_block():
    b0 = [10, 11, 12, 13, 14, 15, 16, 17]
    b1 = [20, 21, 22, 23, 24, 25, 26, 27]
    everywhere = [[True] * 8, [True] * 8]
    # DELETE at 2: the rest of block 0 moves left, a MASK fills its end; block 1 untouched
    got, vals = run_apply([b0, b1], [[0, 0, D, 0, 0, 0, 0, 0], [0] * 8], everywhere)
    assert got == [10, 11, 13, 14, 15, 16, 17, M] + b1
    assert vals[2] == pytest.approx(0.13) and vals[7] == 0.0  # values travel with their tokens
    # SPLIT at 1 in block 1: a MASK before 21, 27 drops off the block's end
    got, _ = run_apply([b0, b1], [[0] * 8, [0, S, 0, 0, 0, 0, 0, 0]], everywhere)
    assert got == b0 + [20, M, 21, 22, 23, 24, 25, 26]
    # prompt positions (before the region) and positions past the limit (after it) stay put
    region = [[False, False, True, True, True, True, False, False], [True] * 8]
    got, _ = run_apply([b0, b1], [[0, 0, S, 0, D, 0, 0, 0], [0] * 8], region)
    assert got == [10, 11, M, 12, 13, 15, 16, 17] + b1


def test_apply_equals_the_list_reference_on_random_ops():
    rng = np.random.default_rng(0)
    for _ in range(200):
        blk = int(rng.choice([4, 8]))
        block = rng.integers(10, 60, blk).tolist()
        block = [M if rng.random() < 0.2 else t for t in block]
        lo = int(rng.integers(0, blk))
        hi = int(rng.integers(lo, blk + 1))
        ops = [int(rng.choice([0, 0, D, S])) if lo <= i < hi and block[i] != M else 0
               for i in range(blk)]
        region = [lo <= i < hi for i in range(blk)]
        got, _ = run_apply([block], [ops], [region])
        assert got == reference_apply(block, ops, lo, hi), (block, ops, lo, hi)


def test_the_progress_rule_drains_the_masks():
    """In a block with M masks a step keeps at most M - 1 ops and fills ops + 1 masks, so it ends
    with fewer masks; a block with no mask keeps all its ops."""
    rng = np.random.default_rng(1)
    for _ in range(100):
        blk, n = 8, 2
        win = rng.integers(10, 60, (1, n * blk))
        win[rng.random(win.shape) < 0.3] = M
        masked = jnp.asarray(win == M)
        op_conf = jnp.asarray(rng.random((1, n * blk, 2)), jnp.float32)
        conf = jnp.asarray(rng.random((1, n * blk)) * 0.5, jnp.float32)
        op, forced = indel.plan(op_conf, conf, ~masked, masked, jnp.zeros(1), n)
        new, _ = indel.apply(jnp.where(forced, 30, jnp.asarray(win)), conf, op,
                             jnp.ones_like(masked), n, M)
        before = np.asarray(masked).reshape(n, blk).sum(-1)
        after = (np.asarray(new) == M).reshape(n, blk).sum(-1)
        n_ops = (np.asarray(op) != 0).reshape(n, blk).sum(-1)
        proposed, _ = indel.choose(op_conf, conf, ~masked, jnp.zeros(1))
        n_proposed = (np.asarray(proposed) != 0).reshape(n, blk).sum(-1)
        for m0, m1, o, want in zip(before, after, n_ops, n_proposed):
            if m0 > 0:
                assert o == min(want, m0 - 1) and (o == 0 or m1 < m0), (m0, m1, o)
            else:
                assert o == want  # a full block keeps every op


# ---------------------------------------------------------------- the step on hand-made logits
BLK, N = 8, 2


def hand_state(cfg, window, decode, prompt_len=8):
    """One row: prompt 10.. of prompt_len tokens, its first block cached, window as given."""
    prompt = np.arange(10, 10 + prompt_len, dtype=np.int32)
    decode = dataclasses.replace(decode, max_new_tokens=64)
    params = admission.row_params(cfg, [prompt], [decode])
    st = block_buffer.initial_state([prompt], 128, BLK, N, M, params,
                                    history=indel.history_len(cfg))
    st = jax.tree.map(jnp.asarray, st)
    st = st.replace(n_valid=jnp.array([1], jnp.int32))
    return st.replace(canvas=block_buffer.put_window(st, jnp.asarray([window], jnp.int32),
                                                     st.canvas))


def logits_for(cfg, prefer: dict[int, int], default: int = 20, strength: float = 20.0):
    """A forward that ignores its input: at window position i the token prefer.get(i, default)
    has probability ~1."""
    want = np.full(N * BLK, default)
    for i, t in prefer.items():
        want[i] = t
    logits = jnp.asarray(np.eye(cfg.vocab_size, dtype=np.float32)[want] * strength)[None]

    def apply_fn(_, tokens, meta, kv):
        return logits[:, : tokens.shape[1]], kv
    return apply_fn


def step(cfg, st, apply_fn):
    return loop.decode_step(None, st, None, apply_fn=apply_fn, cfg=cfg, n_slots=N, debug=True)[0]


@pytest.fixture(scope="module")
def ops_cfg():
    return tiny_cfg(delete_token_id=DELETE, split_token_id=SPLIT)


INDEL = DecodeConfig(buffer_size=2, sampling_mode="indel", edit_threshold=0.5,
                     accept_threshold=0.9, add_block_threshold=2.0)


def test_a_step_deletes_and_splits_where_the_model_says(ops_cfg):
    block = [20, 21, 22, 23, 24, 25, 26, 27]
    st = hand_state(ops_cfg, block + [M] * 8, INDEL)
    fwd = logits_for(ops_cfg, {i: t for i, t in enumerate(block)} | {1: DELETE, 4: SPLIT})
    st = step(ops_cfg, st, fwd)
    assert np.asarray(block_buffer.window(st, 16))[0, :8].tolist() == [20, 22, 23, M, 24, 25, 26, 27]
    assert int(st.n_edits[0]) == 2 and int(st.violations[0]) == 0
    # naive and edit mode never take an op; edit_threshold above the ops' confidence neither
    for d in (dataclasses.replace(INDEL, sampling_mode="edit"),
              dataclasses.replace(INDEL, edit_threshold=1.0)):
        st = step(ops_cfg, hand_state(ops_cfg, block + [M] * 8, d), fwd)
        assert np.asarray(block_buffer.window(st, 16))[0, :8].tolist() == block


def test_ops_in_a_block_with_masks_are_paid_for_by_fills(ops_cfg):
    """Two masks, three ops proposed: one op stays (the most confident), two masks fill."""
    block = [20, M, 22, 23, M, 25, 26, 27]
    st = hand_state(ops_cfg, block + [M] * 8, dataclasses.replace(INDEL, accept_threshold=1.0))
    fwd = logits_for(ops_cfg, {0: DELETE, 2: DELETE, 3: DELETE, 1: 30, 4: 31, 5: 25, 6: 26, 7: 27})
    st = step(ops_cfg, st, fwd)
    got = np.asarray(block_buffer.window(st, 16))[0, :8].tolist()
    assert got.count(M) == 1 and int(st.n_edits[0]) == 1  # 2 masks - 2 fills + 1 op
    assert got == [30, 22, 23, 31, 25, 26, 27, M]  # the first DELETE (ties: lowest position)


def test_the_final_round_takes_no_ops(ops_cfg):
    """A block at its last allowed step (block_size + max_post_edit_steps forwards) ignores
    the ops; its text settles and commits."""
    block = [20, 21, 22, 23, 24, 25, 26, 27]
    d = dataclasses.replace(INDEL, max_post_edit_steps=2)
    st = hand_state(ops_cfg, block + [M] * 8, d)
    fwd = logits_for(ops_cfg, {i: t for i, t in enumerate(block)} | {3: DELETE})
    st = st.replace(slot_steps=st.slot_steps.at[0, 0].set(BLK + 2 - 1))
    st = step(ops_cfg, st, fwd)
    assert np.asarray(block_buffer.window(st, 16))[0, :8].tolist() == block
    assert int(st.n_to_cache[0]) == 1 and int(st.n_edits[0]) == 0


def test_a_block_that_returns_to_an_earlier_state_stops_its_ops(ops_cfg):
    """A full block of 20s, the model deleting its first token and filling masks with 20: delete
    (a MASK at the end), fill (the block as it was), delete again: a state it held: ops off. The
    block then fills, settles and commits."""
    st = hand_state(ops_cfg, [20] * 8 + [M] * 8, INDEL)
    fwd = logits_for(ops_cfg, {0: DELETE})
    seen = []
    for _ in range(8):
        st = step(ops_cfg, st, fwd)
        seen.append((np.asarray(block_buffer.window(st, 16))[0, :8].tolist().count(M),
                     bool(st.ops_off[0, 0]), int(st.n_to_cache[0])))
    assert seen[:4] == [(1, False, 0), (0, False, 0), (1, True, 0), (0, True, 0)], seen
    assert (0, True, 1) in seen  # settled after a forward that changed nothing: TO_CACHE
    assert int(st.violations[0]) == 0


# ---------------------------------------------------------------- a model that takes the ops
def ops_params(base):
    """tiny-test's weights with DELETE and SPLIT often the model's first choice."""
    p = jax.tree.map(lambda x: x, base)
    p["embed"] = p["embed"].at[:, 0].add(0.5)
    p["lm_head"] = p["lm_head"].at[0, DELETE].set(4.0).at[0, SPLIT].set(4.0)
    return p


PROMPTS = [list(range(10, 10 + n)) for n in (3, 8, 13, 20)]


@pytest.fixture(scope="module")
def ops_engine(ops_cfg):
    return Engine(ops_cfg, ops_params(tiny_params()), batch_size=4, buffer_size=2,
                  prefill_chunk=32, debug=True)


@pytest.mark.parametrize("decode", [
    DecodeConfig(max_new_tokens=40, buffer_size=2, add_block_threshold=0.0,
                 sampling_mode="indel", edit_threshold=0.05, accept_threshold=0.1),
    DecodeConfig(max_new_tokens=40, buffer_size=2, block_activation="eager",
                 sampling_mode="indel", edit_threshold=0.2, temperature=0.8, seed=3),
    DecodeConfig(max_new_tokens=30, buffer_size=1, sampling_mode="indel", edit_threshold=0.05,
                 edit_confirm="context", max_post_edit_steps=4),
], ids=["multibd", "eager-sampled", "singlebd-context"])
def test_invariants_hold_and_the_cache_is_exact(ops_cfg, ops_engine, decode):
    """Every step keeps the Block Buffer invariants (debug mode raises otherwise; no action id
    on the canvas), the ops really ran, and the KV of every committed position equals one clean
    forward over the final tokens."""
    eng = ops_engine
    prompts = [np.asarray(p, np.int32) for p in PROMPTS]
    state = eng.run_decode(eng.admit(eng.empty_state(), {i: (p, decode) for i, p in enumerate(prompts)}))
    host = jax.device_get(state)
    assert host.n_edits.sum() > 0 and host.done.all()
    cached = host.cached_len[:4]
    n_max = int(cached.max())
    meta = ForwardMeta.cached(jnp.broadcast_to(jnp.arange(n_max), (4, n_max)),
                              jnp.zeros(4, jnp.int32), jnp.asarray(cached, jnp.int32))
    ref = Transformer(ops_cfg).apply({"params": eng.params}, jnp.asarray(host.canvas[:4, :n_max]),
                                     meta, ModelCache.allocate(ops_cfg, 4, eng.capacity))[1]
    for row in range(4):
        n = int(cached[row])
        assert n > len(PROMPTS[row]) and (host.canvas[row, :n] != M).all()
        for got, want in zip(eng.kv.positional.rows_view(), ref.positional.rows_view()):
            assert float(jnp.max(jnp.abs(got[:, row, :n] - want[:, row, :n]))) <= 1e-5


def test_indel_changes_the_text_and_ends_every_row(ops_engine):
    d = DecodeConfig(max_new_tokens=40, buffer_size=2, sampling_mode="indel", edit_threshold=0.05,
                     accept_threshold=0.1)
    edit = ops_engine.generate(PROMPTS, dataclasses.replace(d, sampling_mode="edit"))
    ops = ops_engine.generate(PROMPTS, d)
    assert all(r.finish_reason in ("length", "stop") for r in ops)
    assert any(a.token_ids != b.token_ids for a, b in zip(edit, ops))
    assert all(DELETE not in r.token_ids and SPLIT not in r.token_ids for r in ops + edit)


def test_indel_needs_a_model_with_edit_ops(cfg, params):
    eng = Engine(cfg, params, batch_size=1, buffer_size=1, prefill_chunk=16)
    with pytest.raises(UserError, match="sampling_mode 'indel' needs a model with delete and split"):
        eng.check_decode(DecodeConfig(sampling_mode="indel"))
    with pytest.raises(Exception, match="delete_token_id"):
        tiny_cfg(delete_token_id=M, split_token_id=SPLIT)
    with pytest.raises(Exception, match="come together"):
        tiny_cfg(delete_token_id=DELETE)
