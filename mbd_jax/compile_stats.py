"""Counts XLA backend compilations (for the no-recompile tests, the bench and the metrics), and
the programs read back from the persistent compilation cache (mbd_jax/compile_cache.py) instead;
a program read back counts as a compilation too (JAX reports its retrieval time as one)."""

from __future__ import annotations

import threading

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_cache_hits = 0
_installed = False


def _listener(name: str, duration: float, **_: object) -> None:
    global _count, _seconds
    if name == _EVENT:
        with _lock:
            _count += 1
            _seconds += duration


def _event_listener(name: str, **_: object) -> None:
    global _cache_hits
    if name == _CACHE_HIT:
        with _lock:
            _cache_hits += 1


def install() -> None:
    """Registers the listener once per process (jax.monitoring has no unregister)."""
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            monitoring.register_event_listener(_event_listener)
            _installed = True


def compiles() -> int:
    install()
    return _count


def compile_seconds() -> float:
    install()
    return _seconds


def cache_hits() -> int:
    install()
    return _cache_hits
