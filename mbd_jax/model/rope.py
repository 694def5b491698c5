"""Rotary position embedding: the per-dimension frequencies (plain, or scaled for contexts past
the pretraining length) and their application to queries and keys.

Scalings (config.RopeScaling, read from a checkpoint's rope_scaling / rope_parameters):
- linear: every frequency divided by `factor` (position interpolation);
- yarn: high-frequency dimensions (many rotations within the pretraining context) kept, low
  ones interpolated by 1/factor, a linear ramp between the dimensions that turn beta_fast and
  beta_slow times over original_max_len; cos and sin scaled by attention_factor
  (default 0.1 ln(factor) + 1);
- llama3: wavelengths longer than original_max_len / low_freq_factor interpolated by 1/factor,
  shorter than original_max_len / high_freq_factor kept, a smooth blend between.
Each is a fixed function of the config, so it is computed once at trace time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mbd_jax.config import ModelConfig, RopeScaling


def frequencies(cfg: ModelConfig) -> tuple[jax.Array, float]:
    """(inverse frequencies [rotary_dim / 2] float32, the cos/sin scale) of `cfg`'s rope."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim // 2, dtype=jnp.float32) * 2.0 / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv, 1.0
    if s.type == "linear":
        return inv / s.factor, 1.0
    if s.type == "yarn":
        return _yarn(inv, s, dim, cfg.rope_theta)
    return _llama3(inv, s), 1.0


def _yarn(inv: jax.Array, s: RopeScaling, dim: int, base: float) -> tuple[jax.Array, float]:
    def dim_turning(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(s.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(s.beta_fast), dim_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if high == low:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    inv = inv * ramp / s.factor + inv * (1.0 - ramp)  # ramp 0: kept, 1: interpolated
    scale = s.attention_factor
    if scale is None:
        scale = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return inv, float(scale)


def _llama3(inv: jax.Array, s: RopeScaling) -> jax.Array:
    wavelength = 2 * math.pi / inv
    long_wave = s.original_max_len / s.low_freq_factor
    short_wave = s.original_max_len / s.high_freq_factor
    scaled = jnp.where(wavelength > long_wave, inv / s.factor, inv)
    blend = (s.original_max_len / wavelength - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * scaled / s.factor + blend * scaled
    middle = (wavelength >= short_wave) & (wavelength <= long_wave)
    return jnp.where(middle, blended, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               scale: float = 1.0) -> jax.Array:
    """Rotates the first 2 * len(inv_freq) dims of each head (half-split convention, as HF
    Qwen3/LLaDA2), cos and sin times `scale`.

    x: [B, T, N, Dh]; positions: [B, T] int.
    """
    half = inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2, rest = x32[..., :half], x32[..., half:2 * half], x32[..., 2 * half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x.dtype)
