"""mbd-jax: serve, convert and train MoE block-diffusion language models with JAX."""

__version__ = "0.1.0"
