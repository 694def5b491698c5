"""Checked argparse types shared by the command line and the tools (imports nothing heavy: a tool
may parse its flags before it sets up JAX). A bad value is argparse's usage error: exit 2 with a
message naming the flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def int_list(low: int) -> Callable[[str], list[int]]:
    """Comma-separated integers, each >= low ("1,2,4")."""
    one = int_at_least(low)

    def parse(text: str) -> list[int]:
        return [one(part) for part in text.split(",")]
    return parse
