"""The linear-attention layer of a hybrid model: Gated DeltaNet (the Qwen3-Next / Qwen3.5 layer)
as a Flax module over model/delta_rule.py's pure functions.

    x [B, T, D] -> q, k [B, T, Hk, Dk], v, z [B, T, Hv, Dv], b, a [B, T, Hv]   projections
    q, k, v     -> causal depthwise conv (width W, carried input tail), SiLU
    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)                 decay, write strength
    o = gated delta rule under the block mode (cfg.sequence_module.block_mode)
    out = out_proj(gated_rms_norm(o, z))                                       [B, T, D]

Without a cache the layer reads its T tokens as one sequence from position 0, in blocks of
cfg.block_size (the full-sequence reference: the block-causal rule's view of a whole stream), or,
given `meta.groups`, as the trainer's [noisy ; clean] dual stream: each noisy group starts from
the clean state (and conv inputs) before it and chains through its own noisy blocks, which is
what a MultiBD window reads when it decodes that group.
Over a cache (prefill chunks, decode windows) each row starts from its state and conv tail after
its committed positions (zeros when it has none) and reads the T tokens, whole blocks from
there, under the same rule; the state after the tokens `meta.commit` says are committed (and
the tail before them) is written back for the rows `meta.write` selects. Noisy tokens past them
shape this forward's outputs and nothing else (docs/architecture.md, "Block diffusion on a
recurrent state").
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mbd_jax.config import ModelConfig, resolve_auto
from mbd_jax.model import delta_rule
from mbd_jax.model.forward_meta import ForwardMeta, group_starts
from mbd_jax.model.params import NORMAL, param, project, weight
from mbd_jax.model.recurrent_state import RecurrentState


def _pad_blocks(block: int, q, k, v, g, beta):
    """Pads the token axis to whole blocks with tokens that neither decay nor write the state
    (g = 0, beta = 0, k = 0); the caller drops their outputs."""
    pad = -q.shape[1] % block
    if not pad:
        return q, k, v, g, beta
    width = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)  # noqa: E731
    return tuple(jnp.pad(x, width(x)) for x in (q, k, v, g, beta))


def _chunk(chunk_size: int, block: int, tokens: int, platform: str | None) -> int:
    """Tokens per step of the chunked rule over `tokens` (whole blocks) on `platform`
    (config.AUTO's delta_rule_chunk). On CPU one block: the chunked form trades FLOPs for fewer
    sequential steps, which a 2-core CPU does not need (docs/lab/probes/bench_delta_rule.py: a
    256-token prefill at the 35B-A3B head shape, 8 rows, 0.71 s at chunks of 8 against 1.00 s at
    64). Elsewhere the configured chunk, or all the tokens when fewer (a decode window of one or
    two blocks is not padded to a chunk of 64)."""
    if resolve_auto("delta_rule_chunk", "auto", platform) == "block":
        return block
    return min(chunk_size, tokens)


def _dual_stream_conv(channels: jax.Array, weight: jax.Array, groups: jax.Array,
                      block: int) -> jax.Array:
    """The causal conv over a [noisy ; clean] dual stream (channels [B, 2L, C], weight [C, W]):
    the clean half as one sequence; in the noisy half, a position reads the noisy inputs of its
    own group and, before the group's first position, the clean ones (what a decode window reads
    after the committed blocks). Returns the SiLU outputs [B, 2L, C]."""
    b, two_l, c = channels.shape
    seq, width = two_l // 2, weight.shape[1]
    noisy, clean = channels[:, :seq], channels[:, seq:]
    clean_out, _ = delta_rule.causal_conv1d(clean, weight, jnp.zeros((b, width - 1, c), clean.dtype))
    pos = jnp.arange(seq)
    start = jnp.repeat(group_starts(groups), block, axis=1) * block  # [B, L] group's first position
    total = 0
    for i in range(width):  # tap i reads position p - (W - 1) + i
        src = pos - (width - 1) + i  # [L]
        idx = jnp.broadcast_to(jnp.maximum(src, 0)[None, :, None], (b, seq, c))
        from_noisy = jnp.take_along_axis(noisy, idx, axis=1)
        from_clean = jnp.take_along_axis(clean, idx, axis=1)
        value = jnp.where((src[None] >= start)[..., None], from_noisy,
                          jnp.where((src >= 0)[None, :, None], from_clean, 0))
        total = total + value * weight[:, i].astype(value.dtype)
    return jnp.concatenate([jax.nn.silu(total), clean_out], axis=1)


def _dual_stream_rule(q, k, v, g, beta, groups: jax.Array, block: int, mode: str,
                      chunk: int, platform: str | None) -> jax.Array:
    """The gated delta rule over a [noisy ; clean] dual stream (inputs [B, 2L, ...]): the clean
    half from a zero state; each noisy group from the clean state after the blocks before it,
    chained through the group's own noisy blocks (the MultiBD window's view; its restarts go
    block by block, the clean half `chunk` tokens at a time). Returns o [B, 2L, Hv, Dv] float32."""
    seq = q.shape[1] // 2
    halves = [tuple(x[:, lo:lo + seq] for x in (q, k, v, g, beta)) for lo in (seq, 0)]
    hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    zero = jnp.zeros((q.shape[0], hv, dk, dv), jnp.float32)
    o_clean, clean_states = delta_rule.block_outputs(*halves[0], zero, block, mode,
                                                     chunk=_chunk(chunk, block, seq, platform))
    first = group_starts(groups)  # [B, nb]
    restarts = first == jnp.arange(groups.shape[1])[None]  # blocks that start a group
    before = jnp.take_along_axis(clean_states, jnp.maximum(first - 1, 0)[..., None, None, None],
                                 axis=1)  # the clean state after the blocks before the group
    before = jnp.where((first > 0)[..., None, None, None], before, 0.0)
    o_noisy, _ = delta_rule.block_outputs(*halves[1], zero, block, mode,
                                          restart=(restarts, before))
    return jnp.concatenate([o_noisy, o_clean], axis=1)


class GatedDeltaNet(nn.Module):
    cfg: ModelConfig
    mesh: Mesh | None = None  # partitioned by XLA from its weights' shardings: not read here

    @nn.compact
    def __call__(self, x, meta: ForwardMeta, cache: RecurrentState | None, slot):
        """x: [B, T, D] (normed); `slot`: this layer's index among the linear layers (an int, or
        traced when scanned). Returns (out [B, T, D], the states with the committed rows'
        advanced)."""
        cfg, sm = self.cfg, self.cfg.sequence_module
        dt = jnp.dtype(cfg.compute_dtype)
        d, hk, hv, dk, dv = (cfg.hidden_size, sm.num_key_heads, sm.num_value_heads,
                             sm.key_head_dim, sm.value_head_dim)
        b, t, _ = x.shape

        def proj(name, heads, dim):  # x @ W: [B, T, heads, dim]
            w = weight(self, name, (d, heads, dim), ("embed", "heads", "head_dim"), (0,))
            return project("btd,dhk->bthk", x, w, dt)

        q, k, v, z = proj("q_proj", hk, dk), proj("k_proj", hk, dk), proj("v_proj", hv, dv), \
            proj("z_proj", hv, dv)
        w_b = weight(self, "b_proj", (d, hv), ("embed", "heads"), (0,))
        w_a = weight(self, "a_proj", (d, hv), ("embed", "heads"), (0,))
        beta = jax.nn.sigmoid(project("btd,dh->bth", x, w_b, dt).astype(jnp.float32))
        a = project("btd,dh->bth", x, w_a, dt).astype(jnp.float32)
        a_log = param(self, "A_log", (hv,), ("heads",), nn.initializers.zeros)
        dt_bias = param(self, "dt_bias", (hv,), ("heads",), nn.initializers.ones)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a + dt_bias.astype(jnp.float32))

        # The short causal conv over the q, k, v channels together (one carried tail per row).
        conv = [param(self, f"conv_{s}", (sm.conv_kernel, heads, dim), ("conv", "heads", "head_dim"),
                      NORMAL) for s, heads, dim in (("q", hk, dk), ("k", hk, dk), ("v", hv, dv))]
        channels = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)],
                                   axis=-1)  # [B, T, C]
        taps = jnp.concatenate([w.reshape(sm.conv_kernel, -1) for w in conv], axis=-1).T
        state = jnp.zeros((b, hv, dk, dv), jnp.float32)  # a sequence's start
        tail = jnp.zeros((b, sm.conv_kernel - 1, channels.shape[-1]), dt)
        if cache is not None:  # each row's, after its committed positions (none: zeros)
            rows = meta.rows if meta.rows is not None else jnp.arange(b)
            cached_state, cached_tail = (a[rows] for a in cache.read(slot))
            fresh = (meta.write_offset == 0)[:, None, None]
            state = jnp.where(fresh[..., None], state, cached_state)
            tail = jnp.where(fresh, tail, cached_tail.astype(dt))
        dual = cache is None and meta.groups is not None  # the trainer's [noisy ; clean] rows
        if dual:
            mixed = _dual_stream_conv(channels, taps, meta.groups, cfg.block_size)
        else:
            mixed, _ = delta_rule.causal_conv1d(channels, taps, tail)
        q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
        q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)

        if dual:
            o = _dual_stream_rule(q, k, v, g, beta, meta.groups, cfg.block_size, sm.block_mode,
                                  sm.chunk_size, cfg.platform)
        elif cache is None and sm.block_mode == "causal":  # any chunk gives these outputs
            o, _ = delta_rule.chunked(q, k, v, g, beta, state,
                                      _chunk(sm.chunk_size, cfg.block_size, t, cfg.platform))
        else:  # the state after each block, for the commit
            padded = _pad_blocks(cfg.block_size, q, k, v, g, beta)
            o, states = delta_rule.block_outputs(*padded, state, cfg.block_size, sm.block_mode,
                                                 chunk=_chunk(sm.chunk_size, cfg.block_size,
                                                              padded[0].shape[1], cfg.platform))
            o = o[:, :t]
        if cache is not None:
            cache = self._commit(cache, slot, meta, rows, state, states, tail, channels)
        norm = param(self, "norm", (dv,), ("head_dim",), nn.initializers.ones)
        o = delta_rule.gated_rms_norm(o.astype(dt), z, norm, cfg.rms_norm_eps)  # [B, T, Hv, Dv]
        w_out = weight(self, "out_proj", (hv, dv, d), ("heads", "head_dim", "embed"), (0, 1))
        return project("bthk,hkd->btd", o, w_out, dt), cache

    def _commit(self, cache: RecurrentState, slot, meta: ForwardMeta, rows, state, states, tail,
                channels):
        """Writes each storing row's state after its committed blocks (its old one when it
        commits none) and the conv inputs just before them."""
        blk, width = self.cfg.block_size, tail.shape[1]
        n = meta.commit // blk  # [B] committed blocks
        after = jnp.take_along_axis(states, jnp.maximum(n - 1, 0)[:, None, None, None, None],
                                    axis=1)[:, 0]
        after = jnp.where((n > 0)[:, None, None, None], after, state)
        ext = jnp.concatenate([tail, channels], axis=1)  # [B, W - 1 + T, C]
        new_tail = jax.vmap(lambda e, c: jax.lax.dynamic_slice_in_dim(e, c, width))(ext, meta.commit)
        return cache.write(slot, rows, after, new_tail, keep=~meta.write | (n == 0))
