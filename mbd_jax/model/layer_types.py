"""What each layer type of a model is: its token mixer and the cache kind that mixer keeps.

    LAYER_TYPES[cfg.layer_type(i)] -> LayerType(mixer, cache, param_name)

A mixer is a linen module, `Mixer(cfg, mesh, name=param_name)(x [B, T, D], meta, entry, slot)
-> (out [B, T, D], entry)` (`mesh`: the devices it runs under, None for one), where `entry` is its cache kind's instance for every layer of its type
(None without a cache) and `slot` the layer's index among them. The model's cache
(model/cache.py) is the collection of the kinds its layers name; nothing outside the model looks
at a kind. A new layer type is one entry here (the tests add a toy one at run time).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from mbd_jax.config import ModelConfig
from mbd_jax.model.attention import Attention
from mbd_jax.model.gated_deltanet import GatedDeltaNet
from mbd_jax.model.paged_kv import PagedKV
from mbd_jax.model.recurrent_state import RecurrentState


@dataclasses.dataclass(frozen=True)
class LayerType:
    mixer: type[nn.Module]
    cache: type  # a cache kind (model/cache.py's protocol)
    param_name: str  # the mixer's parameter subtree in each layer (checkpoints keep it)


LAYER_TYPES: dict[str, LayerType] = {
    "full_attention": LayerType(Attention, PagedKV, "attn"),
    "linear_attention": LayerType(GatedDeltaNet, RecurrentState, "linear_attn"),
}


def layer_type(cfg: ModelConfig, layer: int) -> LayerType:
    return LAYER_TYPES[cfg.layer_type(layer)]
