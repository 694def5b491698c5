"""The request fields that ask for structured output, read into one `Structure`.

Three conventions, so clients written for any of them work:
- OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}, "strict": ...}} ({"type": "text"}: none);
- vLLM's `structured_outputs`: one of {"json": schema, "regex": ..., "choice": [...],
  "grammar": ..., "json_object": true};
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
A request sets at most one of them. Each field's type checks its shape (a 400 naming the field);
what its grammar says is checked when it compiles (app.py, grammar/compile.py).
"""

from __future__ import annotations

import json
from typing import Any

from mbd_jax.config.structure import MAX_CHOICES, Structure

_SCHEMA = {"type": "object", "description": "a JSON Schema"}
RESPONSE_FORMAT_SCHEMA = {"anyOf": [
    {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}},
     "required": ["type"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "schema": _SCHEMA,
                                         "strict": {"anyOf": [{"type": "boolean"},
                                                              {"type": "null"}]},
                                         "description": {"type": "string"}},
        "required": ["name"], "additionalProperties": False}},
     "required": ["type", "json_schema"], "additionalProperties": False},
    {"type": "null"}]}
_TEXT = {"type": "string", "minLength": 1}
CHOICES_SCHEMA = {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_CHOICES}
STRUCTURED_OUTPUTS_SCHEMA = {"anyOf": [{"type": "object", "properties": {
    "json": {"anyOf": [_SCHEMA, _TEXT]}, "regex": _TEXT, "choice": CHOICES_SCHEMA,
    "grammar": _TEXT, "json_object": {"const": True}}, "minProperties": 1, "maxProperties": 1,
    "additionalProperties": False}, {"type": "null"}]}
GUIDED_JSON_SCHEMA = {"anyOf": [_SCHEMA, _TEXT, {"type": "null"}]}
GUIDED_CHOICE_SCHEMA = {"anyOf": [CHOICES_SCHEMA, {"type": "null"}]}
GUIDED_TEXT_SCHEMA = {"anyOf": [_TEXT, {"type": "null"}]}


def _schema_text(v: Any, what: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (dict, bool)):
        return json.dumps(v)
    raise ValueError(f"{what} must be a JSON Schema (an object, or a string holding one)")


def check_response_format(v: Any) -> Structure | None:
    """OpenAI's response_format as a Structure (None: plain text)."""
    shape = ('must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
             '"json_schema": {"name": ..., "schema": {...}}}')
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError(shape)
    if v["type"] != "json_schema":
        if set(v) != {"type"}:
            raise ValueError(shape)
        return None if v["type"] == "text" else Structure("json_object")
    spec = v.get("json_schema")
    if set(v) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise ValueError(shape)
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise ValueError(f"json_schema has unknown field '{sorted(extra)[0]}'; allowed: name, "
                         "schema, strict, description")
    if not isinstance(spec.get("name"), str):
        raise ValueError("json_schema.name must be a string")
    # no schema: any JSON value (OpenAI allows leaving it out)
    return Structure("json_schema", _schema_text(spec.get("schema", {}), "json_schema.schema"))


def check_structured_outputs(v: Any) -> Structure | None:
    """vLLM's structured_outputs (exactly one constraint) as a Structure."""
    kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) != 1 or next(iter(v)) not in kinds:
        raise ValueError("must be an object with exactly one of " + ", ".join(kinds))
    key, value = next(iter(v.items()))
    if key == "json":
        return Structure("json_schema", _schema_text(value, "json"))
    if key == "json_object":
        if value is not True:
            raise ValueError("json_object must be true")
        return Structure("json_object")
    if key == "choice":
        return _choice(value, "choice")
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    return Structure(kinds[key], value)


def _choice(v: Any, what: str) -> Structure:
    if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
        raise ValueError(f"{what} must be a list of strings")
    return Structure("choice", json.dumps(v))


def check_guided_json(v: Any) -> Structure | None:
    return None if v is None else Structure("json_schema", _schema_text(v, "guided_json"))


def check_guided_choice(v: Any) -> Structure | None:
    return None if v is None else _choice(v, "guided_choice")


def check_guided_text(kind: str):
    def check(v: Any) -> Structure | None:
        if v is None:
            return None
        if not isinstance(v, str):
            raise ValueError("must be a string")
        return Structure(kind, v)
    return check


# request field -> where its structure's source sits (the param a grammar error names)
FIELDS = {"response_format": "response_format.json_schema.schema",
          "structured_outputs": "structured_outputs", "guided_json": "guided_json",
          "guided_regex": "guided_regex", "guided_choice": "guided_choice",
          "guided_grammar": "guided_grammar"}


class Conflict(ValueError):
    """Two fields ask for structured output; `param` names the second."""

    def __init__(self, first: str, second: str):
        super().__init__(f"fields '{first}' and '{second}' both constrain the output; send one")
        self.param = second


def requested(req: Any) -> tuple[Structure, str] | None:
    """(the structure a request asks for, the field holding its source), or None. Conflict
    when two fields ask."""
    asked = [(getattr(req, f), f) for f in FIELDS if getattr(req, f, None) is not None]
    if len(asked) > 1:
        raise Conflict(asked[0][1], asked[1][1])
    if not asked:
        return None
    structure, field = asked[0]
    if field == "structured_outputs":
        key = {"json_schema": "json", "json_object": "json_object"}.get(structure.kind,
                                                                          structure.kind)
        return structure, f"structured_outputs.{key}"
    if field == "response_format" and structure.kind == "json_object":
        return structure, "response_format"
    return structure, FIELDS[field]
