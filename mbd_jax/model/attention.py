"""The attention layer: grouped-query attention with RoPE (optional q/k norms and a per-head
output gate) over its paged KV pool (model/paged_kv.py), or, without a cache, over its T tokens
under the explicit mask. Over the pool, `attention_impl` picks the pure-JAX online-softmax loop
(chunked), the Pallas kernel (pallas: model/paged_attention_kernel.py, per shard under a mesh)
or dense masked attention over every position (dense, the reference)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mbd_jax.config import ModelConfig
from mbd_jax.config.backend import platform_or_default
from mbd_jax.errors import UserError
from mbd_jax.model import layers, paged_attention_kernel, rope
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.paged_kv import PagedKV
from mbd_jax.model.params import norm_weight, project, weight
from mbd_jax.parallel.attention import sharded_attention


class Attention(nn.Module):
    cfg: ModelConfig
    mesh: Mesh | None = None  # the kernel runs per shard under it (XLA partitions the rest)

    @nn.compact
    def __call__(self, x, meta: ForwardMeta, kv: PagedKV | None, slot):
        """x: [B, T, D] (normed); `slot`: this layer's index among the attention layers (an int,
        or traced when scanned). Returns (out [B, T, D], the pool with the new entries)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.compute_dtype)
        d, h, kh, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        wq = weight(self, "q_proj", (d, h, dh), ("embed", "heads", "head_dim"), (0,))
        wk = weight(self, "k_proj", (d, kh, dh), ("embed", "kv_heads", "head_dim"), (0,))
        wv = weight(self, "v_proj", (d, kh, dh), ("embed", "kv_heads", "head_dim"), (0,))
        wo = weight(self, "o_proj", (h, dh, d), ("heads", "head_dim", "embed"), (0, 1))
        q = project("btd,dhk->bthk", x, wq, dt)  # [B, T, H, Dh]
        k = project("btd,dhk->bthk", x, wk, dt)  # [B, T, K, Dh]
        v = project("btd,dhk->bthk", x, wv, dt)
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
            elif cfg.attention_impl == "pallas":
                out = self._kernel(q, kv, slot, meta)
            else:
                k_all, v_all = (kv.span(a, meta.rows, 0, kv.capacity) for a in kv.layer(slot))
                visible = layers.block_causal_visible(meta.positions, jnp.arange(kv.capacity),
                                                      meta.visible_len, cfg.block_size)
                out = layers.dense_attention(q, k_all.astype(dt), v_all.astype(dt), visible)
        if cfg.attention_output_gate:  # each head's output scaled by its own sigmoid gate
            wg = weight(self, "gate_proj", (d, h, dh), ("embed", "heads", "head_dim"), (0,))
            out = out * jax.nn.sigmoid(project("btd,dhk->bthk", x, wg, dt))
        return project("bthk,hkd->btd", out, wo, dt), kv

    def _kernel(self, q, kv: PagedKV, slot, meta: ForwardMeta):
        """The Pallas kernel over this layer's pool: compiled for a GPU platform, interpreted
        elsewhere (the same program, for checking it)."""
        cfg = self.cfg
        gpu = platform_or_default(cfg.platform) == "gpu"
        why = paged_attention_kernel.check_shapes(kv.page, cfg.head_dim)
        if gpu and why is not None:
            raise UserError(f"attention_impl: pallas: {why}; use attention_impl: chunked")
        kernel = functools.partial(paged_attention_kernel.paged_attention,
                                   block_size=cfg.block_size, interpret=not gpu)
        rows = jnp.arange(q.shape[0], dtype=jnp.int32) if meta.rows is None else meta.rows
        if self.mesh is not None and self.mesh.size > 1:
            kernel = sharded_attention(kernel, self.mesh)
        k_layer, v_layer = kv.layer(slot)
        return kernel(q, k_layer, v_layer, kv.table, meta.positions, meta.visible_len, rows=rows)
