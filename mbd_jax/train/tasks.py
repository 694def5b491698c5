"""A deterministic synthetic task suite with exact-match answers (no downloads).

Every example is made on the fly from a seed. Prompts are chat turns rendered with the `plain`
template, so a request to the service looks exactly like a training prompt. A fixed share of all
possible prompts is held out: `examples(..., split="train")` never yields a held-out prompt and
`split="heldout"` yields only those, so accuracy on the held-out split measures generalisation.

    arith    What is 47+38?               -> 47+38=85        (two-digit + and -, worked answer)
    sort     Sort: 7 2 9 4                -> 2 4 7 9
    reverse  Reverse: k d a q m           -> m q a d k
    recall   Recall c in: a=4 c=9 f=1     -> c=9
"""

from __future__ import annotations

import dataclasses
import hashlib
import string
from collections.abc import Callable, Iterator

import numpy as np

from mbd_jax.chat import render
from mbd_jax.errors import UserError

HELDOUT_PER_MILLE = 100  # 10% of all prompts are held out
_LETTERS = string.ascii_lowercase


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # the rendered chat prompt (ends where the assistant's reply begins)
    answer: str  # the exact expected reply

    def is_correct(self, reply: str) -> bool:
        return reply.strip() == self.answer


def _arith(rng: np.random.Generator) -> tuple[str, str]:
    a, b = int(rng.integers(0, 100)), int(rng.integers(0, 100))
    if rng.random() < 0.5:
        return f"What is {a}+{b}?", f"{a}+{b}={a + b}"
    a, b = max(a, b), min(a, b)
    return f"What is {a}-{b}?", f"{a}-{b}={a - b}"


def _sort(rng: np.random.Generator) -> tuple[str, str]:
    xs = [int(x) for x in rng.integers(0, 10, size=int(rng.integers(3, 7)))]
    return "Sort: " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))


def _reverse(rng: np.random.Generator) -> tuple[str, str]:
    xs = [_LETTERS[int(i)] for i in rng.integers(0, 26, size=int(rng.integers(3, 8)))]
    return "Reverse: " + " ".join(xs), " ".join(reversed(xs))


def _recall(rng: np.random.Generator) -> tuple[str, str]:
    keys = rng.choice(26, size=int(rng.integers(2, 6)), replace=False)
    pairs = [(_LETTERS[int(k)], int(rng.integers(0, 10))) for k in keys]
    key, value = pairs[int(rng.integers(0, len(pairs)))]
    return (f"Recall {key} in: " + " ".join(f"{k}={v}" for k, v in pairs), f"{key}={value}")


TASKS: dict[str, Callable[[np.random.Generator], tuple[str, str]]] = {
    "arith": _arith, "sort": _sort, "reverse": _reverse, "recall": _recall}


def is_heldout(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1000 < HELDOUT_PER_MILLE


def check_tasks(names: list[str] | tuple[str, ...], where: str = "tasks") -> None:
    bad = [n for n in names if n not in TASKS]
    if bad or not names:
        raise UserError(f"{where}: unknown task(s) {', '.join(bad) or '(none given)'}; "
                        f"allowed: {', '.join(TASKS)}")


def examples(tasks: list[str] | tuple[str, ...], seed: int, split: str = "train"
             ) -> Iterator[Example]:
    """An endless, deterministic stream of examples, tasks in turn, from `split`."""
    check_tasks(tasks)
    if split not in ("train", "heldout"):
        raise UserError(f"split: must be 'train' or 'heldout', got {split!r}")
    rng = np.random.default_rng(seed)
    want_heldout = split == "heldout"
    i = 0
    while True:
        task = tasks[i % len(tasks)]
        question, answer = TASKS[task](rng)
        if is_heldout(question) == want_heldout:
            i += 1
            yield Example(task, render([{"role": "user", "content": question}]), answer)


def heldout(task: str, n: int, seed: int = 1234) -> list[Example]:
    """The first n distinct held-out examples of one task (the eval set)."""
    seen: dict[str, Example] = {}
    for draws, ex in enumerate(examples([task], seed, split="heldout")):
        seen.setdefault(ex.prompt, ex)
        if len(seen) == n:
            return list(seen.values())
        if draws > 100 * n:
            raise UserError(f"--limit {n}: task {task} has only about {len(seen)} held-out prompts")


def corpus_lines(tasks: list[str] | tuple[str, ...], n: int, seed: int = 0) -> list[str]:
    """Training text for the tokenizer: n rendered prompt + answer pairs."""
    stream = examples(tasks, seed)
    return [f"{ex.prompt} {ex.answer}" for ex, _ in zip(stream, range(n))]
