"""Chat prompt rendering for models without a template of their own (the tiny presets).

Role markers as single special tokens: `<|system|>`, `<|user|>`, `<|assistant|>`; thinking on
opens a `<think>` section after the assistant marker (Qwen convention). Model-specific templates
(LLaDA2, Qwen) come with checkpoint conversion.
"""

from __future__ import annotations

from mbd_jax.errors import UserError

ROLES = ("system", "user", "assistant")


def render(messages: list[dict], thinking: bool = False) -> str:
    """messages: [{"role": ..., "content": str}, ...] -> the prompt text ending with the
    assistant marker (and `<think>` when thinking)."""
    if not isinstance(messages, list) or not messages:
        raise UserError("messages: must be a non-empty list of {role, content}")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"messages[{i}]: must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UserError(f"messages[{i}].role: must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise UserError(f"messages[{i}].content: must be a string")
        parts.append(f"<|{role}|> {content}\n")
    parts.append("<|assistant|>" + (" <think>" if thinking else ""))
    return "".join(parts)
