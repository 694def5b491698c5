"""Request bodies: bytes -> a JSON object every later check can trust, or a 400 naming the problem.

Python's json module accepts things no client means and that break code further on: NaN and
Infinity, integers of thousands of digits (ValueError past 4,300), nesting deep enough to raise
RecursionError, and lone UTF-16 surrogates in strings (which no tokenizer can encode). All of
them become a client error here, before any field is read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mbd_jax.config.structure import MAX_SCHEMA_DEPTH

# the deepest real request: a JSON Schema (MAX_SCHEMA_DEPTH levels of its own) under
# response_format.json_schema.schema or tools[i].function.parameters
MAX_DEPTH = MAX_SCHEMA_DEPTH + 8
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(ValueError):
    """The body is not an acceptable JSON object; `param` names where, when known."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _no_constant(name: str) -> Any:
    raise BodyError(f"invalid JSON body: {name} is not a number JSON allows")


def parse_object(body: bytes) -> dict:
    """The body as a JSON object with finite numbers, valid Unicode and at most MAX_DEPTH levels."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(f"invalid JSON body: nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers past 4,300 digits
        raise BodyError(f"invalid JSON body: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise BodyError("the JSON body must be an object")
    _check_tree(data)
    return data


def _check_tree(data: dict) -> None:
    """Depth and Unicode of every key and string (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise BodyError(f"field '{path}' holds a lone UTF-16 surrogate (not valid Unicode)",
                                param=path or None)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise BodyError(f"invalid JSON body: nested more than {MAX_DEPTH} levels deep",
                            param=path or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                if _SURROGATE.search(key):
                    raise BodyError(f"a key under '{path or '(body)'}' holds a lone UTF-16 "
                                    "surrogate (not valid Unicode)", param=path or None)
                child = f"{path}.{key}" if path else key
            else:
                child = f"{path}[{key}]"
            stack.append((item, child, depth + 1))
