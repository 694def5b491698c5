"""The persistent XLA compilation cache: compiled programs kept on disk, so a restarted service
(or a second `generate`) reads its programs back instead of compiling them again.

One setting, `server.compile_cache` / `--compile-cache`: a directory, `off` for none, or unset
for $JAX_COMPILATION_CACHE_DIR, else DEFAULT_DIR. Entries are keyed by the program, the backend and
the compiler flags (JAX's own key), so a changed model, mesh or jax version compiles afresh.
"""

from __future__ import annotations

import logging
import os
import pathlib

import jax

from mbd_jax.errors import UserError

log = logging.getLogger(__name__)
DEFAULT_DIR = "~/.cache/mbd-jax/xla"
OFF = "off"


def resolve(setting: str | None) -> str:
    """The directory a setting stands for ("" = no cache)."""
    if setting is None:
        return os.environ.get("JAX_COMPILATION_CACHE_DIR") or DEFAULT_DIR
    return "" if setting == OFF else setting


def enable(setting: str | None, where: str = "--compile-cache") -> pathlib.Path | None:
    """Turns the cache on for this process; call it before the first compilation (JAX decides
    once per process, at its first compile, whether the cache is used)."""
    directory = resolve(setting)
    if not directory:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = pathlib.Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if setting is None:  # the default place is not writable (no home, a read-only root)
            log.warning("compilation cache off: cannot create %s (%s)", path, e.strerror)
            return None
        raise UserError(f"{where} {directory}: cannot create the directory ({e.strerror}); give a "
                        f"writable directory, or {OFF} for no cache") from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Every program: the engine's are many and small (each well under JAX's 1 s default).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
