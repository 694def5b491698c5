"""A third layer type plugs into the model through its cache kind alone: a toy token mixer that
keeps a running sum per row runs beside gated attention and Gated DeltaNet layers through
admission, decode, the offloader and the prefix store (RAM), with no line of mbd_jax/ naming it."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import ClassVar

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.cache.prefix_store import PrefixStore, state_key
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from mbd_jax.model import layer_types
from mbd_jax.model.cache import ModelCache
from mbd_jax.model.params import NORMAL, param
from mbd_jax.model.transformer import init_params
from tests.test_hybrid import hybrid_cfg
from tests.test_prefix_cache import first_step_logits

WIDTH = 8  # floats per row and layer of the running sum


@flax.struct.dataclass
class RunningSumCache:
    """Per layer and row: the sum of the layer's inputs over the row's committed positions."""

    sums: jax.Array  # [L, B, WIDTH] float32

    positional: ClassVar[bool] = False

    @classmethod
    def allocate(cls, cfg, layers, batch, capacity, pages, dtype, stacked):
        return cls(sums=jnp.zeros((layers, batch, WIDTH), jnp.float32))

    @classmethod
    def logical_axes(cls, cfg, layers, stacked):
        return cls(sums=("layers", None, None))

    @staticmethod
    def snapshot_size(cfg, layers):
        return layers * WIDTH

    def snapshot(self, rows):
        return jnp.transpose(self.sums[:, rows], (1, 0, 2)).reshape(len(rows), -1)

    def restore(self, entry, row):
        return self.replace(sums=self.sums.at[:, row].set(entry.reshape(-1, WIDTH)))

    def nbytes(self):
        return self.sums.nbytes

    def read(self, slot):
        return jax.lax.dynamic_index_in_dim(self.sums, slot, keepdims=False)  # [B, WIDTH]

    def write(self, slot, rows, sums, keep):
        index = jnp.where(keep, self.sums.shape[1], rows)  # kept rows: out of range, dropped
        return self.replace(sums=self.sums.at[slot, index].set(sums, mode="drop"))


class RunningSum(nn.Module):
    """out_t = (the row's committed sum + the inputs of the blocks up to t's) @ W_out, the
    inputs being x @ W_in; the committed sum moves past the tokens `meta.commit` names."""

    cfg: object
    mesh: object = None

    @nn.compact
    def __call__(self, x, meta, cache, slot):
        cfg, (b, t, d) = self.cfg, x.shape
        blk = cfg.block_size
        w_in = param(self, "w_in", (d, WIDTH), ("embed", "mlp"), NORMAL)
        w_out = param(self, "w_out", (WIDTH, d), ("mlp", "embed"), NORMAL)
        u = (x @ w_in.astype(x.dtype)).astype(jnp.float32)  # [B, T, WIDTH]
        block_of = jnp.arange(t) // blk
        seen = (block_of[None, :] <= block_of[:, None]).astype(jnp.float32)  # [T, T] block-causal
        start = jnp.zeros((b, WIDTH), jnp.float32)
        if cache is not None:
            rows = meta.rows if meta.rows is not None else jnp.arange(b)
            start = jnp.where((meta.write_offset == 0)[:, None], 0.0, cache.read(slot)[rows])
        out = (start[:, None] + jnp.einsum("ts,bsw->btw", seen, u)) @ w_out.astype(jnp.float32)
        if cache is not None:
            committed = (meta.commit // blk) * blk  # [B] whole blocks
            take = (jnp.arange(t)[None] < committed[:, None]).astype(jnp.float32)
            new = start + jnp.einsum("bt,btw->bw", take, u)
            cache = cache.write(slot, rows, new, keep=~meta.write | (committed == 0))
        return out.astype(x.dtype), cache


def test_a_toy_layer_kind_runs_through_admission_offload_and_the_prefix_store(monkeypatch):
    monkeypatch.setitem(layer_types.LAYER_TYPES, "running_sum",
                        layer_types.LayerType(RunningSum, RunningSumCache, "running_sum"))
    base, _ = hybrid_cfg("bidirectional")
    cfg = dataclasses.replace(base, sequence_module=dataclasses.replace(
        base.sequence_module, layer_types=("linear_attention", "running_sum", "full_attention")))
    params = init_params(cfg)
    assert params["layer_1"]["running_sum"]["w_in"].shape == (cfg.hidden_size, WIDTH)
    linear = ModelCache.snapshot_shape(base)[0] // 2  # floats per linear layer
    assert ModelCache.snapshot_shape(cfg) == (linear + WIDTH,)

    rng = np.random.default_rng(3)
    shared = rng.integers(10, 500, size=45).tolist()  # 5 full blocks of 8
    other = shared[:33] + rng.integers(10, 500, size=12).tolist()
    d = DecodeConfig(buffer_size=2, max_new_tokens=16, ignore_eos=True)

    def engine(store=None):
        e = Engine(cfg, params, batch_size=2, buffer_size=2, prefill_chunk=16, prefix_store=store)
        e.warmup()
        return e

    cold = engine()
    assert sorted(cold.kv.entries) == ["full_attention", "linear_attention", "running_sum"]
    first = [r.token_ids for r in cold.generate([shared, other], d)]
    cold_logits = first_step_logits(cold, shared)

    store = PrefixStore("toy", cfg.block_size, ram_bytes=1 << 24)
    warm = engine(store)
    assert [r.token_ids for r in warm.generate([shared, other], d)] == first
    warm.offloader.flush()
    snapshot = store.get(state_key(store.keys(shared)[3]))  # a prefill round ended at 32
    # the running sums, side by side with the linear layer's state: nonzero, so a hit that
    # restored them wrong (or not at all) would move the logits compared below
    assert snapshot is not None and np.abs(snapshot[linear:]).max() > 0.1
    hits = warm.prefix_hit_tokens
    assert [r.token_ids for r in warm.generate([shared, other], d)] == first
    assert warm.prefix_hit_tokens - hits >= 64 and store.stats.hits > 0
    np.testing.assert_allclose(first_step_logits(warm, shared), cold_logits, atol=1e-5)
    warm.offloader.close()
    # nothing outside this test names the kind
    package = pathlib.Path(__file__).parent.parent / "mbd_jax"
    assert not [p for p in package.rglob("*.py") if "running_sum" in p.read_text()]


def test_the_config_accepts_exactly_the_registered_layer_types():
    """The YAML's `layer_types` (config/model.py's LayerType) and the registry of mixers and
    cache kinds (model/layer_types.py) name the same types: one can not grow without the other."""
    import typing

    from mbd_jax.config.model import LayerType

    assert set(typing.get_args(LayerType)) == set(layer_types.LAYER_TYPES)
