"""Tool calls: the functions a chat request offers, how a prompt shows them, how a reply writes a
call, the grammar that makes a reply a call, and reading calls back out of a reply.

A call is written the Hermes way, which Qwen-family templates (and mbd-jax's built-in ones) use:

    <tool_call>{"name": "sort_numbers", "arguments": {"numbers": [7, 2, 9]}}</tool_call>

one per call (JSON with ", " and ": ", as grammar/compile.py writes it), several in a row for
parallel calls; a Jinja template's own newlines around the JSON are accepted. A tool's result
comes back as a `tool` message, shown to the model as `<tool_response>...</tool_response>` in a
user turn by the built-in templates (a Jinja template renders `tool` messages itself).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from mbd_jax.grammar.json_schema import JSON_STYLE, closed_objects

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
MAX_TOOLS = 64
MAX_PARALLEL_CALLS = 8  # calls in one reply under a forced choice's grammar
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    parameters: dict  # a JSON Schema of the arguments object
    description: str = ""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def check_tools(tools: Any) -> list[Function]:
    """OpenAI's `tools` as Functions; ValueError saying what is wrong (and where) otherwise."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ValueError(f"must be a list of at most {MAX_TOOLS} tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {
                "type", "function"}:
            raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}')
        f = tool["function"]
        if not isinstance(f, dict) or set(f) - {"name", "description", "parameters", "strict"}:
            raise ValueError(f"{where}.function must be an object with name and optionally "
                             "description, parameters, strict")
        if not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must be a JSON Schema of an object")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        functions.append(Function(f["name"], params, description))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("function names must be distinct")
    return functions


def render_tools(functions: list[Function]) -> str:
    """The system text a built-in template shows the tools in: one line, each function by
    name and argument names (`Tools: sort_numbers(numbers); add(a, b)`)."""
    return "Tools: " + "; ".join(
        f"{f.name}({', '.join(f.parameters.get('properties', {}))})" for f in functions)


def render_call(name: str, arguments: str | dict) -> str:
    """One call as a reply writes it; `arguments` as JSON text or data."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': args})}{CALL_CLOSE}"


def render_result(content: str) -> str:
    return f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"


def call_grammar(functions: list[Function], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, %json) whose words are one call of one of
    `functions` (with `parallel`, up to MAX_PARALLEL_CALLS in a row); their argument schemas
    read as grammar/json_schema.py says."""
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name},
                                                          "arguments": closed_objects(f.parameters)},
                         "required": ["name", "arguments"], "additionalProperties": False}
                        for f in functions], "x-guidance": JSON_STYLE}
    calls = f"call (NL? call)~0..{MAX_PARALLEL_CALLS - 1}" if parallel else "call"
    return (f"start: {calls}\n"
            f"call: \"{CALL_OPEN}\" NL? %json {json.dumps(schema)} NL? \"{CALL_CLOSE}\"\n"
            "NL: \"\\n\"\n")


_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


def parse(text: str, functions: list[Function]) -> tuple[str | None, list[ToolCall]]:
    """(the reply's text outside its calls, or None if nothing is left; its calls). A call
    that is not JSON of {"name": one of `functions`, "arguments": an object} stays text."""
    calls, kept, last = [], [], 0
    names = {f.name for f in functions}
    for m in _CALL.finditer(text):
        call = _read_call(m.group(1), names)
        if call is not None:
            kept.append(text[last: m.start()])
            last = m.end()
            calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def _read_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if (not isinstance(value, dict) or value.get("name") not in names
            or not isinstance(value.get("arguments", {}), dict)):
        return None
    return ToolCall(value["name"], json.dumps(value.get("arguments", {})))


class CallStream:
    """`parse` over streamed text: each `push` returns (text to show, calls completed). Text
    that may be the start of a call is held back until it is one (or is not)."""

    def __init__(self, functions: list[Function]):
        self._names = {f.name for f in functions}
        self._pending = ""

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        shown, calls = "", []
        while True:
            start = self._pending.find(CALL_OPEN)
            if start < 0:
                keep = next((k for k in range(len(CALL_OPEN) - 1, 0, -1)
                             if self._pending.endswith(CALL_OPEN[:k])), 0)
                cut = len(self._pending) - keep
                shown, self._pending = shown + self._pending[:cut], self._pending[cut:]
                return shown, calls
            shown, self._pending = shown + self._pending[:start], self._pending[start:]
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                return shown, calls  # the call is still arriving
            whole = self._pending[: end + len(CALL_CLOSE)]
            call = _read_call(whole[len(CALL_OPEN): end].strip(), self._names)
            if call is None:
                shown += whole
            else:
                calls.append(call)
            self._pending = self._pending[len(whole):]

    def finish(self) -> str:
        """What is still held back (an unfinished call is text)."""
        out, self._pending = self._pending, ""
        return out
