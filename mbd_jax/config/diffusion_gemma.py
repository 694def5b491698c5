"""DiffusionGemma (Google, 2026): the uniform-noise block-diffusion family's model and canvas
settings (`DiffusionGemmaConfig`) and its decoding settings (`CanvasDecoding`).

One weight set runs in two modes: a causal *encoder* pass writes the KV cache (the prompt, and
each finished canvas at its commit) and a bidirectional *decoder* pass over the canvas reads it.
Layers alternate sliding-window attention (head_dim, num_kv_heads, rope_theta) and global
attention (global_head_dim, num_global_kv_heads, proportional rope on global_rope_fraction of
the pairs, V = K's raw projection); each layer runs a dense MLP beside a routed MoE. Facts and
field names: transformers' `diffusion_gemma` (the reference mbd-jax matches).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from mbd_jax.config.fields import _check, _check_range

AttentionKind = Literal["sliding_attention", "full_attention"]  # transformers' layer_types names
NoiseKind = Literal["uniform", "deterministic"]  # decoding/canvas.py
TEMPERATURE_RANGE = (1e-4, 1e4)  # a request's t_min and t_max
ENTROPY_LIMIT = 1e6  # entropy_bound and confidence (a canvas's entropies are at most C log V)
STABILITY_LIMIT = 16  # the most steps a request may ask the argmax canvas to hold still (the
# engine keeps that many argmax canvases per row)


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (and the self-conditioning MLP's) width
    num_layers: int
    num_heads: int
    # sliding-window layers
    num_kv_heads: int
    head_dim: int
    sliding_window: int  # a sliding layer's query sees the keys of its last this many positions
    rope_theta: float
    # global layers
    num_global_kv_heads: int
    global_head_dim: int
    global_rope_theta: float
    global_rope_fraction: float  # share of the head's frequency pairs that rotate
    layer_types: tuple[AttentionKind, ...]
    # mixture of experts (every layer, beside the dense MLP)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-6
    final_logit_softcap: float = 30.0
    canvas_length: int = 256
    max_seq_len: int = 4096
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = (1,)
    dtype: Literal["float32", "bfloat16"] = "float32"
    chat_template: Literal["plain", "qwen", "llada2"] = "plain"  # the built-in one (chat.py), used
    # when the model directory ships no Jinja template of its own
    # The platform the programs are built for (an engine sets it from its mesh; None: the first
    # device's): a GPU's experts run as grouped matmuls over the hit experts, a CPU's densely
    platform: Literal["cpu", "gpu", "tpu"] | None = None

    def validate(self, where: str = "model") -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "sliding_window", "num_global_kv_heads",
                  "global_head_dim", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "canvas_length", "max_seq_len"):
            _check(getattr(self, f) > 0, where, f"field '{f}' must be > 0, got {getattr(self, f)}")
        _check(len(self.layer_types) == self.num_layers, where,
               f"field 'layer_types' lists {len(self.layer_types)} layers, the model has "
               f"num_layers={self.num_layers}")
        for kv in ("num_kv_heads", "num_global_kv_heads"):
            _check(self.num_heads % getattr(self, kv) == 0, where,
                   f"field 'num_heads' ({self.num_heads}) must be a multiple of '{kv}'")
        _check(self.num_experts_per_tok <= self.num_experts, where,
               "field 'num_experts_per_tok' must be <= num_experts")
        _check(0 < self.global_rope_fraction <= 1, where,
               "field 'global_rope_fraction' must be in (0, 1]")
        for e in (self.pad_token_id, *self.eos_token_ids):
            _check(0 <= e < self.vocab_size, where, f"special id {e} is outside the vocabulary")
        _check(len(self.eos_token_ids) > 0, where, "field 'eos_token_ids' must list an id")

    def head(self, layer: int) -> tuple[int, int]:
        """(kv heads, head dim) of `layer`."""
        if self.layer_types[layer] == "sliding_attention":
            return self.num_kv_heads, self.head_dim
        return self.num_global_kv_heads, self.global_head_dim


@dataclasses.dataclass(frozen=True)
class CanvasDecoding:
    """How one request's canvases are denoised (transformers' generation_config.json names in
    the comments; their defaults there)."""

    steps: int = 48  # max_denoising_steps: decoder passes per canvas at most
    entropy_bound: float = 0.1  # sampler_config.entropy_bound
    t_min: float = 0.4  # temperature at the last step
    t_max: float = 0.8  # temperature at the first step
    stability: int = 1  # stability_threshold: steps the argmax canvas must hold still
    confidence: float = 0.005  # confidence_threshold: mean entropy below this to stop early
    noise: NoiseKind = "uniform"  # "deterministic": the cross-framework contract (canvas.py)
    seed: int = 0
    max_new_tokens: int = 256  # whole canvases: ceil(max_new_tokens / canvas_length) of them
    # 1: each canvas commits in an encoder pass of its own; 2: the commit shares one forward
    # with the next canvas's first denoising step (exact: decoding/canvas_loop.py)
    buffer_size: int = 1

    def validate(self, where: str = "decoding") -> None:
        _check_range(self, where, "steps", 1, 1 << 16)
        _check_range(self, where, "stability", 0, STABILITY_LIMIT)
        _check_range(self, where, "max_new_tokens", 1, 1 << 30)
        _check_range(self, where, "seed", 0, 2**31 - 1)
        _check_range(self, where, "buffer_size", 1, 2)
        _check(0 < self.entropy_bound <= ENTROPY_LIMIT, where, f"field 'entropy_bound' must be "
               f"in (0, {ENTROPY_LIMIT}], got {self.entropy_bound}")
        # logits (soft-capped at 30) / t stay finite in float32 within these
        _check_range(self, where, "t_min", TEMPERATURE_RANGE[0], TEMPERATURE_RANGE[1])
        _check_range(self, where, "t_max", TEMPERATURE_RANGE[0], TEMPERATURE_RANGE[1])
        _check(self.t_max > self.t_min, where,
               f"field 't_max' ({self.t_max}) must be > t_min ({self.t_min})")
        _check_range(self, where, "confidence", 0, ENTROPY_LIMIT)
