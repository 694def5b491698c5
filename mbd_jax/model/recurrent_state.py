"""The linear-attention layers' cache kind: each cache row's recurrent state after its committed
positions (model/cache.py names the protocol; this is a snapshot kind).

Per linear layer (model/gated_deltanet.py): `state` [B, Hv, Dk, Dv] float32 (a sum over the
whole context) and the convolution's input `tail` [B, W - 1, C] (the q, k, v channels side by
side), in the two forms the layer loop reads: tuples of Ll per-layer arrays unrolled, single
[Ll, B, ...] arrays scanned. A row whose committed length is 0 reads zeros (the layer checks
`meta.write_offset`), so a reused row never sees its last request's state.

The prefix store keeps a row's states at a block boundary as one float32 snapshot per row: every
layer's state and tail flattened side by side (the tail cast up and back exactly).
"""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mbd_jax.config import ModelConfig

_STATE_AXES = ("layers", None, "heads", "head_dim", None)  # a stacked state: rows on every shard
_TAIL_AXES = ("layers", None, None, None)  # a stacked conv tail


def _shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(state, tail) of one row of one layer: [Hv, Dk, Dv] and [W - 1, C]."""
    sm = cfg.sequence_module
    channels = 2 * sm.num_key_heads * sm.key_head_dim + sm.num_value_heads * sm.value_head_dim
    return ((sm.num_value_heads, sm.key_head_dim, sm.value_head_dim),
            (sm.conv_kernel - 1, channels))


@flax.struct.dataclass
class RecurrentState:
    state: jax.Array | tuple[jax.Array, ...]  # [Ll, B, Hv, Dk, Dv] or Ll x [B, Hv, Dk, Dv]
    tail: jax.Array | tuple[jax.Array, ...]  # [Ll, B, W - 1, C] or Ll x [B, W - 1, C]

    positional: ClassVar[bool] = False  # one snapshot per row (model/cache.py)

    # ------------------------------------------------------------ outside the model
    @classmethod
    def allocate(cls, cfg: ModelConfig, layers: int, batch: int, capacity: int, pages: int,
                 dtype, stacked: bool) -> RecurrentState:
        """Zero states (float32) and tails (`dtype`) of `layers` linear layers for `batch` rows."""
        del capacity, pages  # one state per row, whatever its length
        state, tail = _shapes(cfg)
        if stacked:
            return cls(state=jnp.zeros((layers, batch, *state), jnp.float32),
                       tail=jnp.zeros((layers, batch, *tail), dtype))
        return cls(state=tuple(jnp.zeros((batch, *state), jnp.float32) for _ in range(layers)),
                   tail=tuple(jnp.zeros((batch, *tail), dtype) for _ in range(layers)))

    @classmethod
    def logical_axes(cls, cfg: ModelConfig, layers: int, stacked: bool) -> RecurrentState:
        if stacked:
            return cls(state=_STATE_AXES, tail=_TAIL_AXES)
        return cls(state=(_STATE_AXES[1:],) * layers, tail=(_TAIL_AXES[1:],) * layers)

    @staticmethod
    def snapshot_size(cfg: ModelConfig, layers: int) -> int:
        """Floats in one row's snapshot: every layer's state and tail."""
        state, tail = _shapes(cfg)
        return layers * (int(np.prod(state)) + int(np.prod(tail)))

    def _layers(self) -> list[tuple[jax.Array, jax.Array]]:
        """(state [B, Hv, Dk, Dv], tail [B, W - 1, C]) of every linear layer, in slot order."""
        if isinstance(self.state, tuple):
            return list(zip(self.state, self.tail))
        return [(self.state[i], self.tail[i]) for i in range(self.state.shape[0])]

    def snapshot(self, rows: jax.Array) -> jax.Array:
        """Rows `rows`' ([n]) snapshots: [n, snapshot_size] float32."""
        n = len(rows)
        return jnp.concatenate([part for s, t in self._layers() for part in
                                (s[rows].reshape(n, -1), t[rows].reshape(n, -1).astype(jnp.float32))],
                               axis=1)

    def restore(self, entry: jax.Array, row: jax.Array) -> RecurrentState:
        """Row `row` takes the snapshot `entry` ([snapshot_size]) as its states."""
        if not isinstance(self.state, tuple):  # stacked: one scatter per array, in place
            per_layer = entry.reshape(self.state.shape[0], -1)  # [Ll, state + tail]
            n = int(np.prod(self.state.shape[2:]))
            return self.replace(
                state=self.state.at[:, row].set(
                    per_layer[:, :n].reshape(-1, *self.state.shape[2:]).astype(self.state.dtype)),
                tail=self.tail.at[:, row].set(
                    per_layer[:, n:].reshape(-1, *self.tail.shape[2:]).astype(self.tail.dtype)))
        states, tails, at = [], [], 0
        for s, t in self._layers():
            ns, nt = int(np.prod(s.shape[1:])), int(np.prod(t.shape[1:]))
            states.append(s.at[row].set(entry[at: at + ns].reshape(s.shape[1:]).astype(s.dtype)))
            tails.append(t.at[row].set(entry[at + ns: at + ns + nt].reshape(t.shape[1:])
                                       .astype(t.dtype)))
            at += ns + nt
        return self.replace(state=tuple(states), tail=tuple(tails))

    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))

    # ------------------------------------------------------------ inside the model
    def read(self, slot) -> tuple[jax.Array, jax.Array]:
        """The `slot`-th linear layer's (state [B, Hv, Dk, Dv], conv tail [B, W - 1, C]) of every
        cache row (`slot`: an int, or traced when stacked)."""
        if not isinstance(self.state, tuple):
            take = lambda buf: jax.lax.dynamic_index_in_dim(buf, slot, keepdims=False)  # noqa: E731
            return take(self.state), take(self.tail)
        return self.state[slot], self.tail[slot]

    def write(self, slot, rows: jax.Array, state: jax.Array, tail: jax.Array,
              keep: jax.Array) -> RecurrentState:
        """Cache rows `rows` ([R]) of linear layer `slot` take state [R, Hv, Dk, Dv] and tail
        [R, W - 1, C] where `keep` ([R] bool) is False; where True they keep theirs."""
        batch = self.state[0].shape[0]  # stacked [Ll, B, ...] or Ll x [B, ...]
        index = jnp.where(keep, batch, rows)  # out of range: dropped
        if not isinstance(self.state, tuple):
            return self.replace(
                state=self.state.at[slot, index].set(state.astype(self.state.dtype), mode="drop"),
                tail=self.tail.at[slot, index].set(tail.astype(self.tail.dtype), mode="drop"))
        st, tl = list(self.state), list(self.tail)
        st[slot] = st[slot].at[index].set(state.astype(st[slot].dtype), mode="drop")
        tl[slot] = tl[slot].at[index].set(tail.astype(tl[slot].dtype), mode="drop")
        return self.replace(state=tuple(st), tail=tuple(tl))
