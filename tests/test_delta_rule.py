"""The gated delta rule layer's pure functions (model/delta_rule.py) against a NumPy recurrence
in float64 and against transformers' own Qwen3-Next functions (torch)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from mbd_jax.model import delta_rule

B, HK, HV, DK, DV = 2, 2, 4, 8, 6


def inputs(t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, HK, DK)).astype(np.float32)
    k = rng.normal(size=(B, t, HK, DK)).astype(np.float32)
    v = rng.normal(size=(B, t, HV, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 1.0, size=(B, t, HV)).astype(np.float32)  # log decay <= 0
    beta = rng.uniform(0.0, 1.0, size=(B, t, HV)).astype(np.float32)
    state = rng.normal(size=(B, HV, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def numpy_reference(q, k, v, g, beta, state):
    """The recurrence written out in float64: (o [B, T, Hv, Dv], the state after each token
    [B, T, Hv, Dk, Dv])."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    rep = HV // HK
    q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), rep, axis=2) / np.sqrt(DK)
    k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), rep, axis=2)
    t = q.shape[1]
    o = np.zeros((B, t, HV, DV))
    states = np.zeros((B, t, HV, DK, DV))
    for i in range(t):
        for b in range(B):
            for h in range(HV):
                s[b, h] *= np.exp(g[b, i, h])
                delta = beta[b, i, h] * (v[b, i, h] - s[b, h].T @ k[b, i, h])
                s[b, h] += np.outer(k[b, i, h], delta)
                o[b, i, h] = s[b, h].T @ q[b, i, h]
        states[:, i] = s
    return o, states


@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_chunked_equals_the_recurrence_and_numpy(chunk):
    x = inputs(21)  # not a multiple of 4 or 8: the last chunk is padded
    ref_o, ref_states = numpy_reference(*x)
    o, state = jax.jit(delta_rule.recurrent)(*x)
    np.testing.assert_allclose(o, ref_o, atol=1e-5)
    np.testing.assert_allclose(state, ref_states[:, -1], atol=1e-5)
    o, states = jax.jit(delta_rule.chunked, static_argnums=6)(*x, chunk)
    np.testing.assert_allclose(o, ref_o, atol=1e-5)
    ends = [min(e, 21) - 1 for e in range(chunk, 21 + chunk, chunk)]  # each chunk's last token
    np.testing.assert_allclose(states, ref_states[:, ends], atol=1e-5)


@pytest.mark.parametrize("size", [1, 3, 8, 13, 64])
def test_unit_lower_inverse_equals_numpy(size):
    """(I + A)^-1 of strictly lower-triangular A, any size (padded to a power of two inside)."""
    rng = np.random.default_rng(size)
    a = np.tril(rng.uniform(-0.5, 0.5, size=(3, 2, size, size)), -1)
    want = np.linalg.inv(np.eye(size) + a)
    got = np.asarray(delta_rule.unit_lower_inverse(jax.numpy.asarray(a, np.float32)))
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_chunked_calls_no_lapack():
    """The chunked rule is matmuls only: LAPACK's batched triangular solve, called from inside an
    XLA:CPU program, deadlocks jaxlib 0.10.2 once its batch is split over the thread pool (the
    hybrid's training step hung in its first step)."""
    q, k, v, g, beta, state = inputs(16)
    text = jax.jit(lambda *x: delta_rule.chunked(*x, chunk=8)).lower(
        q, k, v, g, beta, state).as_text()
    assert "custom_call" not in text, "a custom call (LAPACK?) in the delta rule's program"


@pytest.mark.parametrize("chunk,every", [(8, 4), (8, 1), (16, 8), (4, 4)])
def test_chunked_states_every_span(chunk, every):
    """The state after each span of `every` tokens, read inside chunks of `chunk` (21 tokens:
    the last span is cut short, its state is the final one)."""
    x = inputs(21, seed=4)
    ref_o, ref_states = numpy_reference(*x)
    o, states = delta_rule.chunked(*x, chunk, states_every=every)
    np.testing.assert_allclose(o, ref_o, atol=1e-5)
    ends = [min(e, 21) - 1 for e in range(every, 21 + every, every)]
    np.testing.assert_allclose(states, ref_states[:, ends], atol=1e-5)


def test_state_carried_across_calls_equals_one_call():
    """Two calls of 10 and 11 tokens at chunk 4 (the first call ends inside a chunk, and inside a
    block of 4 were the chunk one), the second starting from the first's state."""
    q, k, v, g, beta, state = inputs(21, seed=1)
    whole, final = delta_rule.chunked(q, k, v, g, beta, state, 4)
    first, s1 = delta_rule.chunked(q[:, :10], k[:, :10], v[:, :10], g[:, :10], beta[:, :10],
                                   state, 4)
    second, s2 = delta_rule.chunked(q[:, 10:], k[:, 10:], v[:, 10:], g[:, 10:], beta[:, 10:],
                                    s1[:, -1], 4)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, atol=1e-5)
    np.testing.assert_allclose(s2[:, -1], final[:, -1], atol=1e-5)


def test_equals_transformers_qwen3_next_functions():
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, state = inputs(19, seed=2)
    t = {n: torch.from_numpy(a) for n, a in zip("q k v g beta state".split(), (q, k, v, g, beta, state))}
    for fn, kw in ((hf.torch_chunk_gated_delta_rule, {"chunk_size": 8}),
                   (hf.torch_recurrent_gated_delta_rule, {})):
        o_ref, s_ref = fn(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["state"],
                          output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        o, states = delta_rule.chunked(q, k, v, g, beta, state, 8)
        np.testing.assert_allclose(o, o_ref.numpy(), atol=1e-5)
        np.testing.assert_allclose(states[:, -1], s_ref.numpy(), atol=1e-5)


def test_block_modes():
    """Causal: the recurrence inside each block. Bidirectional: every position of a block reads
    the state after its whole block. At block size 1 both are the recurrence. Both return the
    state after each block, chained from the committed state."""
    x = inputs(12, seed=3)
    ref_o, ref_states = numpy_reference(*x)
    for mode in delta_rule.BLOCK_MODES:
        o, states = delta_rule.block_outputs(*x, 1, mode)
        np.testing.assert_allclose(o, ref_o, atol=1e-5)
        np.testing.assert_allclose(states, ref_states, atol=1e-5)
    o, states = delta_rule.block_outputs(*x, 4, "causal")
    np.testing.assert_allclose(o, ref_o, atol=1e-5)
    np.testing.assert_allclose(states, ref_states[:, 3::4], atol=1e-5)

    o, states = delta_rule.block_outputs(*x, 4, "bidirectional")
    np.testing.assert_allclose(states, ref_states[:, 3::4], atol=1e-5)
    q = np.asarray(x[0], np.float64)
    qn = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), HV // HK, axis=2) / np.sqrt(DK)
    for i in range(12):  # token i reads the state after its block's last token
        after = ref_states[:, i // 4 * 4 + 3]  # [B, Hv, Dk, Dv]
        np.testing.assert_allclose(o[:, i], np.einsum("bhk,bhkv->bhv", qn[:, i], after), atol=1e-5)
    assert not np.allclose(o, ref_o, atol=1e-3)  # the two modes differ past block size 1

    for mode in delta_rule.BLOCK_MODES:  # chunks of several blocks: the same outputs and states
        want = delta_rule.block_outputs(*x, 4, mode)
        for chunk in (8, 12, 16):
            got = delta_rule.block_outputs(*x, 4, mode, chunk=chunk)
            np.testing.assert_allclose(got[0], want[0], atol=1e-5, err_msg=f"{mode} {chunk}")
            np.testing.assert_allclose(got[1], want[1], atol=1e-5, err_msg=f"{mode} {chunk}")

    with pytest.raises(ValueError, match="a multiple of the block size 4"):
        delta_rule.block_outputs(*x, 4, "causal", chunk=6)
    with pytest.raises(ValueError, match="whole blocks of 5"):
        delta_rule.block_outputs(*x, 5, "causal")
    with pytest.raises(ValueError, match="causal, bidirectional"):
        delta_rule.block_outputs(*x, 4, "sideways")


def test_causal_conv_carries_its_tail_and_equals_transformers():
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    rng = np.random.default_rng(4)
    c, width, t = 6, 4, 11
    x = rng.normal(size=(B, t, c)).astype(np.float32)
    weight = rng.normal(size=(c, width)).astype(np.float32)
    bias = rng.normal(size=(c,)).astype(np.float32)
    zeros = np.zeros((B, width - 1, c), np.float32)
    whole, tail = delta_rule.causal_conv1d(x, weight, zeros, bias)
    ref = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(weight),
                              torch.from_numpy(bias), activation="silu").transpose(1, 2)
    np.testing.assert_allclose(whole, ref.numpy(), atol=1e-5)
    np.testing.assert_array_equal(tail, x[:, -(width - 1):])
    for cut in (2, 7):  # a first piece shorter than the tail, and a longer one
        a, tail_a = delta_rule.causal_conv1d(x[:, :cut], weight, zeros, bias)
        b, tail_b = delta_rule.causal_conv1d(x[:, cut:], weight, tail_a, bias)
        np.testing.assert_allclose(np.concatenate([a, b], axis=1), whole, atol=1e-6)
        np.testing.assert_array_equal(tail_b, tail)


def test_gated_rms_norm_equals_transformers():
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    rng = np.random.default_rng(5)
    x, gate = (rng.normal(size=(3, 5, 16)).astype(np.float32) for _ in range(2))
    norm = hf.Qwen3NextRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(rng.normal(size=16).astype(np.float32)))
        ref = norm(torch.from_numpy(x), torch.from_numpy(gate)).numpy()
    got = delta_rule.gated_rms_norm(x, gate, norm.weight.detach().numpy(), 1e-6)
    np.testing.assert_allclose(got, ref, atol=1e-5)
