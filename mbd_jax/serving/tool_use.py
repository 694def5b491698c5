"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for (`ToolUse`):
the functions shown to the model, the grammar a forced call decodes under, and the reply read
back into OpenAI `tool_calls` (tool_calls.py holds the syntax).

tool_choice: "none" (the tools are not shown, the reply is text), "auto" (the default with tools:
shown, the model writes text or calls, calls are read out of the reply), "required" (at least one
call: the reply decodes under the call grammar), {"type": "function", "function": {"name": N}}
(a call of N, under its grammar). parallel_tool_calls false: one call at most.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mbd_jax import tool_calls
from mbd_jax.config.structure import Structure
from mbd_jax.tool_calls import Function, ToolCall

TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
        "additionalProperties": False}}, "required": ["type", "function"],
     "additionalProperties": False},
    {"type": "null"}]}
TOOLS_SCHEMA = {"anyOf": [{"type": "array", "maxItems": tool_calls.MAX_TOOLS, "items": {
    "type": "object", "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "a JSON Schema of an object"},
            "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
        "required": ["name"], "additionalProperties": False}},
    "required": ["type", "function"], "additionalProperties": False}}, {"type": "null"}]}


def check_tools(v: Any) -> list[Function] | None:
    return None if v is None else tool_calls.check_tools(v)


def check_tool_choice(v: Any) -> str | dict | None:
    """"none", "auto", "required", or {"name": ...} of the function a call must be (a dict, so a
    function that happens to be named "auto" stays a function)."""
    if v is None or v in ("none", "auto", "required"):
        return v
    if (isinstance(v, dict) and v.get("type") == "function" and set(v) == {"type", "function"}
            and isinstance(v["function"], dict) and set(v["function"]) == {"name"}
            and isinstance(v["function"]["name"], str)):
        return {"name": v["function"]["name"]}
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": '
                     '{"name": ...}}')


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class ToolUse:
    functions: tuple[Function, ...]
    choice: str  # "none", "auto", "required" or "named" (a call of `name`)
    parallel: bool
    name: str | None = None  # the function a "named" choice calls

    @property
    def shown(self) -> list[Function] | None:
        """The functions the prompt shows (None: none)."""
        return list(self.functions) if self.choice != "none" else None

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def structure(self) -> Structure | None:
        """The call grammar a required or named choice decodes under."""
        if not self.forced:
            return None
        named = [f for f in self.functions if self.choice == "required" or f.name == self.name]
        return Structure("grammar", tool_calls.call_grammar(
            named, self.parallel and self.choice == "required"))

    def reply(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished reply; a text-only choice is all content."""
        if self.choice == "none":
            return text, []
        content, calls = tool_calls.parse(text, list(self.functions))
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> tool_calls.CallStream | None:
        return None if self.choice == "none" else tool_calls.CallStream(list(self.functions))


def read(req: Any) -> ToolUse | None:
    """The request's tool use (None: no tools offered); ToolError naming the field for a
    choice that names no offered function, or that asks for a call with no tools."""
    functions = req.tools or []
    choice = req.tool_choice
    if not functions:
        if choice not in (None, "none"):
            raise ToolError("field 'tool_choice' asks for a tool call but no 'tools' are given",
                            "tool_choice")
        return None
    name = None
    if isinstance(choice, dict):
        choice, name = "named", choice["name"]
        if name not in {f.name for f in functions}:
            raise ToolError(f"field 'tool_choice' names function '{name[:64]}', which is not "
                            "among the tools: " + ", ".join(f.name for f in functions),
                            "tool_choice")
    return ToolUse(tuple(functions), choice or "auto", req.parallel_tool_calls is not False, name)
