"""How mbd-jax reads a JSON Schema it decodes under (structured output, tool arguments).

- JSON is written as Python's json.dumps writes it: ", " and ": ", no other whitespace
  (`JSON_STYLE`, llguidance's options; a schema's own "x-guidance" options override them). With
  any whitespace allowed, a model that is unsure pads its output with spaces: valid, useless.
- An object schema that does not say `additionalProperties` takes no other properties
  (`closed_objects`), as xgrammar's strict mode (vLLM's default) reads it and as OpenAI's strict
  mode requires: an open object lets a model that is unsure invent keys until its budget ends.
  A schema that wants extra properties says so (`"additionalProperties": true` or a schema).
"""

from __future__ import annotations

import json
from typing import Any

JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
            "propertyNames", "unevaluatedProperties")


def json_lark(schema: Any) -> str:
    """A Lark grammar (llguidance's %json) of one JSON value valid under `schema` (a dict, or
    true / false), read as this module says."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    schema = closed_objects(schema)
    schema["x-guidance"] = {**JSON_STYLE, **schema.get("x-guidance", {})}
    return f"start: %json {json.dumps(schema)}\n"


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema (one with `properties`) that does not
    say `additionalProperties` has `"additionalProperties": false`."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMAS:
        if key in out:
            out[key] = ([closed_objects(s) for s in out[key]] if isinstance(out[key], list)
                        else closed_objects(out[key]))
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
