"""What `auto` (and `measure`) settings stand for on a backend: the one table of such defaults."""

from __future__ import annotations

# What `auto` stands for, per JAX backend ("*": every other one): the one table of such defaults.
# moe_impl: on CPU the looped path reads only the hit experts' weights (dense computes all E,
# tiled gathers a weight matrix per tile, ragged_dot expands densely); accelerators have a
# grouped-matmul kernel behind ragged_dot. layer_loop: XLA:CPU copies a scanned layer's whole
# weight slice before use, which undoes the looped expert path's reading only the hit experts
# (0.2x PyTorch at batch 16 scanned against 1.1x unrolled, docs/lab/performance-history.md), so CPU stays
# unrolled; elsewhere the scan keeps compile time flat in depth.
AUTO: dict[str, dict[str, str]] = {
    "moe_impl": {"cpu": "looped", "*": "ragged"},
    "layer_loop": {"cpu": "unrolled", "*": "scan"},
    # a linear-attention layer's chunked rule: a block per step on CPU, the configured chunk
    # elsewhere (model/gated_deltanet.py)
    "delta_rule_chunk": {"cpu": "block", "*": "configured"},
}


# The expert paths `moe_impl: measure` times, per backend: at a few copies per expert computing
# every expert for every token can beat the loop over the hit ones on CPU (docs/lab/performance-history.md),
# and which one wins depends on the model, the batch and the host.
MEASURED: dict[str, dict[str, tuple[str, ...]]] = {
    "moe_impl": {"cpu": ("looped", "dense"), "*": ("ragged", "dense")},
}


def platform_or_default(backend: str | None) -> str:
    """`backend`, or unset (a config built for no mesh: training, a lone forward) the platform of
    the first device, the one an engine without a mesh runs on."""
    if backend is None:
        import jax

        backend = jax.devices()[0].platform
    return backend


def resolve_auto(field: str, value: str, backend: str | None = None) -> str:
    """What `value` of setting `field` stands for on `backend` (default: the first device's).
    `measure` is `auto` wherever no engine warm-up has measured (training, a lone forward, an
    engine before its warm-up)."""
    if value not in ("auto", "measure"):
        return value
    table = AUTO[field]
    backend = platform_or_default(backend)
    return table.get(backend, table["*"])


def measured_candidates(field: str, backend: str | None = None) -> tuple[str, ...]:
    """The values `measure` times for setting `field` on `backend` (MEASURED)."""
    table = MEASURED[field]
    return table.get(platform_or_default(backend), table["*"])
