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

The cache is paged (`PagedCache`): per layer a pool of pages k, v [P, page, K, Dh] (sliding and
global layers have their own head shapes) and one page table [B, n] for every layer, so both
kinds of layer store a position in the same page. A layer reads a row's pages in table order
(positions [0, n * page)) and writes a token at (table[b, s // page], s % page); a table entry
P maps nothing (writes there are dropped, reads give zeros). A dense cache is the special case
of one page per row (`allocate_cache`). Every layer stores every position, sliding ones too
(a sliding layer reads only its last window; keeping just that would need a ring of pages per
row: not done).
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from mbd_jax.config.backend import platform_or_default
from mbd_jax.config.diffusion_gemma import DiffusionGemmaConfig
from mbd_jax.model import moe
from mbd_jax.model.layers import NEG_INF, rms_norm
from mbd_jax.model.quantize import SCALE_SUFFIX, Quantized

Params = dict[str, Any]
DECODER, ENCODER = 0, 1  # index of each mode's residual scale in a layer's `scalar`

gelu = jax.nn.gelu  # tanh-approximated (transformers' gelu_pytorch_tanh)


@flax.struct.dataclass
class PagedCache:
    layers: list[dict[str, jax.Array]]  # per layer: k, v [P, page, K, Dh]
    table: jax.Array  # [B, n] int32: the pool page of each row's logical page (P: none)

    @property
    def page(self) -> int:
        return self.layers[0]["k"].shape[1]

    @property
    def span(self) -> int:
        """Positions a row's table can address."""
        return self.table.shape[1] * self.page


Cache = PagedCache


def allocate_pool(cfg: DiffusionGemmaConfig, pages: int, page: int) -> list[dict[str, jax.Array]]:
    """Zeroed pages for every layer: k, v [pages, page, K, Dh] with the layer's head shape."""
    dtype = jnp.dtype(cfg.dtype)
    return [{name: jnp.zeros((pages, page, *cfg.head(i)), dtype) for name in ("k", "v")}
            for i in range(cfg.num_layers)]


def allocate_cache(cfg: DiffusionGemmaConfig, batch: int, capacity: int) -> PagedCache:
    """A dense cache: one page of `capacity` positions per row."""
    return PagedCache(allocate_pool(cfg, batch, capacity),
                      jnp.arange(batch, dtype=jnp.int32)[:, None])


def _read(buf: jax.Array, table: jax.Array) -> jax.Array:
    """buf [P, page, K, Dh] -> [B, n * page, K, Dh]: each row's pages in `table` [B, n] order."""
    pages = buf.at[table].get(mode="fill", fill_value=0)  # [B, n, page, K, Dh]
    b, n, page = pages.shape[:3]
    return pages.reshape(b, n * page, *buf.shape[2:])


def _span(cfg: DiffusionGemmaConfig, layer: int, cache: "PagedCache", start: jax.Array, t: int
          ) -> tuple[jax.Array, jax.Array]:
    """(the table [B, n'] of the pages a layer reads, their positions [B, n' * page]). A global
    layer reads a row's whole table; a sliding layer only the pages holding its window of this
    forward's tokens, positions [start - window + 1, start + t) (the encoder tokens' own keys
    and the canvas's cached ones), when that is fewer pages. Positions past the table map no
    page (read as zeros) and lie past every query: masked."""
    page, n = cache.page, cache.table.shape[1]
    wanted = -(-(cfg.sliding_window - 1 + t) // page) + 1
    if cfg.layer_types[layer] != "sliding_attention" or wanted >= n:
        return cache.table, jnp.arange(n * page, dtype=jnp.int32)[None]
    first = jnp.maximum(start - (cfg.sliding_window - 1), 0) // page  # [B]
    logical = first[:, None] + jnp.arange(wanted, dtype=jnp.int32)  # [B, n']
    table = jnp.where(logical < n, jnp.take_along_axis(
        cache.table, jnp.minimum(logical, n - 1), axis=1), cache.layers[0]["k"].shape[0])
    positions = (logical[:, :, None] * page + jnp.arange(page, dtype=jnp.int32)).reshape(
        logical.shape[0], -1)
    return table, positions


def _write(buf: jax.Array, table: jax.Array, positions: jax.Array, new: jax.Array,
           write: jax.Array) -> jax.Array:
    """new [B, T, K, Dh] stored at positions [B, T] of the rows `write` [B] selects; a position
    outside a row's table is dropped."""
    page, n = buf.shape[1], table.shape[1]
    logical = positions // page
    slot = jnp.take_along_axis(table, jnp.clip(logical, 0, n - 1), axis=1)
    ok = write[:, None] & (positions >= 0) & (logical < n)
    slot = jnp.where(ok, slot, buf.shape[0])
    return buf.at[slot, positions % page].set(new.astype(buf.dtype), mode="drop")


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


def _dot(x: jax.Array, w: Params, name: str) -> jax.Array:
    """x [..., in] @ w[name] [in, out]; an 8-bit weight (canvas_model.QUANTIZED) enters the
    matmul as it is, cast, and its per-output-channel scale multiplies the product."""
    scale = w.get(name + SCALE_SUFFIX)
    if scale is None:
        return x @ w[name]
    return (x @ w[name].astype(x.dtype)) * scale[0].astype(x.dtype)


def _expert_weight(w: Params, name: str, dtype) -> jax.Array:
    """A stacked expert weight [E, in, out] in `dtype` (an 8-bit one times its [E, 1, out]
    scales: the dense expert path reads them whole)."""
    scale = w.get(name + SCALE_SUFFIX)
    return w[name] if scale is None else w[name].astype(dtype) * scale.astype(dtype)


def _mlp(x: jax.Array, w: Params) -> jax.Array:
    return _dot(gelu(_dot(x, w, "gate")) * _dot(x, w, "up"), w, "down")


def embed(params: Params, cfg: DiffusionGemmaConfig, tokens: jax.Array) -> jax.Array:
    table = params["embed"]
    return table[tokens] * jnp.asarray(math.sqrt(cfg.hidden_size), table.dtype)


def _qkv(w: Params, cfg: DiffusionGemmaConfig, layer: int, x: jax.Array, positions: jax.Array):
    """q [B, T, H, Dh], k, v [B, T, K, Dh] of the normed input x [B, T, D]."""
    b, t, _ = x.shape
    kh, dh = cfg.head(layer)
    inv = inverse_frequencies(cfg, layer)
    q = _norm(_dot(x, w, "q").reshape(b, t, cfg.num_heads, dh), w["q_norm"], cfg)
    k_raw = _dot(x, w, "k").reshape(b, t, kh, dh)
    v = k_raw if "v" not in w else _dot(x, w, "v").reshape(b, t, kh, dh)
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
    ex, x = w["experts"], _norm(flat, w["pre_ffn_norm_2"], cfg)
    if platform_or_default(cfg.platform) == "cpu":  # every expert on every token
        routed = moe.experts_dense(x, ids, weights, *(
            _expert_weight(ex, n, flat.dtype) for n in ("gate", "up", "down")), act=gelu)
    else:  # grouped matmuls over the hit experts; 8-bit weights enter them as they are
        routed = moe.experts_ragged(x, ids, weights, *(
            ex[n] if n + SCALE_SUFFIX not in ex else Quantized(ex[n], ex[n + SCALE_SUFFIX])
            for n in ("gate", "up", "down")), act=gelu)
    routed = routed.reshape(b, t, d)
    return _norm(dense + _norm(routed, w["post_ffn_norm_2"], cfg), w["post_ffn_norm"], cfg)


def _layer(w: Params, cfg: DiffusionGemmaConfig, layer: int, r: jax.Array, positions: jax.Array,
           entry: dict[str, jax.Array], table: jax.Array, written: int, write: jax.Array,
           span: tuple[jax.Array, jax.Array], encoder: jax.Array
           ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One layer over r [B, T + C, D]: its first `written` (T) tokens are encoder tokens whose
    K/V go into the layer's pages (rows `write` [B]), the rest a canvas whose K/V only the
    canvas reads. span: (the pages it reads [B, n'], their positions [B, S]: _span); encoder
    [T + C] bool picks each token's residual scale. Returns (r, the entry)."""
    q, k, v = _qkv(w["attn"], cfg, layer, _norm(r, w["input_norm"], cfg), positions)
    if written:
        at = positions[:, :written]
        entry = {"k": _write(entry["k"], table, at, k[:, :written], write),
                 "v": _write(entry["v"], table, at, v[:, :written], write)}
    dtype, (read, k_pos) = entry["k"].dtype, span
    keys = jnp.concatenate([_read(entry["k"], read), k[:, written:].astype(dtype)], axis=1)
    values = jnp.concatenate([_read(entry["v"], read), v[:, written:].astype(dtype)], axis=1)
    visible = _visible(cfg, layer, positions, k_pos, written, r.shape[1] - written)
    attn = _dot(_attend(q, keys, values, visible), w["attn"], "o")
    r = r + _norm(attn, w["post_attn_norm"], cfg)
    r = r + _ffn(w, cfg, r)
    scale = jnp.where(encoder[:, None], w["scalar"][ENCODER], w["scalar"][DECODER])
    return r * scale.astype(r.dtype), entry


def _visible(cfg: DiffusionGemmaConfig, layer: int, positions: jax.Array, k_pos: jax.Array,
             t: int, c: int) -> jax.Array:
    """[B, T + C, S + C] which key each token reads: an encoder token (the first T) the cached
    positions up to its own (a sliding layer: its last sliding_window), never the canvas; a
    canvas token every cached position before the canvas (a sliding layer: the last
    sliding_window - 1) and the whole canvas."""
    b = positions.shape[0]
    k_pos = k_pos[:, None]  # [B or 1, 1, S]: the cached keys' positions
    q_pos = positions[..., None]  # [B, T + C, 1]
    canvas_start = positions[:, t:t + 1, None] if c else q_pos  # [B, 1, 1]
    sliding = cfg.layer_types[layer] == "sliding_attention"
    enc = (k_pos <= q_pos) & ((k_pos > q_pos - cfg.sliding_window) if sliding else True)
    dec = (k_pos < canvas_start) & (
        (k_pos >= canvas_start - (cfg.sliding_window - 1)) if sliding else True)
    is_enc = (jnp.arange(t + c) < t)[None, :, None]
    cached = jnp.where(is_enc, enc, dec)  # [B, T + C, S]
    canvas = jnp.broadcast_to(~is_enc, (b, t + c, c))
    return jnp.concatenate([cached, canvas], axis=2)


def forward(params: Params, cfg: DiffusionGemmaConfig, commit: jax.Array | None,
            start: jax.Array, cache: Cache, canvas: jax.Array | None = None,
            soft: jax.Array | None = None, sc_on: jax.Array | None = None, head: bool = True,
            write: jax.Array | None = None) -> tuple[Cache, jax.Array | None]:
    """Both passes in one forward: the encoder pass over commit [B, T] at positions
    start[b] + [0, T) (its KV written for the rows `write` [B] selects, default all: a row
    left out keeps what its cache holds there, and its canvas reads that), then a decoder step
    over canvas [B, C] right after it
    (positions start + T + [0, C)), reading the cache and the committed tokens' fresh KV. Either
    part may be absent (None). Every token's computation is the one its pass alone would do.
    Returns (the cache, the canvas's logits [B, C, V] float32 or None; `head` False: its last
    hidden states [B, C, D] instead, for a caller that applies logits_of in pieces)."""
    parts, t, c = [], 0, 0
    if commit is not None:
        t = commit.shape[1]
        parts.append(embed(params, cfg, commit))
    if canvas is not None:
        c = canvas.shape[1]
        parts.append(self_conditioning(params, cfg, embed(params, cfg, canvas), soft, sc_on))
    r = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    positions = start[:, None] + jnp.arange(t + c, dtype=jnp.int32)
    encoder = jnp.arange(t + c) < t
    write = jnp.ones(r.shape[0], bool) if write is None else write
    layers = []
    for i, w in enumerate(params["layers"]):
        r, entry = _layer(w, cfg, i, r, positions, cache.layers[i], cache.table, t, write,
                          _span(cfg, i, cache, start, t), encoder)
        layers.append(entry)
    new_cache = cache.replace(layers=layers)
    if not c:
        return new_cache, None
    return new_cache, logits_of(params, cfg, r[:, t:]) if head else r[:, t:]


def encode(params: Params, cfg: DiffusionGemmaConfig, tokens: jax.Array, start: jax.Array,
           cache: Cache) -> Cache:
    """Writes the KV of tokens [B, T] at positions start[b] + [0, T) of each row (causal;
    the cache holds every position before start). Returns the cache."""
    return forward(params, cfg, tokens, start, cache)[0]


def decode(params: Params, cfg: DiffusionGemmaConfig, canvas: jax.Array, cached_len: jax.Array,
           cache: Cache, soft: jax.Array, sc_on: jax.Array) -> jax.Array:
    """One denoising step: logits [B, C, V] float32 of canvas [B, C] at positions
    cached_len[b] + [0, C), reading the cache (positions < cached_len) and writing nothing."""
    return forward(params, cfg, None, cached_len, cache, canvas, soft, sc_on)[1]


def logits_of(params: Params, cfg: DiffusionGemmaConfig, h: jax.Array) -> jax.Array:
    """h: [B, T, D] -> [B, T, V] float32, soft-capped."""
    h = _norm(h, params["norm"], cfg)
    x = jnp.einsum("btd,vd->btv", h, params["embed"], preferred_element_type=jnp.float32)
    return cfg.final_logit_softcap * jnp.tanh(x / cfg.final_logit_softcap)


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
