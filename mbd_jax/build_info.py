"""Which code is running: the package version, and the commit when it runs from a git checkout,
so a mixed fleet (a canary beside the stable version) can be told apart in its metrics."""

from __future__ import annotations

import functools
import subprocess

from mbd_jax import __version__
from mbd_jax.config.paths import IN_CHECKOUT, REPO_ROOT


@functools.cache
def code_version() -> str:
    """`0.1.0`, or `0.1.0+g1a2b3c4d5e6f` from a checkout (`.dirty` after it with uncommitted changes)."""
    if not IN_CHECKOUT:
        return __version__
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+g{commit}" + (".dirty" if dirty else "")
