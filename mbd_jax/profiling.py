"""JAX profiler sessions (traces readable by TensorBoard / XProf)."""

from __future__ import annotations

import contextlib
import pathlib
from typing import Iterator

import jax


@contextlib.contextmanager
def maybe_trace(log_dir: str | None) -> Iterator[None]:
    """Captures a profiler trace of the block into log_dir; does nothing for None."""
    if not log_dir:
        yield
        return
    pathlib.Path(log_dir).mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(log_dir)):
        yield
