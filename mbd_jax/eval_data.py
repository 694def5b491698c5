"""The user's own evaluation data: a JSONL file of questions and expected answers, and the
scorers that judge a reply.

    mbd-jax eval --dataset qa.jsonl --scorer number --json

One JSON object a line: `prompt` (raw text, sent as it is) or `messages` (a chat, rendered with
the model's chat template, as /v1/chat/completions does), and `answer` (a string, or a number
for the `number` scorer); blank lines are skipped. A scorer decides whether a reply (its answer
part: after the reasoning of a thinking reply) is right:

- `exact`: the reply, stripped, equals the answer;
- `regex`: the answer is a regular expression found in the reply (bounded: user_regex);
- `number`: the last number in the reply equals the answer's (as numbers: 7 == 7.0);
- `module:function`: a Python entry point called as function(reply, answer) -> bool.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

from mbd_jax import user_regex
from mbd_jax.errors import UserError

SCORERS = ("exact", "regex", "number")  # or module:function
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


@dataclasses.dataclass(frozen=True)
class Item:
    line: int  # where it is in its file (1-based)
    prompt: str | None  # raw text ...
    messages: list[dict[str, str]] | None  # ... or a chat
    answer: str


def load(path: str | pathlib.Path) -> list[Item]:
    """The items of a JSONL file; a malformed line is a UserError naming the file, the line and
    what is wrong with it."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"--dataset {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"--dataset {path}: not UTF-8 text") from None
    items = []
    for n, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            items.append(_item(raw, n, f"--dataset {path}, line {n}"))
    if not items:
        raise UserError(f"--dataset {path}: no examples (one JSON object a line)")
    return items


def _item(raw: str, n: int, where: str) -> Item:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object with 'prompt' or 'messages' and "
                        f"'answer'")
    unknown = sorted(set(obj) - {"prompt", "messages", "answer"})
    if unknown:
        raise UserError(f"{where}: unknown field '{unknown[0]}'; allowed: prompt, messages, answer")
    if ("prompt" in obj) == ("messages" in obj):
        raise UserError(f"{where}: give exactly one of 'prompt' (text) and 'messages' (a chat)")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise UserError(f"{where}: field 'prompt' must be a non-empty string")
    if messages is not None and not (
            isinstance(messages, list) and messages and all(
                isinstance(m, dict) and set(m) == {"role", "content"}
                and m["role"] in ("system", "user", "assistant")
                and isinstance(m["content"], str) for m in messages)):
        raise UserError(f"{where}: field 'messages' must be a non-empty list of "
                        '{"role": "system" | "user" | "assistant", "content": "..."}')
    answer = obj.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: field 'answer' must be a string or a number")
    return Item(n, prompt, messages, str(answer))


def scorer(name: str) -> Callable[[str, str], bool]:
    """The scorer `name` (SCORERS, or module:function), checked before any model loads."""
    if name == "exact":
        return lambda reply, answer: reply.strip() == answer.strip()
    if name == "regex":
        return lambda reply, answer: user_regex.compile_pattern(answer).search(reply) is not None
    if name == "number":
        return _number_matches
    module, _, function = name.partition(":")
    if not module or not function:
        raise UserError(f"--scorer {name!r}: expected one of {', '.join(SCORERS)} or "
                        "module:function")
    try:
        found = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise UserError(f"--scorer {name}: cannot load it ({e})") from None
    if not callable(found):
        raise UserError(f"--scorer {name}: not a function")
    return lambda reply, answer: bool(found(reply, answer))


def _number_matches(reply: str, answer: str) -> bool:
    found = _NUMBER.findall(reply.replace(",", ""))
    try:
        return bool(found) and float(found[-1]) == float(answer)
    except ValueError:
        return False


def check_regexes(items: list[Item], path: Any) -> None:
    """With the regex scorer every answer must compile: a bad one names its line."""
    for it in items:
        try:
            user_regex.compile_pattern(it.answer)
        except ValueError as e:
            raise UserError(f"--dataset {path}, line {it.line}: field 'answer': {e}") from None
