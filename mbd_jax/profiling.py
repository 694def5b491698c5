"""JAX profiler sessions (traces readable by TensorBoard / XProf)."""

from __future__ import annotations

import contextlib
import pathlib
import sys
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
    print(f"[mbd-jax] profile trace written under {pathlib.Path(log_dir).resolve()} (open it with "
          f"`pip install xprof; xprof --logdir {log_dir}`, or TensorBoard)", file=sys.stderr,
          flush=True)
