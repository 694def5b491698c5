"""A deterministic synthetic task suite with exact-match answers (no downloads).

Every example is made on the fly from a seed. A fixed share of all possible questions is held
out (by a hash of the question text): `examples(..., split="train")` never yields a held-out
question, not even as an earlier turn of a conversation, and `split="heldout"` yields only those,
so accuracy on the held-out split measures generalisation.

    arith    What is 47+38?                      -> 47+38=85   (two-digit + and -, worked answer)
    sort     Sort: 7 2 9 4                       -> 2 4 7 9    (3-10 digits)
    reverse  Reverse: k d a q m                  -> m q a d k  (3-10 letters)
    recall   Recall c f in: a=4 c=9 f=1 x=0      -> c=9 f=1    (2-6 pairs, one or two keys)
    sortrev  Sort and reverse: 7 2 9 4           -> 9 7 4 2    (two steps: 3-8 digits)
    longsort     Sort: 11-20 digits              -> 22-40 tokens: 3-6 8-token blocks with its EOS
    longreverse  Reverse: 11-24 letters          -> 11-24 tokens: 2-4 blocks with its EOS

    structured (the shipped models' structured-output tasks, tool_calls.py):
    jsonsort     Sort as JSON: 7 2 9 4           -> {"sorted": [2, 4, 7, 9]}   (3-8 digits)
    toolsort     (tools: sort_numbers) Sort: 7 2 9 4
                 -> <tool_call>{"name": "sort_numbers", "arguments": {"numbers": [7, 2, 9, 4]}}</tool_call>
                 (chat only: the offered tools are a system line of the template)

    on trial (TRIAL_TASKS: trained and evaluated by name, not yet in the suite):
    longarith    What is 347+586?  -> 7+6=13 4+8+1=13 3+5+1=9 347+586=933  (three-digit + and -,
                 worked column by column: 4-5 blocks)
    longsortrev  Sort and reverse: 11-20 digits  -> 3-6 blocks

    recall2  (a training-only drill) recall asking exactly two keys, mostly in list order
    longsub  (a training-only drill) longarith's subtractions only (the borrowing columns)

The long tasks' answers span several 8-token blocks, which is where decoding the next block
early (MultiBD) has room to pay: they exist for that (the first five are the shipped pipeline's
first stages; their streams do not change when tasks are added).

A question reaches the model in one of four formats, so every service path sees text it was
trained on: `chat` (one user turn, the `plain` template: `/v1/chat/completions`), `system` (a
system line first), `multiturn` (an earlier, answered question before it; sometimes a system
line too) and `raw` (the bare question with no template: `/v1/completions`, `/generate`).
Training mixes them by FORMAT_WEIGHTS; eval asks for one.

A raw question has no turn marker, and in a diffusion canvas an answer token once unmasked looks
like one more item of the question's list (`Reverse: a b c` + `c` reads `Reverse: a b c c`), so
the model cannot tell where its answer began. With `raw_answer_prefix` a raw reply starts with
RAW_ANSWER_PREFIX (`Sort: 3 1 2` -> `Answer: 1 2 3`), which marks it; `is_correct` reads the
answer after it.

A fifth format, `thinking`, is a chat turn with the thinking switch on: the prompt opens a
thinking section and the reply is a short worked trace, `</think>`, then the answer. Only arith
and (long)sortrev have a trace that does work (the digit columns with their carries or borrows; the
sorted list before its reversal); the others think nothing (`</think>` at once: longarith's
answer is worked already). Training gets it
only where a config asks (`thinking_share`).

    arith    What is 47+38?       (thinking) -> 7+8=15 4+3+1=8</think> 47+38=85
    sortrev  Sort and reverse: 7 2 9 4       -> 2 4 7 9</think> 9 7 4 2
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import string
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from mbd_jax.chat import THINK_END, render, split_reasoning
from mbd_jax.errors import UserError
from mbd_jax.tool_calls import Function, render_call

HELDOUT_PER_MILLE = 100  # 10% of all questions are held out
_LETTERS = string.ascii_lowercase

# The system lines a `system` / `multiturn` example may start with.
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Answer briefly.",
    "Answer with the result only.",
    "You are the mbd-jax demo model.",
    "Be exact.",
    "You solve small puzzles.",
)
# How often each format appears in training (eval picks one).
FORMAT_WEIGHTS = {"chat": 0.45, "system": 0.2, "multiturn": 0.2, "raw": 0.15}
# Every format eval can ask for: `thinking` enters training only by a config's thinking_share.
FORMATS = (*FORMAT_WEIGHTS, "thinking")
# What a raw reply writes before its answer where a config asks (raw_answer_prefix).
RAW_ANSWER_PREFIX = "Answer:"


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # the text before the reply (a rendered chat prompt, or the bare question)
    answer: str  # the exact expected answer
    format: str = "chat"
    reasoning: str | None = None  # the worked trace before THINK_END (format `thinking` only)
    prefix: str = ""  # what the reply writes before the answer (RAW_ANSWER_PREFIX, or nothing)

    @property
    def reply(self) -> str:
        """The text the model is trained to write after the prompt."""
        answer = f"{self.prefix} {self.answer}" if self.prefix else self.answer
        return answer if self.reasoning is None else f"{self.reasoning}{THINK_END} {answer}"

    def is_correct(self, reply: str) -> bool:
        """Exact match of the answer (of a thinking reply: the part after THINK_END; of a raw
        one: the part after RAW_ANSWER_PREFIX where it starts with one)."""
        text = (reply if self.reasoning is None else split_reasoning(reply)[1]).strip()
        if self.format == "raw":
            text = text.removeprefix(RAW_ANSWER_PREFIX).strip()
        return text == self.answer


class Problem(NamedTuple):
    question: str
    answer: str
    trace: str = ""  # the worked trace a thinking reply writes before THINK_END ("": none)
    tools: tuple[Function, ...] = ()  # offered to the reply (chat only)


# The tool the structured tasks offer (and the README's tool-call example).
SORT_TOOL = Function("sort_numbers", {
    "type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
    "required": ["numbers"], "additionalProperties": False}, "Sort a list of integers")
# The JSON Schema of a jsonsort answer.
JSONSORT_SCHEMA = {"type": "object", "properties": {"sorted": {"type": "array", "items": {
    "type": "integer"}}}, "required": ["sorted"], "additionalProperties": False}


def _digits(rng: np.random.Generator, lo: int, hi: int) -> list[int]:
    return [int(x) for x in rng.integers(0, 10, size=int(rng.integers(lo, hi + 1)))]


def _letters(rng: np.random.Generator, lo: int, hi: int) -> list[str]:
    return [_LETTERS[int(i)] for i in rng.integers(0, 26, size=int(rng.integers(lo, hi + 1)))]


def _arith(rng: np.random.Generator) -> Problem:
    a, b = int(rng.integers(0, 100)), int(rng.integers(0, 100))
    if rng.random() < 0.5:
        return Problem(f"What is {a}+{b}?", f"{a}+{b}={a + b}", _arith_trace(a, "+", b))
    a, b = max(a, b), min(a, b)
    return Problem(f"What is {a}-{b}?", f"{a}-{b}={a - b}", _arith_trace(a, "-", b))


def _sort(rng: np.random.Generator, lo: int = 3, hi: int = 10) -> Problem:
    xs = _digits(rng, lo, hi)
    return Problem("Sort: " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs))))


def _reverse(rng: np.random.Generator, lo: int = 3, hi: int = 10) -> Problem:
    xs = _letters(rng, lo, hi)
    return Problem("Reverse: " + " ".join(xs), " ".join(reversed(xs)))


def _recall(rng: np.random.Generator) -> Problem:
    keys = rng.choice(26, size=int(rng.integers(2, 7)), replace=False)
    pairs = [(_LETTERS[int(k)], int(rng.integers(0, 10))) for k in keys]
    asked = sorted(rng.choice(len(pairs), size=min(len(pairs) - 1, int(rng.integers(1, 3))),
                              replace=False))
    return _recall_problem(pairs, [int(i) for i in asked])


def _recall_problem(pairs: list[tuple[str, int]], asked: list[int]) -> Problem:
    """`Recall <asked keys> in: <pairs>` -> the asked pairs, in the order asked."""
    wanted = [pairs[i] for i in asked]
    return Problem(f"Recall {' '.join(k for k, _ in wanted)} in: "
                   + " ".join(f"{k}={v}" for k, v in pairs), " ".join(f"{k}={v}" for k, v in wanted))


def _recall_two_keys(rng: np.random.Generator) -> Problem:
    """A recall question asking exactly two keys of 3-6 pairs: half of them in list order (as
    recall asks), the rest in a random order (so three in four are in list order)."""
    n = int(rng.integers(3, 7))
    keys = rng.choice(26, size=n, replace=False)
    pairs = [(_LETTERS[int(k)], int(rng.integers(0, 10))) for k in keys]
    asked = [int(i) for i in rng.choice(n, size=2, replace=False)]
    return _recall_problem(pairs, sorted(asked) if rng.random() < 0.5 else asked)


def _sortrev(rng: np.random.Generator, lo: int = 3, hi: int = 8) -> Problem:
    xs = _digits(rng, lo, hi)
    return Problem("Sort and reverse: " + " ".join(map(str, xs)),
                   " ".join(map(str, sorted(xs)[::-1])), " ".join(map(str, sorted(xs))))


def _jsonsort(rng: np.random.Generator) -> Problem:
    xs = _digits(rng, 3, 8)
    return Problem("Sort as JSON: " + " ".join(map(str, xs)), json.dumps({"sorted": sorted(xs)}))


def _toolsort(rng: np.random.Generator) -> Problem:
    xs = _digits(rng, 3, 6)
    return Problem("Sort: " + " ".join(map(str, xs)),
                   render_call(SORT_TOOL.name, {"numbers": xs}), tools=(SORT_TOOL,))


def _arith_trace(a: int, op: str, b: int, width: int = 2) -> str:
    """Column by column, units first, `width` columns: `7+8=15 4+3+1=8` (47+38, a carry in as
    +1); `17-8=9 4-1-3=0` (47-38: a column that borrows shows its digit plus 10, the next one
    pays the borrow as -1). Needs a >= b for `-`."""
    steps, carry = [], 0
    for i in range(width):
        x, y = a // 10**i % 10, b // 10**i % 10
        pay = "+1" if op == "+" and carry else "-1" if carry else ""
        if op == "+":
            value = x + y + carry
            steps.append(f"{x}+{y}{pay}={value}")
            carry = int(value >= 10)
        else:
            borrow = int(x - carry - y < 0)
            steps.append(f"{x + 10 * borrow}{pay}-{y}={x + 10 * borrow - carry - y}")
            carry = borrow
    return " ".join(steps)


def _long_arith(rng: np.random.Generator, minus_only: bool = False) -> Problem:
    """Three-digit + or - whose answer is worked: the columns with their carries or borrows,
    then the result (`What is 347+586?` -> `7+6=13 4+8+1=13 3+5+1=9 347+586=933`).
    minus_only: subtractions only (the draws are the same, a sum's turned into a difference)."""
    a, b = int(rng.integers(100, 1000)), int(rng.integers(100, 1000))
    op = "+" if rng.random() < 0.5 and not minus_only else "-"
    if op == "-":
        a, b = max(a, b), min(a, b)
    result = a + b if op == "+" else a - b
    return Problem(f"What is {a}{op}{b}?",
                   f"{_arith_trace(a, op, b, width=3)} {a}{op}{b}={result}")


TASKS: dict[str, Callable[[np.random.Generator], Problem]] = {
    "arith": _arith, "sort": _sort, "reverse": _reverse, "recall": _recall, "sortrev": _sortrev,
    "longsort": functools.partial(_sort, lo=11, hi=20),
    "longreverse": functools.partial(_reverse, lo=11, hi=24)}
# The structured-output tasks: evaluated by name (`eval --task jsonsort`), not in the suite's
# `all` (Table 1 and the accuracy floors are the plain tasks').
STRUCTURED_TASKS: dict[str, Callable[[np.random.Generator], Problem]] = {
    "jsonsort": _jsonsort, "toolsort": _toolsort}
CHAT_ONLY_TASKS = frozenset({"toolsort"})  # their tools are offered in a chat

# Tasks on trial: trained (the trial configs: long-answers, long-arith-drill, longsub, long-mix,
# long-mix-borrow, long-mbd, long-mbd-full) and evaluated when named (`eval --task longarith`),
# but not in the suite (`all`, Table 1, the shipped models' floors) until a shipped pair meets the
# bar on them (docs/lab/training-history.md, "Long answers: a trial").
TRIAL_TASKS: dict[str, Callable[[np.random.Generator], Problem]] = {
    "longarith": _long_arith, "longsortrev": functools.partial(_sortrev, lo=11, hi=20)}
# What eval may name, and how a --task flag says so.
EVAL_TASKS = {**TASKS, **TRIAL_TASKS, **STRUCTURED_TASKS}
EVAL_TASKS_HELP = (f"comma-separated: {', '.join(TASKS)}, or all (these: the suite); by name "
                   f"only: structured output {', '.join(STRUCTURED_TASKS)}, on trial "
                   f"{', '.join(TRIAL_TASKS)}")


# Training-only drills: questions of an evaluated task's kind, drawn to train one skill (never
# evaluated; a held-out question of the task is held out of its drill too, by the same hash).
DRILLS: dict[str, Callable[[np.random.Generator], Problem]] = {
    "recall2": _recall_two_keys, "longsub": functools.partial(_long_arith, minus_only=True)}
# What a training config may name.
TRAIN_TASKS = {**EVAL_TASKS, **DRILLS}


def is_heldout(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1000 < HELDOUT_PER_MILLE


def check_tasks(names: list[str] | tuple[str, ...], where: str = "tasks",
                allowed: dict[str, Callable] = TASKS) -> None:
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise UserError(f"{where}: unknown task(s) {', '.join(bad) or '(none given)'}; "
                        f"allowed: {', '.join(allowed)}")


def _train_question(tasks: list[str] | tuple[str, ...], rng: np.random.Generator
                    ) -> tuple[str, str]:
    """A question (and answer) of a random task from the train split: an earlier turn (not a
    tool task's: a turn without the tools offered never answers with a call)."""
    while True:
        question, answer, _, tools = TRAIN_TASKS[tasks[int(rng.integers(len(tasks)))]](rng)
        if not is_heldout(question) and not tools:
            return question, answer


def render_example(question: str, fmt: str, rng: np.random.Generator,
                   tasks: list[str] | tuple[str, ...], tools: tuple[Function, ...] = ()) -> str:
    """The prompt text of `question` in format `fmt` (extra turns drawn from `rng`; `tools`:
    offered, in a chat)."""
    if fmt == "raw":
        return question
    messages = [{"role": "user", "content": question}]
    if tools:
        return render(messages, tools=list(tools))
    if fmt == "thinking":
        return render(messages, thinking=True)
    if fmt == "multiturn":
        q0, a0 = _train_question(tasks, rng)
        messages = [{"role": "user", "content": q0}, {"role": "assistant", "content": a0},
                    *messages]
    if fmt == "system" or (fmt == "multiturn" and rng.random() < 0.5):
        system = SYSTEM_PROMPTS[int(rng.integers(len(SYSTEM_PROMPTS)))]
        messages = [{"role": "system", "content": system}, *messages]
    return render(messages)


def examples(tasks: list[str] | tuple[str, ...], seed, split: str = "train",
             fmt: str | None = None, thinking_share: float = 0.0,
             format_weights: dict[str, float] | None = None,
             raw_answer_prefix: bool = False) -> Iterator[Example]:
    """An endless, deterministic stream of examples, tasks in turn, from `split`, in format
    `fmt` (None: `thinking` with probability thinking_share, else drawn by format_weights,
    default FORMAT_WEIGHTS; a share of 0 draws nothing for it, so the stream is the one made
    before the format existed). raw_answer_prefix: raw replies start with RAW_ANSWER_PREFIX."""
    check_tasks(tasks, allowed=TRAIN_TASKS)
    if split not in ("train", "heldout"):
        raise UserError(f"split: must be 'train' or 'heldout', got {split!r}")
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    rng = np.random.default_rng(seed)
    want_heldout = split == "heldout"
    format_weights = FORMAT_WEIGHTS if format_weights is None else format_weights
    names, weights = list(format_weights), np.array(list(format_weights.values()), float)
    i = 0
    while True:
        task = tasks[i % len(tasks)]
        question, answer, trace, tools = TRAIN_TASKS[task](rng)
        if is_heldout(question) == want_heldout:
            i += 1
            f = fmt or ("thinking" if thinking_share and rng.random() < thinking_share else
                        names[int(rng.choice(len(names), p=weights / weights.sum()))])
            if tools and f != "chat":  # a tool is offered in a chat
                if fmt is not None:
                    raise UserError(f"format {fmt}: task {task} offers a tool, which only a "
                                    "chat does (format chat)")
                f = "chat"
            yield Example(task, render_example(question, f, rng, tasks, tools), answer, f,
                          trace if f == "thinking" else None,
                          RAW_ANSWER_PREFIX if raw_answer_prefix and f == "raw" else "")


def heldout(task: str, n: int, seed: int = 1234, fmt: str = "chat") -> list[Example]:
    """The first n distinct held-out examples of one task in one format (the eval set)."""
    seen: dict[str, Example] = {}
    for draws, ex in enumerate(examples([task], seed, split="heldout", fmt=fmt)):
        seen.setdefault(ex.prompt, ex)
        if len(seen) == n:
            return list(seen.values())
        if draws > 100 * n:
            raise UserError(f"--limit {n}: task {task} has only about {len(seen)} held-out prompts")


def corpus_lines(tasks: list[str] | tuple[str, ...], n: int, seed: int = 0) -> list[str]:
    """Training text for the tokenizer: n rendered prompt + answer pairs."""
    stream = examples(tasks, seed)
    return [f"{ex.prompt} {ex.reply}" for ex, _ in zip(stream, range(n))]
