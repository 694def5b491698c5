"""Regular expressions written by users (the voting `regex` extractor), run by RE2.

RE2 matches in time linear in the text and never backtracks, so no pattern can stall the thread
that runs it; patterns are also bounded in length and in the memory RE2 may compile them into.
What RE2 cannot run in linear time (backreferences, lookaround) is refused at validation, with
RE2's own reason.
"""

from __future__ import annotations

import functools

import re2

MAX_PATTERN_CHARS = 512
MAX_PROGRAM_BYTES = 1 << 20  # RE2's memory budget for one compiled pattern


def _options() -> re2.Options:
    opts = re2.Options()
    opts.log_errors = False  # the caller reports the error; RE2 would also print it to stderr
    opts.max_mem = MAX_PROGRAM_BYTES
    return opts


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str):
    """The compiled pattern; ValueError naming what is wrong (length, syntax, size)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"the pattern has {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    try:
        return re2.compile(pattern, _options())
    except Exception as e:  # re2.error; its message is bytes
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) \
            else str(e)
        raise ValueError(f"not a regex RE2 can run in linear time: {reason}") from None


def last_answer(pattern: str, text: str) -> str | None:
    """Group 1 (or the whole match) of the last match of `pattern` in `text`, stripped."""
    match = None
    for match in compile_pattern(pattern).finditer(text):
        pass
    if match is None:
        return None
    value = match.group(1) if compile_pattern(pattern).groups else match.group(0)
    return None if value is None else value.strip()
