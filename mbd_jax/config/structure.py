"""What a constrained request's output must be (`Structure`), and the bounds on what a client
may ask for. The grammar itself is compiled by grammar/compile.py against the model's tokenizer.

Kinds (one per request):
- json_schema: `source` is a JSON Schema (as JSON text); the output is one JSON value it accepts;
- json_object: any JSON object (`source` empty);
- regex: `source` is a regular expression the whole output matches;
- grammar: `source` is a Lark grammar (llguidance's dialect) or a GBNF grammar;
- choice: `source` is a JSON list of strings; the output is one of them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from mbd_jax.config.fields import _check
from mbd_jax.errors import ConfigError

StructureKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
MAX_SOURCE_CHARS = 32_768  # a schema, pattern or grammar (compiling is linear in it, give or take)
MAX_SCHEMA_DEPTH = 24  # nesting of objects and arrays in a JSON Schema (or a choice list)
MAX_CHOICES = 256


@dataclasses.dataclass(frozen=True)
class Structure:
    kind: StructureKind
    source: str = ""

    def validate(self, where: str = "structure") -> None:
        self.check_source(f"{where}.source")

    def check_source(self, where: str) -> None:
        """ConfigError naming `where` (the source's field) if the source is too long, empty or
        not what its kind needs; whether it compiles is grammar/compile.py's check."""
        _check(len(self.source) <= MAX_SOURCE_CHARS, where,
               f"{len(self.source)} characters; the limit is {MAX_SOURCE_CHARS}")
        if self.kind == "json_object":
            _check(self.source == "", where, "must be empty for kind 'json_object'")
            return
        _check(bool(self.source), where, f"required (not empty) for kind '{self.kind}'")
        if self.kind not in ("json_schema", "choice"):
            return
        try:
            value = json.loads(self.source)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"{where}: not valid JSON ({str(e).splitlines()[0][:120]})") from None
        _check(depth(value) <= MAX_SCHEMA_DEPTH, where,
               f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if self.kind == "json_schema":
            _check(isinstance(value, (dict, bool)), where,
                   "must be a JSON Schema: an object (or true / false)")
        else:
            _check(isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                   and all(isinstance(c, str) and c for c in value), where,
                   f"must be a list of 1 to {MAX_CHOICES} non-empty strings")

    @classmethod
    def json_schema(cls, schema: Any) -> "Structure":
        """A json_schema structure from a schema given as Python data (or JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def depth(value: Any) -> int:
    """Nesting depth of JSON data (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > MAX_SCHEMA_DEPTH:
            break
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((c, d + 1) for c in children)
    return deepest
