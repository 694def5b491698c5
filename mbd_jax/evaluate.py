"""The eval harness: exact-match accuracy, TPF and tokens/s of a model on a held-out task split.

    mbd-jax eval --model tiny-mbd --task arith --limit 200 --buffer-size 2 --json

Every prompt of the split is decoded with the same DecodeConfig, `batch_size` rows at a time, on
an engine compiled for `decode.buffer_size` and warmed up first (so tokens/s excludes compiling).
TPF is output tokens (each answer and its EOS) over decode forwards, summed over the split.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from mbd_jax import eval_data
from mbd_jax.checkpoint import LoadedModel
from mbd_jax.config import DecodeConfig, decode_config
from mbd_jax.engine import Engine
from mbd_jax.errors import UserError
from mbd_jax.train import tasks


@dataclasses.dataclass
class EvalReport:
    model: str
    task: str  # a task name, or the comma-separated tasks pooled together
    n: int
    correct: int
    accuracy: float
    tpf: float
    tokens_per_s: float
    tokens: int
    nfe: int
    seconds: float
    buffer_size: int
    accept_threshold: float
    format: str  # how the questions reached the model (tasks.FORMATS)
    wrong: list[dict[str, str]]  # a few failures, for reading

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def task_names(task: str, limit: int, where: str = "--task") -> list[str]:
    """`task` (a name, a comma-separated list, or `all`) as task names; checks `limit` too."""
    names = list(tasks.TASKS) if task == "all" else task.split(",")
    tasks.check_tasks(names, where=where, allowed=tasks.EVAL_TASKS)
    if limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    return names


def evaluate(model: LoadedModel, task: str, decode: DecodeConfig, *, limit: int = 100,
             batch_size: int = 16, seed: int = 1234, progress: bool = False,
             engine: Engine | None = None, mesh=None, fmt: str = "chat") -> EvalReport:
    """Decodes the first `limit` held-out examples of each task in `task` (a name, a comma-separated
    list, or `all`), each question in format `fmt` (tasks.FORMATS: a chat turn, after a system
    line, after an earlier turn, or raw text); `engine` may be reused across calls (compiled for
    >= decode.buffer_size), or is built on `mesh`."""
    names = task_names(task, limit)
    if model.tokenizer is None:
        raise UserError(f"--model {model.path}: eval needs a model with a tokenizer")
    examples = [ex for name in names for ex in tasks.heldout(name, limit, seed, fmt)]
    prompts = [model.tokenizer.encode(ex.prompt) for ex in examples]
    if engine is None:
        engine = Engine(model.cfg, model.params, batch_size=batch_size,
                        buffer_size=decode.buffer_size, tokenizer=model.tokenizer, mesh=mesh)
        engine.warmup(buckets=engine.prefill_buckets_for(prompts))
    engine.check_decode(decode, where="decoding")
    tally = decode_and_score(
        engine, prompts, decode, lambda i, text: examples[i].is_correct(text),
        lambda i: (examples[i].prompt, examples[i].answer), f"{task} N{decode.buffer_size}",
        progress)
    return tally.report(model.cfg.name, ",".join(names), decode, fmt)


@dataclasses.dataclass
class Tally:
    """What decoding a set of prompts and scoring the replies came to."""

    n: int = 0
    correct: int = 0
    tokens: int = 0  # TPF's numerator: each answer and its EOS
    nfe: int = 0
    seconds: float = 0.0
    wrong: list[dict[str, str]] = dataclasses.field(default_factory=list)  # the first few

    def report(self, model: str, task: str, decode: DecodeConfig, fmt: str) -> EvalReport:
        return EvalReport(model=model, task=task, n=self.n, correct=self.correct,
                          accuracy=self.correct / self.n, tpf=self.tokens / max(self.nfe, 1),
                          tokens_per_s=self.tokens / max(self.seconds, 1e-9), tokens=self.tokens,
                          nfe=self.nfe, seconds=round(self.seconds, 3),
                          buffer_size=decode.buffer_size,
                          accept_threshold=decode.accept_threshold, format=fmt, wrong=self.wrong)


def decode_and_score(engine: Engine, prompts: list[list[int]], decode: DecodeConfig,
                     is_correct: Callable[[int, str], bool],
                     shown: Callable[[int], tuple[str, str]], desc: str,
                     progress: bool) -> Tally:
    """Decodes `prompts` (token ids) `engine.batch_size` at a time and scores reply i with
    is_correct(i, text); `shown(i)` is (prompt, expected) of a wrong one, kept for reading."""
    from tqdm import tqdm

    tally = Tally(n=len(prompts))
    bar = tqdm(total=len(prompts), disable=not progress, unit="ex", desc=desc)
    for s in range(0, len(prompts), engine.batch_size):
        t0 = time.perf_counter()
        results = engine.generate(prompts[s: s + engine.batch_size], decode)
        tally.seconds += time.perf_counter() - t0
        for i, r in enumerate(results, s):
            ok = is_correct(i, r.text)
            tally.correct += ok
            tally.tokens += r.output_tokens
            tally.nfe += r.nfe
            if not ok and len(tally.wrong) < 5:
                prompt, expected = shown(i)
                tally.wrong.append({"prompt": prompt, "expected": expected, "got": r.text})
        bar.update(len(results))
        done = s + len(results)
        bar.set_postfix(acc=f"{tally.correct / done:.3f}",
                        tpf=f"{tally.tokens / max(tally.nfe, 1):.2f}")
    bar.close()
    return tally


def evaluate_dataset(model: LoadedModel, path: str, decode: DecodeConfig, scorer: str = "exact",
                     *, batch_size: int = 16, progress: bool = False,
                     engine: Engine | None = None, mesh=None) -> EvalReport:
    """Accuracy, TPF and tokens/s on the user's JSONL file (eval_data.py): raw prompts as they
    are, chats in the model's chat template; each reply's answer part (after the reasoning of a
    thinking reply) judged by `scorer`."""
    from mbd_jax import chat

    judge = eval_data.scorer(scorer)
    items = eval_data.load(path)
    if scorer == "regex":
        eval_data.check_regexes(items, path)
    if model.tokenizer is None:
        raise UserError(f"--model {model.path}: eval needs a model with a tokenizer")
    template = chat.for_model(model.path.parent, model.cfg.chat_template)
    texts = [it.prompt if it.prompt is not None else template.render(it.messages)
             for it in items]
    prompts = [model.tokenizer.encode(t) for t in texts]
    if engine is None:
        engine = Engine(model.cfg, model.params, batch_size=batch_size,
                        buffer_size=decode.buffer_size, tokenizer=model.tokenizer, mesh=mesh)
        engine.warmup(buckets=engine.prefill_buckets_for(prompts))
    engine.check_decode(decode, where="decoding")
    for it, p in zip(items, prompts):
        engine.check_prompt(p, where=f"--dataset {path}, line {it.line}")

    def is_correct(i: int, text: str) -> bool:
        reply = chat.split_reasoning(text)[1] if chat.THINK_END in text else text
        return judge(reply.strip(), items[i].answer)

    tally = decode_and_score(engine, prompts, decode, is_correct,
                             lambda i: (texts[i], items[i].answer),
                             f"{pathlib.Path(path).name} N{decode.buffer_size}", progress)
    return tally.report(model.cfg.name, str(path), decode, f"dataset:{scorer}")


def table1_decode(buffer_size: int, **overrides: Any) -> DecodeConfig:
    """The MBD paper's Table 1 settings (its SDAR-b4 math ones: tau_accept 0.95, tau_add 0.1,
    tau_semi 0.25), 48 new tokens at most: tools/table1.py, tools/compare_models.py and the
    shipped-model tests measure with them. None overrides keep these."""
    return decode_config(**{"buffer_size": buffer_size, "accept_threshold": 0.95,
                            "add_block_threshold": 0.1, "semi_complete_threshold": 0.25,
                            "max_new_tokens": 48,
                            **{k: v for k, v in overrides.items() if v is not None}})


def evaluate_tasks(model: LoadedModel, decode: DecodeConfig, engine: Engine, *, limit: int,
                   fmt: str = "chat", names: Sequence[str] = tuple(tasks.TASKS)
                   ) -> list[EvalReport]:
    """One report per task of `names` (default: the whole suite), on one engine; `pool` merges
    them."""
    return [evaluate(model, name, decode, limit=limit, engine=engine, fmt=fmt) for name in names]


def pool(reports: list[EvalReport]) -> dict[str, Any]:
    """Reports of several tasks (same model and decoding) pooled: accuracy over every prompt, TPF
    and tokens/s over every token."""
    n = sum(r.n for r in reports)
    correct = sum(r.correct for r in reports)
    tokens, nfe = sum(r.tokens for r in reports), sum(r.nfe for r in reports)
    seconds = sum(r.seconds for r in reports)
    return {"n": n, "correct": correct, "accuracy": correct / n, "tpf": tokens / max(nfe, 1),
            "tokens_per_s": tokens / seconds if seconds else 0.0, "tokens": tokens, "nfe": nfe}
