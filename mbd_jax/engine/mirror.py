"""The engine across processes: process 0's state-changing engine calls made on every process.

In a multi-process service (parallel/multihost.py) process 0's scheduler decides when to admit,
prefill, decode and cancel from timing and client traffic, so `EngineLeader` sends each call in
MIRRORED to the followers (`follow`) before making it itself; each follower makes the same call
on its own engine, in the same order, with its own copy of the decode state and admission
(the leader sends a placeholder for those). Reads (READS) are the leader's alone. Any other
attribute is refused on the leader: a call that changes the engine must be listed here to run
on every process, never silently on process 0 alone.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from typing import Any

from mbd_jax.decoding.block_buffer import DecodeState
from mbd_jax.engine.admission import Admission
from mbd_jax.engine.rows import EngineRequest
from mbd_jax.errors import UserError
from mbd_jax.parallel import multihost

log = logging.getLogger(__name__)

# Engine calls every process makes: name -> what the result is on a follower (its decode state,
# its admission, or nothing kept). The service's scheduler makes only the first four; the rest
# are the step's parts, for drivers that run them one by one.
MIRRORED: dict[str, str | None] = {
    "warmup": None, "step": None, "end": None, "went_idle": None,
    "empty_state": "state", "begin_admit": "admission", "prefill_step": None,
    "finish_admit": "state", "decode_call": "state", "cancel": "state", "release": None,
    "reset_buffers": None,
}
# What the leader reads from its own engine alone (host-side checks, lookups and statistics)
READS = frozenset({
    "cfg", "tokenizer", "batch_size", "buffer_size", "mesh", "prefix_cache", "check_prompt",
    "check_decode", "check_fits", "prefetch", "stats", "prefill_chunk", "prefill_ready",
    "can_vote", "kv_usage",
})


class _Local(enum.Enum):
    """An argument each process holds its own copy of: the follower substitutes it."""

    STATE = "state"
    ADMISSION = "admission"


def _portable(arg: Any) -> Any:
    """What the followers receive for one argument of a mirrored call."""
    if isinstance(arg, DecodeState):
        return _Local.STATE
    if isinstance(arg, Admission):
        return _Local.ADMISSION
    if isinstance(arg, EngineRequest):  # the driver's handle and device arrays stay here
        return dataclasses.replace(arg, tag=None, prefix=None)
    if isinstance(arg, (list, tuple)):
        return [_portable(a) for a in arg]
    if isinstance(arg, dict):
        return {k: _portable(v) for k, v in arg.items()}
    if callable(arg):  # a progress callback: the followers run silently
        return None
    return arg


class EngineLeader:
    """Process 0's engine in a multi-process service (see the module docstring). An idle leader
    sends a heartbeat every multihost.heartbeat_seconds() so the followers' wait in a collective
    never times out."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.heartbeat_s = multihost.heartbeat_seconds()
        self._lock = threading.Lock()  # one call (send + make) at a time, in one order
        self._last = time.monotonic()
        self._closed = False
        threading.Thread(target=self._heartbeat, name="mbd-heartbeat", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        if name in MIRRORED:
            method = getattr(self.engine, name)

            def mirrored(*args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    multihost.share((name, [_portable(a) for a in args],
                                     {k: _portable(v) for k, v in kwargs.items()}))
                    self._last = time.monotonic()
                    return method(*args, **kwargs)

            return mirrored
        if name in READS:
            return getattr(self.engine, name)
        raise AttributeError(f"Engine.{name} is not mirrored across processes: list it in "
                             "engine/mirror.py (MIRRORED if it changes the engine, READS if not)")

    def _heartbeat(self) -> None:
        while not self._closed:
            time.sleep(1.0)
            with self._lock:
                if not self._closed and time.monotonic() - self._last > self.heartbeat_s:
                    multihost.share(("noop",))
                    self._last = time.monotonic()

    def close(self, compile_wait_s: float = 30.0) -> bool:
        """Tells the followers to exit, then closes this process's engine (Engine.close)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                multihost.share(("stop",))
        return self.engine.close(compile_wait_s)


def follow(engine) -> None:
    """A follower process of the service: makes the leader's engine calls until it stops."""
    local: dict[_Local, Any] = {_Local.STATE: None, _Local.ADMISSION: None}
    mine = lambda a: local[a] if isinstance(a, _Local) else a  # noqa: E731
    while True:
        name, *call = multihost.share(None)
        if name == "stop":
            engine.close()
            return
        if name not in MIRRORED:  # a heartbeat
            continue
        args, kwargs = call
        try:
            result = getattr(engine, name)(*map(mine, args),
                                           **{k: mine(v) for k, v in kwargs.items()})
            if MIRRORED[name] is not None:
                local[_Local(MIRRORED[name])] = result
        except UserError as e:  # the leader hit the same error and answered its client
            log.info("follower: %s: %s", name, e)
        except Exception:  # the leader failed the same step and recovers; so does this process
            log.exception("follower: %s failed", name)
