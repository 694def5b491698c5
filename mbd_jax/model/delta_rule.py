"""Pure functions for a gated delta rule sequence layer (the linear-attention half of a Gated
DeltaNet hybrid): the recurrence, its chunked form, the block-diffusion block modes, the
short causal depthwise convolution in front of it and the gated RMSNorm behind it.

The recurrence, per value head, token t (state S: [Dk, Dv], float32):

    S <- exp(g_t) * S                              decay (g_t <= 0, log space)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T      the delta rule: write the correction
    o_t = S^T q_t                                  read (q, k L2-normalised, q scaled by Dk^-1/2)

Shapes: B rows, T tokens, Hk query/key heads, Hv value heads (a multiple of Hk: each query/key
head serves Hv / Hk consecutive value heads), Dk, Dv head dims. q, k: [B, T, Hk, Dk]; v:
[B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dk, Dv] float32.

The chunked form computes the same thing a chunk of C tokens at a time: inside a chunk the
delta-rule writes are folded into one unit lower-triangular solve (the WY / "UT" form: row i of
the system subtracts what the tokens before it in the chunk already wrote along k_i), and a scan
carries the state from chunk to chunk. Zero padding (g = 0, beta = 0, k = 0) leaves the state as it
was, so T need not be a multiple of C.

Block diffusion (docs/architecture.md): a block's tokens are refined together, so a layer needs a
rule for what a position inside the block reads. `block_outputs` offers two, both reading the
state committed before the block and never changing it:

- "causal": inside the block the recurrence runs token by token from the committed state;
- "bidirectional": every position reads the state after the whole block was absorbed, so each
  token sees every token of its block.

At block size 1 both are the autoregressive layer. Over a window of several blocks (MultiBD) block
i starts from the state after the blocks before it; the states after each block come back, so the
caller keeps the one after the blocks it commits.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

BlockMode = Literal["causal", "bidirectional"]
BLOCK_MODES: tuple[str, ...] = ("causal", "bidirectional")


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _heads(x: jax.Array, hv: int, scale: float = 1.0) -> jax.Array:
    """q or k [B, T, Hk, Dk] L2-normalised in float32, scaled, repeated to the Hv value heads
    (query/key head i serves value heads [i * Hv / Hk, (i + 1) * Hv / Hk))."""
    hk = x.shape[2]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of query/key heads {hk}")
    return jnp.repeat(l2_normalize(x) * scale, hv // hk, axis=2)


def _prepare(q, k, v, g, beta):
    """Float32, q and k through `_heads` (q scaled by Dk^-1/2); every tensor head-major: q, k
    [B, Hv, T, Dk], v [B, Hv, T, Dv], g, beta [B, Hv, T]."""
    hv = v.shape[2]
    q, k = _heads(q, hv, q.shape[-1] ** -0.5), _heads(k, hv)
    f32 = jnp.float32
    return (jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v.astype(f32), 1, 2),
            jnp.swapaxes(g.astype(f32), 1, 2), jnp.swapaxes(beta.astype(f32), 1, 2))


def recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time (the reference). Returns (o [B, T, Hv, Dv]
    float32, the state after the last token [B, Hv, Dk, Dv])."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)

    def step(s, x):  # s: [B, Hv, Dk, Dv]
        q_t, k_t, v_t, g_t, b_t = x  # [B, Hv, D] / [B, Hv]
        s = s * jnp.exp(g_t)[..., None, None]
        delta = b_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))  # time-major for the scan
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), state  # o: [T, B, Hv, Dv] -> [B, T, Hv, Dv]


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by matmuls only.

    Recursive blocked inversion, bottom-up: the inverses of the diagonal blocks of size s give
    those of size 2s through [[X, 0], [L, Y]]^-1 = [[X^-1, 0], [-Y^-1 L X^-1, Y^-1]], log2(C)
    levels of batched matmuls (C padded to a power of two with identity rows). Not
    `lax.linalg.triangular_solve`: on CPU that is LAPACK's batched trsm, which deadlocks in
    jaxlib 0.10.2 once the batch is large enough to be split over the intra-op thread pool
    from inside an XLA program (docs/architecture.md, "JAX / library API notes")."""
    c = a.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()  # the next power of two >= C
    lead = a.shape[:-2]
    m = jnp.pad(a, [(0, 0)] * len(lead) + [(0, size - c)] * 2)  # padding: identity rows
    inv = jnp.ones(lead + (size, 1, 1), a.dtype)  # [..., nb, s, s]: the diagonal blocks' inverses
    s = 1
    while s < size:
        nb = size // (2 * s)
        # the lower-left s x s block of each diagonal 2s block of I + A
        blocks = m.reshape(lead + (nb, 2 * s, nb, 2 * s))
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., nb, 2s, 2s]
        lower = blocks[..., s:, :s]
        pairs = inv.reshape(lead + (nb, 2, s, s))
        top, bottom = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -bottom @ lower @ top
        zeros = jnp.zeros_like(corner)
        inv = jnp.concatenate([jnp.concatenate([top, zeros], -1),
                               jnp.concatenate([corner, bottom], -1)], -2)
        s *= 2
    return inv.reshape(lead + (size, size))[..., :c, :c]


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
            state: jax.Array, chunk: int,
            restart: tuple[jax.Array, jax.Array] | None = None,
            states_every: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule `chunk` tokens at a time. Returns (o [B, T, Hv, Dv] float32, the
    state after each span of `states_every` tokens (default: each chunk; it must divide the
    chunk) [B, S, Hv, Dk, Dv], S = ceil(T / states_every); the last is the final state).
    `restart` (flags [B, N] bool, states [B, N, Hv, Dk, Dv], N = ceil(T / chunk)): a flagged
    chunk starts from the given state instead of the one the chunks before it left (the
    trainer's noise groups, each starting from the clean state before it)."""
    every = states_every or chunk
    if chunk % every:
        raise ValueError(f"states every {every} tokens do not divide chunks of {chunk}")
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    n = (t + pad) // chunk

    def split(x):  # [B, H, T, ...] -> [B, H, N, C, ...], zero padded (no decay, no write)
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(b, h, n, chunk, *x.shape[3:])

    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
    gamma = jnp.cumsum(g, axis=-1)  # [B, H, N, C]: log decay from the chunk's start to token i
    i, j = jnp.arange(chunk)[:, None], jnp.arange(chunk)[None, :]
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i (what token j's write has decayed by when
    # token i reads), 0 above the diagonal (masked before the exp: no overflow)
    decay = jnp.exp(jnp.where(j <= i, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    # The chunk's writes in one unit lower-triangular system (I + A) u = beta v: A[i, j] (j < i)
    # is how much of token j's write token i's delta subtracts again.
    a = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k) * decay * (j < i)
    inverse = unit_lower_inverse(a)  # [B, H, N, C, C]: (I + A)^-1
    solve = lambda rhs: jnp.einsum("bhnij,bhnjd->bhnid", inverse, rhs)  # noqa: E731
    u = solve(v * beta[..., None])  # [B, H, N, C, Dv]: the writes with the state left out
    w = solve(k_beta * jnp.exp(gamma)[..., None])  # [B, H, N, C, Dk]: what each reads of it
    scores = jnp.einsum("bhnid,bhnjd->bhnij", q, k) * decay  # inside the chunk, diagonal included
    q_decayed = q * jnp.exp(gamma)[..., None]  # the state at the chunk's start, as read at i
    k_decayed = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]  # a write, as at the chunk's end
    chunk_decay = jnp.exp(gamma[..., -1])[..., None, None]  # [B, H, N, 1, 1]
    m = chunk // every  # spans per chunk
    xs = (u, w, scores, q_decayed, k_decayed, chunk_decay)
    if m > 1:  # the states inside a chunk: each span's own writes, chained across its spans
        ends = gamma[..., every - 1::every]  # [B, H, N, M]: log decay to each span's last token
        # a span's writes as at its end: exp(gamma_end - gamma_j) k_j for j in the span
        span_k = k * jnp.exp(jnp.repeat(ends, every, axis=-1) - gamma)[..., None]
        # S_m = exp(ends_m - ends_{m-1}) S_{m-1} + (span m's writes), S_{-1} the chunk's start
        span_decay = jnp.exp(ends - jnp.pad(ends, [(0, 0)] * 3 + [(1, 0)])[..., :-1])
        xs += (span_k, span_decay, jnp.exp(ends))  # the last: the start state, as at span ends

    def step(s, x):  # s: [B, H, Dk, Dv]
        u_c, w_c, sc_c, qd_c, kd_c, cd_c, *rest = x
        spans_in, given = (rest[:3], rest[3:]) if m > 1 else ((), rest)
        if given:  # this chunk's restart flag [B] and state
            s = jnp.where(given[0][:, None, None, None], given[1], s)
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s)  # the corrections actually written
        o = jnp.einsum("bhck,bhkv->bhcv", qd_c, s) + jnp.einsum("bhij,bhjv->bhiv", sc_c, v_new)
        if spans_in:  # [B, H, M, Dk, Dv]
            sk_c, sd_c, ss_c = spans_in
            writes = jnp.einsum("bhmjk,bhmjv->bhmkv", sk_c.reshape(*sk_c.shape[:2], m, every, dk),
                                v_new.reshape(*v_new.shape[:2], m, every, dv))
            _, chained = jax.lax.associative_scan(
                lambda a, b: (a[0] * b[0], b[0][..., None, None] * a[1] + b[1]),
                (sd_c, writes), axis=2)
            spans = chained + ss_c[..., None, None] * s[:, :, None]
        s = s * cd_c + jnp.einsum("bhck,bhcv->bhkv", kd_c, v_new)
        return s, (o, spans if spans_in else s[:, :, None])

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in xs)
    if restart is not None:
        xs += (jnp.moveaxis(restart[0], 1, 0), jnp.moveaxis(restart[1].astype(jnp.float32), 1, 0))
    _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs)  # states: [N, B, H, M, ..]
    o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]  # [B, H, T, Dv]
    states = jnp.moveaxis(states, 0, 1)  # [B, N, H, M, Dk, Dv]
    states = jnp.swapaxes(states, 2, 3).reshape(b, n * (chunk // every), h, dk, dv)
    return jnp.swapaxes(o, 1, 2), states[:, :-(-t // every)]


def block_outputs(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                  state: jax.Array, block: int, mode: BlockMode,
                  restart: tuple[jax.Array, jax.Array] | None = None, chunk: int | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """A window of whole blocks (T a multiple of `block`) read from the committed `state` under
    the block mode. Returns (o [B, T, Hv, Dv] float32, the state after each block
    [B, T / block, Hv, Dk, Dv]): the caller keeps the one after the blocks it commits.
    `chunk`: tokens per chunked step (a multiple of `block`; default one block); the outputs and
    states do not depend on it. `restart`: blocks that start from a given state (`chunked`;
    chunks of one block only)."""
    chunk = chunk or block
    if q.shape[1] % block:
        raise ValueError(f"{q.shape[1]} tokens are not whole blocks of {block}")
    if mode not in BLOCK_MODES:
        raise ValueError(f"block mode {mode!r}: one of {', '.join(BLOCK_MODES)}")
    if chunk % block or (restart is not None and chunk != block):
        raise ValueError(f"chunk {chunk}: a multiple of the block size {block} (the block size "
                         "itself with restarts)")
    o, states = chunked(q, k, v, g, beta, state, chunk, restart, states_every=block)
    if mode == "causal":
        return o, states
    # bidirectional: every position of block n reads the state after block n
    b, t, _, dk = q.shape
    hv = v.shape[2]
    qn = _heads(q, hv, dk ** -0.5).reshape(b, t // block, block, hv, dk)
    o = jnp.einsum("bnchk,bnhkv->bnchv", qn, states).reshape(b, t, hv, -1)
    return o, states


def causal_conv1d(x: jax.Array, weight: jax.Array, tail: jax.Array,
                  bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """A short causal depthwise convolution with its carried input tail, then SiLU.

    x: [B, T, C]; weight: [C, W]; tail: [B, W - 1, C], the W - 1 inputs before x (zeros at the
    start of a sequence). out[t, c] = silu(bias[c] + sum_i weight[c, i] * x_ext[t + i, c]) over
    x_ext = [tail; x]. Returns (out [B, T, C], the new tail: the last W - 1 inputs of x_ext)."""
    width = weight.shape[1]
    t = x.shape[1]
    ext = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, W - 1 + T, C]
    out = sum(ext[:, i: i + t] * weight[:, i].astype(x.dtype) for i in range(width))
    if bias is not None:
        out = out + bias.astype(x.dtype)
    return jax.nn.silu(out), ext[:, t:]


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of x (float32) times weight, then times silu(gate); x, gate: [..., D]. Not
    layers.rms_norm: the weight multiplies in x's dtype here, as the checkpoints' reference does
    (the two round differently in bfloat16)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = (weight * y.astype(x.dtype)).astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
