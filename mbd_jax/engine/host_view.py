"""The decode state on the host: what a decode call's readers (the offloader, the step's row
events) fetch, once per state however many ask."""

from __future__ import annotations

import jax
import numpy as np

from mbd_jax.decoding.block_buffer import DecodeState


def host_tree(state: DecodeState, logprobs: bool) -> DecodeState:
    """What a view fetches: no voting trajectories or grammar masks, log-probabilities only if
    asked."""
    return state.replace(trajectory=None, allowed=None,
                         logprob=state.logprob if logprobs else None)


class HostViews:
    def __init__(self, fetch):
        """`fetch`: a device tree of rows to the host (Runner.fetch_rows: one packed copy)."""
        self._fetch = fetch
        self._view: tuple[DecodeState, DecodeState] | None = None  # (device, host)
        self._done: tuple[DecodeState, np.ndarray] | None = None  # (device, host done)

    def view(self, state: DecodeState, logprobs: bool = False) -> DecodeState:
        """`state` on the host without the voting trajectories, and without the
        log-probabilities unless asked."""
        if self._view is None or self._view[0] is not state or (
                logprobs and self._view[1].logprob is None):
            self._view = (state, self._fetch(host_tree(state, logprobs)))
        return self._view[1]

    def done(self, state: DecodeState) -> np.ndarray:
        """state.done on the host ([B] bool): the view's copy when it has one."""
        if self._view is not None and self._view[0] is state:
            return np.asarray(self._view[1].done)
        if self._done is None or self._done[0] is not state:
            self._done = (state, np.asarray(jax.device_get(state.done)))
        return self._done[1]

    def forget(self) -> None:
        """Drops the copies (the device buffers were replaced)."""
        self._view = self._done = None
