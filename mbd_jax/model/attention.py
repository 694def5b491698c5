"""The attention layer: grouped-query attention with RoPE (optional q/k norms and a per-head
output gate) over its paged KV pool (model/paged_kv.py), or, without a cache, over its T tokens
under the explicit mask."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig
from mbd_jax.model import layers, rope
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.paged_kv import PagedKV
from mbd_jax.model.params import NORMAL, norm_weight, param


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, meta: ForwardMeta, kv: PagedKV | None, slot):
        """x: [B, T, D] (normed); `slot`: this layer's index among the attention layers (an int,
        or traced when scanned). Returns (out [B, T, D], the pool with the new entries)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.compute_dtype)
        d, h, kh, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        wq = param(self, "q_proj", (d, h, dh), ("embed", "heads", "head_dim"), NORMAL)
        wk = param(self, "k_proj", (d, kh, dh), ("embed", "kv_heads", "head_dim"), NORMAL)
        wv = param(self, "v_proj", (d, kh, dh), ("embed", "kv_heads", "head_dim"), NORMAL)
        wo = param(self, "o_proj", (h, dh, d), ("heads", "head_dim", "embed"), NORMAL)
        q = jnp.einsum("btd,dhk->bthk", x, wq.astype(dt))  # [B, T, H, Dh]
        k = jnp.einsum("btd,dhk->bthk", x, wk.astype(dt))  # [B, T, K, Dh]
        v = jnp.einsum("btd,dhk->bthk", x, wv.astype(dt))
        if cfg.qk_norm:
            q = layers.rms_norm(q, norm_weight(self, "q_norm", dh, ("head_dim",)), cfg.rms_norm_eps)
            k = layers.rms_norm(k, norm_weight(self, "k_norm", dh, ("head_dim",)), cfg.rms_norm_eps)
        inv_freq, scale = rope.frequencies(cfg)
        q = rope.apply_rope(q, meta.positions, inv_freq, scale)
        k = rope.apply_rope(k, meta.positions, inv_freq, scale)

        if kv is None:  # explicit-mask path over the T tokens themselves
            out = layers.dense_attention(q, k, v, meta.mask)
        else:  # write into the buffer, then attend over it
            kv = kv.write(slot, k, v, meta)
            if cfg.attention_impl == "chunked":
                out = layers.chunked_attention(q, kv, slot, meta.positions, meta.visible_len,
                                               cfg.block_size, min(cfg.attention_chunk, kv.capacity),
                                               meta.rows, used=meta.write)
            else:
                k_all, v_all = (kv.span(a, meta.rows, 0, kv.capacity) for a in kv.layer(slot))
                visible = layers.block_causal_visible(meta.positions, jnp.arange(kv.capacity),
                                                      meta.visible_len, cfg.block_size)
                out = layers.dense_attention(q, k_all.astype(dt), v_all.astype(dt), visible)
        if cfg.attention_output_gate:  # each head's output scaled by its own sigmoid gate
            wg = param(self, "gate_proj", (d, h, dh), ("embed", "heads", "head_dim"), NORMAL)
            out = out * jax.nn.sigmoid(jnp.einsum("btd,dhk->bthk", x, wg.astype(dt)))
        return jnp.einsum("bthk,hkd->btd", out, wo.astype(dt)), kv
