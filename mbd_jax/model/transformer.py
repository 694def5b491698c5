"""The block-diffusion transformer (Flax linen). One forward, used by training, prefill and decode:

    logits, cache = model.apply(params, tokens[B, T], meta, cache)

`meta` (model/forward_meta.py) carries the positions and the rest of what the layers need. With a
cache (model/cache.py: one entry per layer type), each layer's token mixer (model/layer_types.py)
stores what it keeps of the T new tokens for the rows `meta.write` selects (an attention layer:
K/V at `meta.write_offset`) and reads the cache under the block-causal rule on absolute
positions, bounded by `meta.visible_len`. Without one (`cache=None`), the layers read the T tokens
themselves under the explicit `meta.mask[B, T, T]` (training, the full-sequence reference).

The layers run unrolled or as one nn.scan per run of identical layers (model/layout.py); either
way each layer gets its index and the carry (x, cache); each kind's arrays follow the loop
(per-layer arrays unrolled, one stacked array scanned).

With a device `mesh` of more than one device, the routed experts run expert-parallel inside
shard_map (parallel/expert.py); everything else is partitioned by XLA from the parameter and
KV-buffer shardings (parallel/mesh.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mbd_jax.config import ModelConfig
from mbd_jax.model import layers, layout, moe, quantize
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.forward_meta import ForwardMeta
from mbd_jax.model.layer_types import layer_type
from mbd_jax.model.params import (NORMAL, draw_normals, expert_weight, norm_weight, param,
                                  project, weight)
from mbd_jax.parallel.expert import sharded_experts
from mbd_jax.parallel.mesh import tree_shardings


class DenseMLP(nn.Module):
    cfg: ModelConfig
    width: int

    @nn.compact
    def __call__(self, x):
        cfg, dt = self.cfg, jnp.dtype(self.cfg.compute_dtype)
        d, f = cfg.hidden_size, self.width
        wg = weight(self, "gate_proj", (d, f), ("embed", "mlp"), (0,))
        wu = weight(self, "up_proj", (d, f), ("embed", "mlp"), (0,))
        wd = weight(self, "down_proj", (f, d), ("mlp", "embed"), (0,))
        h = jax.nn.silu(project("...d,df->...f", x, wg, dt)) * project("...d,df->...f", x, wu, dt)
        return project("...f,fd->...d", h, wd, dt)


class MoE(nn.Module):
    cfg: ModelConfig
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x, positions):  # x: [B, T, D]; positions: [B, T]
        cfg, dt = self.cfg, jnp.dtype(self.cfg.compute_dtype)
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        b, t, _ = x.shape
        tokens = x.reshape(b * t, d)  # [N, D]
        w_router = param(self, "router", (d, e), ("embed", "expert"), NORMAL)
        logits = tokens.astype(jnp.float32) @ w_router.astype(jnp.float32)  # router in float32
        bias = None if cfg.router == "softmax_topk" else param(
            self, "expert_bias", (e,), ("expert",), nn.initializers.zeros)
        allowed = None  # block routing: each window's pool of experts
        if cfg.router_block_pool:
            choice = logits if bias is None else moe.selection_scores(logits, bias)
            allowed = moe.block_pools(choice.reshape(b, t, e), positions,
                                      cfg.router_block_window or cfg.block_size,
                                      cfg.router_block_pool)
        if cfg.router == "softmax_topk":
            ids, weights = moe.route_softmax_topk(logits, cfg.num_experts_per_tok,
                                                  cfg.norm_topk_prob, cfg.routed_scaling_factor,
                                                  allowed)
        else:
            ids, weights = moe.route_sigmoid_grouped(
                logits, bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                cfg.norm_topk_prob, cfg.routed_scaling_factor, allowed)
            # tokens routed to each expert, for the trainer's bias update (kept only when the
            # caller makes "intermediates" mutable: training; decoding never does)
            self.sow("intermediates", "expert_load", moe.expert_load(ids, e),
                     init_fn=lambda: jnp.zeros((e,), jnp.float32), reduce_fn=jnp.add)
        gate, up, down = moe.EXPERT_WEIGHTS
        wg = expert_weight(self, gate, (e, d, f), ("expert", "embed", "mlp"))
        wu = expert_weight(self, up, (e, d, f), ("expert", "embed", "mlp"))
        wd = expert_weight(self, down, (e, f, d), ("expert", "mlp", "embed"))
        experts = moe.EXPERT_IMPLS[moe.resolve_impl(cfg.moe_impl, cfg.platform)]
        if self.mesh is not None and self.mesh.size > 1:
            experts = sharded_experts(experts, self.mesh)
        out = experts(tokens, ids, weights, moe.cast(wg, dt), moe.cast(wu, dt), moe.cast(wd, dt))
        if cfg.num_shared_experts > 0:
            shared = DenseMLP(cfg, cfg.num_shared_experts * f, name="shared")(tokens)
            if cfg.shared_expert_gate:  # [N, D] scaled by sigmoid(x . w) per token
                w_gate = param(self, "shared_gate", (d,), ("embed",), NORMAL)
                shared = shared * jax.nn.sigmoid(tokens @ w_gate.astype(dt))[:, None]
            out = out + shared
        return out.reshape(b, t, d)


class DecoderLayer(nn.Module):
    """One layer; `index` fixes its kind (token mixer: model/layer_types.py; dense MLP or MoE),
    `layer` (int or traced) is where its cache entries live. Carry in, carry out, so the same
    module runs unrolled or under nn.scan."""
    cfg: ModelConfig
    index: int
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, carry, layer, meta: ForwardMeta):
        cfg = self.cfg
        x, cache = carry  # x: [B, T, D]
        norm = lambda name: norm_weight(self, name, cfg.hidden_size, ("embed",))  # noqa: E731
        h = layers.rms_norm(x, norm("input_norm"), cfg.rms_norm_eps)
        name, kind = cfg.layer_type(self.index), layer_type(cfg, self.index)
        mixer = kind.mixer(cfg, self.mesh, name=kind.param_name)
        if cache is None:
            mixed, _ = mixer(h, meta, None, None)
        else:  # the mixer reads and writes its own kind's entry
            mixed, entry = mixer(h, meta, cache.entries[name], cache.slot(layer))
            cache = cache.with_entry(name, entry)
        x = x + mixed
        h = layers.rms_norm(x, norm("post_attn_norm"), cfg.rms_norm_eps)
        if cfg.is_moe_layer(self.index):
            x = x + MoE(cfg, self.mesh, name="moe")(h, meta.positions)
        else:
            x = x + DenseMLP(cfg, cfg.intermediate_size, name="mlp")(h)
        return (x, cache), None


class Transformer(nn.Module):
    cfg: ModelConfig
    mesh: Mesh | None = None  # expert parallelism under this mesh (None: one device)

    @nn.compact
    def __call__(self, tokens, meta: ForwardMeta, cache: ModelCache | None = None):
        """tokens: [B, T] int32. Returns (logits [B, T, V] float32, the updated cache or None)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.compute_dtype)
        if (cache is None) == meta.uses_cache:
            raise ValueError("a forward over a cache needs ForwardMeta.cached, one without "
                             "ForwardMeta.explicit")
        embed = param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                       NORMAL)
        carry = (jnp.take(embed, tokens, axis=0).astype(dt), cache)  # x: [B, T, D]
        if layout.scanned(cfg):
            for start, stop in layout.runs(cfg):
                run = nn.scan(DecoderLayer, variable_axes={"params": 0, "intermediates": 0},
                              split_rngs={"params": True}, length=stop - start,
                              in_axes=(0, nn.broadcast),
                              metadata_params={nn.PARTITION_NAME: "layers"})
                carry, _ = run(cfg, start, self.mesh, name=layout.run_name(start, stop))(
                    carry, jnp.arange(start, stop, dtype=jnp.int32), meta)
        else:
            for i in range(cfg.num_layers):
                carry, _ = DecoderLayer(cfg, i, self.mesh, name=f"layer_{i}")(carry, i, meta)
        x, kv = carry
        x = layers.rms_norm(x, norm_weight(self, "final_norm", cfg.hidden_size, ("embed",)),
                            cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, embed.astype(dt), preferred_element_type=jnp.float32)
        else:
            head = param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                          NORMAL)
            logits = jnp.einsum("btd,dv->btv", x, head.astype(dt), preferred_element_type=jnp.float32)
        return logits, kv


def init_params(cfg: ModelConfig, seed: int | None = None, mesh: Mesh | None = None) -> dict:
    """Random parameters in `cfg`'s runtime layout (plain arrays, logical-axis boxes removed),
    deterministic in `seed` and the same values whatever the layer loop (drawn in the canonical
    layout, then stacked); with a mesh, each device computes only its own shards (parallel/mesh.py
    rules). A quantized config draws the float weights and quantizes them."""
    shardings = None
    if mesh is not None:
        shardings = tree_shardings(param_logical_axes(cfg), param_shapes(cfg), mesh)
    if cfg.quantization != "none":
        drawn = init_params(dataclasses.replace(cfg, quantization="none"), seed, mesh)
        return quantize.quantize_tree(drawn, param_shapes(cfg), shardings)
    model = Transformer(layout.canonical(cfg))
    tokens = jnp.zeros((1, cfg.block_size), jnp.int32)
    mask = jnp.ones((1, cfg.block_size, cfg.block_size), bool)
    key = jax.random.PRNGKey(cfg.seed if seed is None else seed)

    def init(k):
        boxed = model.init(k, tokens, ForwardMeta.explicit(tokens, mask))["params"]
        flat = mesh is None or mesh.size == 1
        canonical = nn.meta.unbox(draw_normals(boxed, k, cfg.init_std, flat))
        return layout.to_runtime(canonical, cfg)

    return jax.jit(init, out_shardings=shardings)(key)


def _layout_key(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its layer loop resolved: configs that differ only in how the loop is named
    ("auto" or the loop it stands for) share one parameter layout, hence one cache entry below."""
    return dataclasses.replace(cfg, layer_loop=layout.resolve_loop(cfg.layer_loop, cfg.platform))


def param_shapes(cfg: ModelConfig) -> Any:
    """ShapeDtypeStructs of `cfg`'s parameters in its runtime layout (what init_params returns).
    Shared: do not mutate the tree."""
    return _abstract_params(_layout_key(cfg))[0]


def param_logical_axes(cfg: ModelConfig) -> Any:
    """The logical axis names of every parameter (a tree shaped like the params). Shared: do not
    mutate the tree."""
    return _abstract_params(_layout_key(cfg))[1]


@functools.cache
def _abstract_params(cfg: ModelConfig) -> tuple[Any, Any]:
    """(shapes, logical axes) of `cfg`'s runtime parameters from one abstract init of the model in
    its runtime layout. Cached per layout: a trace of init traces the whole model (about half a
    second for a 4-layer one), and loading a model, its shardings and its restore target ask."""
    model = Transformer(cfg)
    tokens = jnp.zeros((1, cfg.block_size), jnp.int32)
    mask = jnp.ones((1, cfg.block_size, cfg.block_size), bool)
    boxed = jax.eval_shape(lambda k: model.init(k, tokens, ForwardMeta.explicit(tokens, mask)),
                           jax.random.PRNGKey(0))["params"]
    return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)


def block_causal_mask(positions: jax.Array, block_size: int) -> jax.Array:
    """The full-sequence block-causal mask [B, T, T] for positions [B, T] (explicit path)."""
    return layers.block_causal_visible(positions, positions, jnp.full(positions.shape[:1], 2**30),
                                       block_size)
