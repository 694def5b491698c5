"""Counts XLA backend compilations (for the no-recompile tests, the bench and the metrics)."""

from __future__ import annotations

import threading

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_installed = False


def _listener(name: str, duration: float, **_: object) -> None:
    global _count, _seconds
    if name == _EVENT:
        with _lock:
            _count += 1
            _seconds += duration


def install() -> None:
    """Registers the listener once per process (jax.monitoring has no unregister)."""
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def compiles() -> int:
    install()
    return _count


def compile_seconds() -> float:
    install()
    return _seconds
