"""What the tools share: their argument parser and their report.

    ap = harness.parser(__doc__)          # description: the docstring's first line, usage: the rest
    ap.add_argument("--rounds", type=harness.int_at_least(1), default=3)
    ap.add_argument("--buffer-size", type=harness.int_list(1), default=[1, 2])
    ...
    harness.report(rows, {"buffer_size": "N_buf", "tokens_per_s": "tokens/s"})

A bad value exits 2 with argparse's message naming the flag, before any model loads. A report is
a JSON line per row on stdout (what a later run or a plot reads) and a Markdown table of the
named columns on stderr (what a reader looks at). Tools run from the checkout root with the
project's environment (`.venv/bin/python tools/NAME.py`): mbd_jax is installed there, and this
module sits beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from mbd_jax.arguments import int_at_least, int_list

__all__ = ["int_at_least", "int_list", "parser", "report"]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser described by a tool's docstring (its first line; the rest, usage and all, as
    the epilog of --help)."""
    first, _, rest = (doc or "").strip().partition("\n")
    return argparse.ArgumentParser(description=first, epilog=rest.strip() or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


def report(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str],
           summary: Mapping[str, Any] | None = None) -> None:
    """Each row as a JSON line on stdout, then `summary` (if any); the `columns` ({key:
    header}) of every row as a Markdown table on stderr."""
    for row in rows:
        print(json.dumps(row), flush=True)
    if summary is not None:
        print(json.dumps(summary), flush=True)
    print("| " + " | ".join(columns.values()) + " |", file=sys.stderr)
    print("|" + "---|" * len(columns), file=sys.stderr)
    for row in rows:
        print("| " + " | ".join(_cell(row.get(key, "")) for key in columns) + " |", file=sys.stderr)
