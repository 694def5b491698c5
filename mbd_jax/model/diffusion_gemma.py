"""DiffusionGemma's two passes as pure functions over one parameter tree.

    cache = encode(params, cfg, tokens [B, T], start [B], cache)        # causal: writes KV
    logits = decode(params, cfg, canvas [B, C], cached_len [B], cache, soft [B, C, D], sc_on)

`encode` is the prompt's prefill and each finished canvas's commit: causal attention (sliding
layers: the last `sliding_window` positions, the query's own included) over the cache and the
new tokens, whose keys and values it writes at positions [start, start + T). `decode` is one
denoising step over a canvas at positions [cached_len, cached_len + C): bidirectional over the
whole canvas and the cache, which it reads and never writes; a sliding layer reads the last
sliding_window - 1 cached positions (what transformers' sliding cache holds), a global layer
all of them. The two passes share every weight but each layer's residual scale
(`scalar`: [decoder, encoder]).

Layer (r: the residual stream, [B, T, D]):
    r += post_attn_norm(attn(input_norm(r)))
    r += post_ffn_norm(post_ffn_norm_1(mlp(pre_ffn_norm(r)))
                       + post_ffn_norm_2(experts(pre_ffn_norm_2(r), router(r))))
    r *= scalar[mode]
Attention: q / k RMSNorm with scale, v RMSNorm without (a global layer's v is k's raw
projection), rotary on both, attention scale 1. Logits: final norm, the tied embedding, then
30 * tanh(x / 30) in float32.

The cache here is dense per layer ({"k", "v"}: [B, S, K, Dh] each): the exact reference the
engine's paged pool will be held to.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from mbd_jax.config.diffusion_gemma import DiffusionGemmaConfig
from mbd_jax.model import moe
from mbd_jax.model.layers import NEG_INF, rms_norm

Params = dict[str, Any]
Cache = list[dict[str, jax.Array]]  # per layer: k, v [B, S, K, Dh]
DECODER, ENCODER = 0, 1  # index of each mode's residual scale in a layer's `scalar`

gelu = jax.nn.gelu  # tanh-approximated (transformers' gelu_pytorch_tanh)


def allocate_cache(cfg: DiffusionGemmaConfig, batch: int, capacity: int) -> Cache:
    dtype = jnp.dtype(cfg.dtype)
    return [{name: jnp.zeros((batch, capacity, *cfg.head(i)), dtype) for name in ("k", "v")}
            for i in range(cfg.num_layers)]


def inverse_frequencies(cfg: DiffusionGemmaConfig, layer: int) -> jax.Array:
    """[Dh / 2] rotary frequencies of `layer`: sliding layers every pair at rope_theta; global
    layers ("proportional" rope) the first global_rope_fraction of the pairs at
    global_rope_theta with the exponent over the whole head, the rest 0 (no rotation)."""
    _, dh = cfg.head(layer)
    if cfg.layer_types[layer] == "sliding_attention":
        return 1.0 / cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    rotated = int(cfg.global_rope_fraction * dh // 2)
    freq = 1.0 / cfg.global_rope_theta ** (jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / dh)
    return jnp.concatenate([freq, jnp.zeros(dh // 2 - rotated, jnp.float32)])


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x: [B, T, H, Dh] rotated by half-split pairs (x_i, x_{i + Dh/2}); positions: [B, T]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None].astype(x.dtype)
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _norm(x: jax.Array, weight: jax.Array | None, cfg: DiffusionGemmaConfig) -> jax.Array:
    return rms_norm(x, jnp.float32(1.0) if weight is None else weight, cfg.rms_norm_eps)


def _mlp(x: jax.Array, w: Params) -> jax.Array:
    return (gelu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


def embed(params: Params, cfg: DiffusionGemmaConfig, tokens: jax.Array) -> jax.Array:
    table = params["embed"]
    return table[tokens] * jnp.asarray(math.sqrt(cfg.hidden_size), table.dtype)


def _qkv(w: Params, cfg: DiffusionGemmaConfig, layer: int, x: jax.Array, positions: jax.Array):
    """q [B, T, H, Dh], k, v [B, T, K, Dh] of the normed input x [B, T, D]."""
    b, t, _ = x.shape
    kh, dh = cfg.head(layer)
    inv = inverse_frequencies(cfg, layer)
    q = _norm((x @ w["q"]).reshape(b, t, cfg.num_heads, dh), w["q_norm"], cfg)
    k_raw = (x @ w["k"]).reshape(b, t, kh, dh)
    v = k_raw if "v" not in w else (x @ w["v"]).reshape(b, t, kh, dh)
    k = _norm(k_raw, w["k_norm"], cfg)
    return rope(q, positions, inv), rope(k, positions, inv), _norm(v, None, cfg)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """q: [B, T, H, Dh]; k, v: [B, S, K, Dh]; visible: [B, T, S]. Scale 1 (the q / k norms
    set it). Returns [B, T, H * Dh]."""
    b, t, h, dh = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h * dh)


def _ffn(w: Params, cfg: DiffusionGemmaConfig, r: jax.Array) -> jax.Array:
    """The dense MLP beside the routed experts, both from the residual r [B, T, D]."""
    b, t, d = r.shape
    dense = _norm(_mlp(_norm(r, w["pre_ffn_norm"], cfg), w["mlp"]), w["post_ffn_norm_1"], cfg)
    flat = r.reshape(b * t, d)
    router = w["router"]
    x = _norm(flat, None, cfg) * router["scale"] * jnp.asarray(d ** -0.5, flat.dtype)
    probs = jax.nn.softmax((x @ router["proj"]).astype(jnp.float32), axis=-1)  # [N, E]
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * router["expert_scale"][ids]
    ex = w["experts"]
    routed = moe.experts_dense(_norm(flat, w["pre_ffn_norm_2"], cfg), ids, weights, ex["gate"],
                               ex["up"], ex["down"], act=gelu).reshape(b, t, d)
    return _norm(dense + _norm(routed, w["post_ffn_norm_2"], cfg), w["post_ffn_norm"], cfg)


def _layer(w: Params, cfg: DiffusionGemmaConfig, layer: int, r: jax.Array, positions: jax.Array,
           keys_of, mode: int) -> tuple[jax.Array, Any]:
    """One layer. keys_of(k, v) -> (k, v over every key position [B, S, K, Dh], visible
    [B, T, S], what the layer hands back: its written cache entry or nothing)."""
    q, k, v = _qkv(w["attn"], cfg, layer, _norm(r, w["input_norm"], cfg), positions)
    keys, values, visible, out = keys_of(k, v)
    attn = _attend(q, keys, values, visible) @ w["attn"]["o"]
    r = r + _norm(attn, w["post_attn_norm"], cfg)
    r = r + _ffn(w, cfg, r)
    return r * w["scalar"][mode].astype(r.dtype), out


def logits_of(params: Params, cfg: DiffusionGemmaConfig, h: jax.Array) -> jax.Array:
    """h: [B, T, D] -> [B, T, V] float32, soft-capped."""
    h = _norm(h, params["norm"], cfg)
    x = jnp.einsum("btd,vd->btv", h, params["embed"], preferred_element_type=jnp.float32)
    return cfg.final_logit_softcap * jnp.tanh(x / cfg.final_logit_softcap)


def encode(params: Params, cfg: DiffusionGemmaConfig, tokens: jax.Array, start: jax.Array,
           cache: Cache) -> Cache:
    """Writes the KV of tokens [B, T] at positions start[b] + [0, T) of each row (causal;
    the cache holds every position before start). Returns the cache."""
    b, t = tokens.shape
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    k_pos = jnp.arange(cache[0]["k"].shape[1], dtype=jnp.int32)  # [S]
    r = embed(params, cfg, tokens)
    new_cache = []
    for i, w in enumerate(params["layers"]):
        window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None

        def keys_of(k, v, entry=cache[i], window=window):
            put = jax.vmap(lambda buf, new, s: jax.lax.dynamic_update_slice_in_dim(buf, new, s, 0))
            entry = {"k": put(entry["k"], k.astype(entry["k"].dtype), start),
                     "v": put(entry["v"], v.astype(entry["v"].dtype), start)}
            visible = k_pos[None, None] <= positions[..., None]  # [B, T, S]
            if window is not None:
                visible &= k_pos[None, None] > positions[..., None] - window
            return entry["k"], entry["v"], visible, entry

        r, entry = _layer(w, cfg, i, r, positions, keys_of, ENCODER)
        new_cache.append(entry)
    return new_cache


def soft_embedding(params: Params, cfg: DiffusionGemmaConfig, processed: jax.Array) -> jax.Array:
    """[B, C, D]: the embedding table averaged under softmax(processed) [B, C, V] (a step's
    processed logits), scaled like an embedding: what self-conditioning feeds the next step.
    Carrying this instead of the logits keeps a row's sampler state at C x D, not C x V."""
    table = params["embed"]
    probs = jax.nn.softmax(processed.astype(jnp.float32), axis=-1).astype(table.dtype)
    return (probs @ table) * jnp.asarray(math.sqrt(cfg.hidden_size), table.dtype)


def self_conditioning(params: Params, cfg: DiffusionGemmaConfig, x: jax.Array, soft: jax.Array,
                      sc_on: jax.Array) -> jax.Array:
    """The decoder's input: x [B, C, D] (scaled embeddings) plus the gated MLP of the previous
    step's soft embedding soft [B, C, D] (rows with sc_on [B] False: zero, a canvas's first
    step), normed without scale."""
    soft = jnp.where(sc_on[:, None, None], soft, 0)
    w = params["self_conditioning"]
    return _norm(x + _mlp(_norm(soft, w["pre_norm"], cfg), w), None, cfg)


def decode(params: Params, cfg: DiffusionGemmaConfig, canvas: jax.Array, cached_len: jax.Array,
           cache: Cache, soft: jax.Array, sc_on: jax.Array) -> jax.Array:
    """One denoising step: logits [B, C, V] float32 of canvas [B, C] at positions
    cached_len[b] + [0, C), reading the cache (positions < cached_len) and writing nothing."""
    b, c = canvas.shape
    positions = cached_len[:, None] + jnp.arange(c, dtype=jnp.int32)
    s = cache[0]["k"].shape[1]
    k_pos = jnp.arange(s, dtype=jnp.int32)
    r = self_conditioning(params, cfg, embed(params, cfg, canvas), soft, sc_on)
    for i, w in enumerate(params["layers"]):
        first = cached_len - (cfg.sliding_window - 1) if cfg.layer_types[i] == "sliding_attention" \
            else jnp.zeros_like(cached_len)
        cached = (k_pos[None] < cached_len[:, None]) & (k_pos[None] >= first[:, None])  # [B, S]
        visible = jnp.concatenate([cached, jnp.ones((b, c), bool)], axis=1)[:, None]  # [B, 1, S+C]
        visible = jnp.broadcast_to(visible, (b, c, s + c))

        def keys_of(k, v, entry=cache[i], visible=visible):
            return (jnp.concatenate([entry["k"], k.astype(entry["k"].dtype)], axis=1),
                    jnp.concatenate([entry["v"], v.astype(entry["v"].dtype)], axis=1),
                    visible, None)

        r, _ = _layer(w, cfg, i, r, positions, keys_of, DECODER)
    return logits_of(params, cfg, r)
