"""Chat prompt rendering: the model directory's own Jinja template when it has one (as vLLM and
SGLang do), else a built-in template per model family; a thinking on/off switch either way.

- Jinja: `chat_template.jinja`, or `chat_template` in `tokenizer_config.json`, rendered in a
  sandbox with messages, add_generation_prompt=True, enable_thinking, the tokenizer's special
  tokens (bos_token, eos_token, ...) and the request's chat_template_kwargs.

- `plain` (the tiny presets): `<|role|> content` lines, then `<|assistant|>`; thinking on opens
  `<think>`.

Tools (tool_calls.py): a built-in template shows the offered functions as a system line before
the conversation, an assistant turn's calls as `<tool_call>` text and a `tool` message as a user
turn holding `<tool_response>`; a Jinja template gets `tools` and the messages as they are (calls'
arguments as objects, the Hugging Face convention).
- `qwen` (SDAR / Qwen3): `<|im_start|>role\ncontent<|im_end|>\n` ... `<|im_start|>assistant\n`;
  thinking off closes an empty think section (`<think>\n\n</think>\n\n`), the Qwen3 convention.
- `llada2` (LLaDA2 / Ling): `<role>SYSTEM</role>...<|role_end|><role>HUMAN</role>...<|role_end|>`
  `<role>ASSISTANT</role>`; thinking is switched by the system prompt's first line,
  `detailed thinking on` / `detailed thinking off`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from mbd_jax import tool_calls
from mbd_jax.errors import UserError
from mbd_jax.tool_calls import Function

# developer: OpenAI's newer name for system; tool: a tool's result
ROLES = ("system", "developer", "user", "assistant", "tool")
THINK_END = "</think>"  # every template closes its thinking section with this


def render(messages: list[dict], thinking: bool = False, template: str = "plain",
           tools: list[Function] | None = None) -> str:
    """messages: [{"role": ..., "content": str}, ...] -> the prompt text, ending where the
    assistant's reply begins (`tools`: the functions the reply may call)."""
    _check(messages)
    messages = _plain_turns(messages, tools)
    if template == "qwen":
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    if template == "llada2":
        system = [m["content"] for m in messages if m["role"] == "system"]
        switch = "detailed thinking " + ("on" if thinking else "off")
        text = f"<role>SYSTEM</role>{chr(10).join([switch, *system])}<|role_end|>"
        names = {"user": "HUMAN", "assistant": "ASSISTANT"}
        text += "".join(f"<role>{names[m['role']]}</role>{m['content']}<|role_end|>"
                        for m in messages if m["role"] != "system")
        return text + "<role>ASSISTANT</role>"
    parts = [f"<|{m['role']}|> {m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>" + (" <think>" if thinking else "")


@dataclasses.dataclass(frozen=True)
class Template:
    """How a model's chat prompts are rendered: `jinja` (the model directory's template) when
    set, else the built-in template `builtin`."""

    builtin: str = "plain"
    jinja: str | None = None
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)

    def render(self, messages: list[dict], thinking: bool = False,
               tools: list[Function] | None = None, **kwargs: Any) -> str:
        """The prompt text; `kwargs` (chat_template_kwargs) reach a Jinja template only."""
        if self.jinja is None:
            return render(messages, thinking, self.builtin, tools)
        _check(messages)
        messages = [_hf_turn({**m, "role": "system"} if m["role"] == "developer" else m)
                    for m in messages]
        if tools:
            kwargs["tools"] = [{"type": "function", "function": {
                "name": f.name, "description": f.description, "parameters": f.parameters}}
                for f in tools]
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise UserError(f"messages: the model's chat template refused them: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                                 indent=indent)
        try:
            return env.from_string(self.jinja).render(
                **{**self.special_tokens, **kwargs}, messages=messages,
                add_generation_prompt=True, enable_thinking=thinking)
        except UserError:
            raise
        except jinja2.TemplateError as e:
            raise UserError(f"messages: the model's chat template failed: {e}") from None


def for_model(model_dir: pathlib.Path, builtin: str) -> Template:
    """The chat template of a model directory: its Jinja template if it ships one."""
    jinja, special = None, {}
    config_file = model_dir / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        jinja = config.get("chat_template")
        if isinstance(jinja, list):  # [{"name": "default", "template": ...}, ...]
            jinja = next((t["template"] for t in jinja if t.get("name") == "default"), None)
    if (model_dir / "chat_template.jinja").is_file():
        jinja = (model_dir / "chat_template.jinja").read_text()
    return Template(builtin=builtin, jinja=jinja if isinstance(jinja, str) else None,
                    special_tokens=special)


def _plain_turns(messages: list[dict], tools: list[Function] | None) -> list[dict]:
    """Messages for a built-in template: system / user / assistant turns with string content
    (developer as system, calls and tool results as text, the tools as a first system turn)."""
    out = [{"role": "system", "content": tool_calls.render_tools(tools)}] if tools else []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "developer":
            role = "system"
        elif role == "tool":
            role, content = "user", tool_calls.render_result(content)
        elif m.get("tool_calls"):
            content += "".join(tool_calls.render_call(c["function"]["name"],
                                                      c["function"]["arguments"])
                               for c in m["tool_calls"])
        out.append({"role": role, "content": content})
    return out


def _hf_turn(m: dict) -> dict:
    """A message as Hugging Face templates read it: a call's arguments as an object."""
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _check(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise UserError("messages: must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"messages[{i}]: must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UserError(f"messages[{i}].role: must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str) and not (role == "assistant" and content is None
                                                 and m.get("tool_calls")):
            raise UserError(f"messages[{i}].content: must be a string")


def split_reasoning(text: str) -> tuple[str, str]:
    """A thinking reply's (reasoning, answer): the text before and after THINK_END (the prompt
    opened the thinking section, so a reply that never closes it is all reasoning)."""
    head, _, tail = text.partition(THINK_END)
    return head, tail.lstrip()


class ReasoningStream:
    """split_reasoning over streamed deltas: each `push` returns (reasoning delta, answer delta).
    Text is reasoning until THINK_END; a possible partial THINK_END is held back, and so is the
    whitespace that opens the answer, whichever delta it arrives in."""

    def __init__(self) -> None:
        self._pending, self.answering, self._answer_started = "", False, False

    def push(self, text: str) -> tuple[str, str]:
        if self.answering:
            return "", self._answer(text)
        self._pending += text
        head, sep, tail = self._pending.partition(THINK_END)
        if sep:
            self._pending, self.answering = "", True
            return head, self._answer(tail)
        keep = next((k for k in range(len(THINK_END) - 1, 0, -1)
                     if self._pending.endswith(THINK_END[:k])), 0)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        return out, ""

    def finish(self) -> tuple[str, str]:
        out, self._pending = self._pending, ""
        return out, ""

    def _answer(self, text: str) -> str:
        """The answer delta, without the whitespace before the answer's first character."""
        if not self._answer_started:
            text = text.lstrip()
            self._answer_started = bool(text)
        return text
