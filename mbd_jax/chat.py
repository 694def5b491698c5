"""Chat prompt rendering, one template per model family, with a thinking on/off switch.

- `plain` (the tiny presets): `<|role|> content` lines, then `<|assistant|>`; thinking on opens
  `<think>`.
- `qwen` (SDAR / Qwen3): `<|im_start|>role\ncontent<|im_end|>\n` ... `<|im_start|>assistant\n`;
  thinking off closes an empty think section (`<think>\n\n</think>\n\n`), the Qwen3 convention.
- `llada2` (LLaDA2 / Ling): `<role>SYSTEM</role>...<|role_end|><role>HUMAN</role>...<|role_end|>`
  `<role>ASSISTANT</role>`; thinking is switched by the system prompt's first line,
  `detailed thinking on` / `detailed thinking off`.
"""

from __future__ import annotations

from mbd_jax.errors import UserError

ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system
THINK_END = "</think>"  # every template closes its thinking section with this


def render(messages: list[dict], thinking: bool = False, template: str = "plain") -> str:
    """messages: [{"role": ..., "content": str}, ...] -> the prompt text, ending where the
    assistant's reply begins."""
    _check(messages)
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
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


def _check(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise UserError("messages: must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"messages[{i}]: must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UserError(f"messages[{i}].role: must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise UserError(f"messages[{i}].content: must be a string")


def split_reasoning(text: str) -> tuple[str, str]:
    """A thinking reply's (reasoning, answer): the text before and after THINK_END (the prompt
    opened the thinking section, so a reply that never closes it is all reasoning)."""
    head, _, tail = text.partition(THINK_END)
    return head, tail.lstrip()


class ReasoningStream:
    """split_reasoning over streamed deltas: each `push` returns (reasoning delta, answer delta).
    Text is reasoning until THINK_END; a possible partial THINK_END is held back."""

    def __init__(self) -> None:
        self._pending, self.answering = "", False

    def push(self, text: str) -> tuple[str, str]:
        if self.answering:
            return "", text
        self._pending += text
        head, sep, tail = self._pending.partition(THINK_END)
        if sep:
            self._pending, self.answering = "", True
            return head, tail.lstrip()
        keep = next((k for k in range(len(THINK_END) - 1, 0, -1)
                     if self._pending.endswith(THINK_END[:k])), 0)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        return out, ""

    def finish(self) -> tuple[str, str]:
        out, self._pending = self._pending, ""
        return out, ""
