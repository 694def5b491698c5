"""The synthetic task suite and the trainer's length buckets: every answer equals an independent
solver's, held-out questions never reach training (not even as an earlier turn), the formats mix
as configured, and a bucketed batch holds exactly the examples that need its length."""

from __future__ import annotations

import collections
import hashlib
import json
import re

import numpy as np
import pytest

from mbd_jax.checkpoint import load_model
from mbd_jax.errors import UserError
from mbd_jax.train import tasks
from mbd_jax.train.config import TrainConfig
from mbd_jax.train.trainer import batch_for_step, encode, length_shares

TURN = re.compile(r"<\|(system|user|assistant)\|> ([^\n]*)\n?")
# every task a question can reach in any format (a tool task's only in a chat: its own test)
ANY_FORMAT = [t for t in tasks.EVAL_TASKS if t not in tasks.CHAT_ONLY_TASKS]


def solve(question: str) -> str:
    """An independent solver for every task's question text."""
    if m := re.fullmatch(r"What is (\d+)([+-])(\d+)\?", question):
        a, op, b = int(m[1]), m[2], int(m[3])
        result = f"{a}{op}{b}={a + b if op == '+' else a - b}"
        if len(m[1]) == len(m[3]) == 3:  # longarith: the worked columns first
            return f"{worked_columns(m[1], op, m[3])} {result}"
        return result
    if m := re.fullmatch(r"Sort and reverse: ([\d ]+)", question):
        return " ".join(sorted(m[1].split(), reverse=True))
    if m := re.fullmatch(r"Sort as JSON: ([\d ]+)", question):
        return '{"sorted": [' + ", ".join(sorted(m[1].split())) + "]}"
    if m := re.fullmatch(r"Sort: ([\d ]+)", question):
        return " ".join(sorted(m[1].split()))
    if m := re.fullmatch(r"Reverse: ([a-z ]+)", question):
        return " ".join(m[1].split()[::-1])
    if m := re.fullmatch(r"Recall ([a-z ]+) in: (.+)", question):
        table = dict(p.split("=") for p in m[2].split())
        return " ".join(f"{k}={table[k]}" for k in m[1].split())
    raise AssertionError(f"unknown question {question!r}")


def worked_columns(a: str, op: str, b: str) -> str:
    """Pencil-and-paper columns of two numbers written to the same width, units first: each
    column's digits, a carry in as `+1` (a borrow paid as `-1`), a digit that borrows written
    plus 10 (arith's thinking trace, two columns; longarith's answer, three)."""
    width = max(len(a), len(b))
    out, carry = [], 0
    for x, y in zip(map(int, reversed(a.zfill(width))), map(int, reversed(b.zfill(width)))):
        if op == "+":
            out.append(f"{x}+{y}" + "+1" * carry + f"={x + y + carry}")
            carry = (x + y + carry) // 10
        else:
            top = x + 10 if x - carry < y else x
            out.append(f"{top}" + "-1" * carry + f"-{y}={top - carry - y}")
            carry = int(top > x)
    return " ".join(out)


def turns(ex: tasks.Example) -> list[tuple[str, str]]:
    if ex.format == "raw":
        return [("user", ex.prompt)]
    opening = "<|assistant|> <think>" if ex.format == "thinking" else "<|assistant|>"
    assert ex.prompt.endswith(opening)
    return TURN.findall(ex.prompt[: -len(opening)])


def check_trace(ex: tasks.Example) -> None:
    """A thinking reply's trace does the work it claims: arith's columns are the pencil-and-paper
    ones (worked_columns: the carries and borrows) and spell the answer; sortrev's trace is the
    sorted list (longsortrev's too); the other tasks think nothing."""
    question = turns(ex)[-1][1]
    if ex.task == "arith":
        a, op, b = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", question).groups()
        assert ex.reasoning == worked_columns(a.zfill(2), op, b.zfill(2)), ex
        tens, units = (int(col.split("=")[1]) for col in ex.reasoning.split()[::-1])
        assert ex.answer.endswith(f"={tens * 10 + units % 10}"), ex  # it spells the answer
    elif ex.task in ("sortrev", "longsortrev"):
        assert ex.reasoning == " ".join(sorted(question.split(": ")[1].split())), ex
    else:
        assert ex.reasoning == "", ex
    assert ex.reply == f"{ex.reasoning}</think> {ex.answer}"


def test_the_shipped_models_training_stream_is_unchanged():
    """Without thinking_share the stream is the one the shipped models were trained on (a hash of
    its first 500 examples, taken before the thinking format existed), so `make models`
    reproduces them."""
    h = hashlib.sha256()
    first_five = ["arith", "sort", "reverse", "recall", "sortrev"]  # tasks added later: no change
    assert list(tasks.TASKS)[:5] == first_five
    for ex, _ in zip(tasks.examples(first_five, seed=3), range(500)):
        h.update(f"{ex.format}|{ex.prompt}|{ex.answer}".encode())
    assert h.hexdigest()[:16] == "62021622fe02d550"


def test_thinking_examples_work_their_trace_and_follow_the_share():
    stream = tasks.examples(ANY_FORMAT, seed=4, thinking_share=0.3)
    seen = collections.Counter()
    for ex, _ in zip(stream, range(1500)):
        seen[ex.format] += 1
        assert solve(turns(ex)[-1][1]) == ex.answer, ex
        if ex.format == "thinking":
            assert [r for r, _ in turns(ex)] == ["user"]
            check_trace(ex)
            assert ex.is_correct(ex.reply) and ex.is_correct(f"anything</think> {ex.answer}")
            assert not ex.is_correct(ex.answer)  # never closed: all of it is reasoning
        else:
            assert ex.reasoning is None and ex.reply == ex.answer
    assert abs(seen["thinking"] / 1500 - 0.3) < 0.04, seen
    for fmt, w in tasks.FORMAT_WEIGHTS.items():  # the rest keep their proportions
        assert abs(seen[fmt] / 1500 - 0.7 * w) < 0.04, (fmt, seen)
    for name in ANY_FORMAT:
        for ex in tasks.heldout(name, 30, fmt="thinking"):
            check_trace(ex)
    worked = [ex.answer for ex in tasks.heldout("longarith", 300)]  # every kind of column occurs
    for kind in (r"\d\+\d\+1=", r"\b1\d-\d=", r"\b1\d-1-\d=", r"\b\d-1-\d=", r"=0 \d+-"):
        assert any(re.search(kind, w) for w in worked), kind  # carries, borrows, chained borrows
    borrow = [ex for ex in tasks.heldout("arith", 200, fmt="thinking") if "-1-" in ex.reasoning]
    carry = [ex for ex in tasks.heldout("arith", 200, fmt="thinking") if "+1=" in ex.reasoning]
    assert borrow and carry  # both kinds of column occur
    with pytest.raises(UserError, match=r"field 'thinking_share' must be in \[0, 1\], got 1.5"):
        from mbd_jax.config import from_dict
        from_dict(TrainConfig, {"name": "t", "model": "m", "thinking_share": 1.5}, where="t.yaml")


def test_format_weights_choose_the_formats_a_config_trains_on():
    """A config's format_weights replace FORMAT_WEIGHTS (a format left out never comes); the
    trainer's stream follows the config; bad weights are refused naming the field."""
    from mbd_jax.config import from_dict
    from mbd_jax.train import trainer
    tcfg = from_dict(TrainConfig, {"name": "t", "model": "m", "tasks": list(tasks.TASKS),
                                   "thinking_share": 0.2,
                                   "format_weights": {"chat": 1, "raw": 3.0}}, where="t.yaml")
    seen = collections.Counter(ex.format for ex, _ in
                               zip(trainer.example_stream(tcfg, seed=5), range(1500)))
    assert set(seen) == {"chat", "raw", "thinking"}, seen
    assert abs(seen["raw"] / 1500 - 0.8 * 0.75) < 0.04, seen
    assert abs(seen["thinking"] / 1500 - 0.2) < 0.04, seen
    for bad in ({"chat": 1, "thinking": 1}, {"chat": 0}, {"raw": -1, "chat": 2}, {"chat": "x"}):
        with pytest.raises(UserError, match="field 'format_weights' must"):
            from_dict(TrainConfig, {"name": "t", "model": "m", "format_weights": bad},
                      where="t.yaml")


def test_answers_match_an_independent_solver_in_every_format():
    stream = tasks.examples(ANY_FORMAT, seed=3)
    seen = collections.Counter()
    for ex, _ in zip(stream, range(1500)):
        seen[ex.format] += 1
        ts = turns(ex)
        assert ts[-1][0] == "user" and solve(ts[-1][1]) == ex.answer, ex
        if ex.format == "raw":
            assert "<|" not in ex.prompt
        if ex.format == "system":
            assert [r for r, _ in ts] == ["system", "user"] and ts[0][1] in tasks.SYSTEM_PROMPTS
        if ex.format == "multiturn":  # an earlier, correctly answered question first
            roles = [r for r, _ in ts]
            assert roles in (["user", "assistant", "user"], ["system", "user", "assistant", "user"])
            assert solve(ts[-3][1]) == ts[-2][1], ex
        if ex.format == "chat":
            assert [r for r, _ in ts] == ["user"]
    for fmt, w in tasks.FORMAT_WEIGHTS.items():  # the training mix follows the weights
        assert abs(seen[fmt] / 1500 - w) < 0.04, (fmt, seen)


def test_heldout_questions_never_reach_training_and_eval_uses_only_them():
    for ex, _ in zip(tasks.examples(list(tasks.EVAL_TASKS), seed=5), range(3000)):
        for role, text in turns(ex):
            if role == "user":
                assert not tasks.is_heldout(text), ex
    for name in tasks.EVAL_TASKS:
        for fmt in ("chat",) if name in tasks.CHAT_ONLY_TASKS else tasks.FORMATS:
            exs = tasks.heldout(name, 20, fmt=fmt)
            assert len({e.prompt for e in exs}) == 20
            assert all(e.format == fmt and tasks.is_heldout(turns(e)[-1][1]) for e in exs)
    with pytest.raises(UserError, match="format: must be one of chat, system, multiturn, raw"):
        next(tasks.examples(["sort"], 0, fmt="json"))


def test_the_tool_task_offers_its_tool_in_a_chat_and_answers_with_the_call():
    """toolsort: the template's tools line, the question, and the call (written here by hand,
    not by tool_calls.render_call) that parses back into the question's numbers."""
    from mbd_jax import tool_calls
    for ex in tasks.heldout("toolsort", 20):
        ts = turns(ex)
        assert ts[0] == ("system", "Tools: sort_numbers(numbers)") and ts[1][0] == "user"
        digits = re.fullmatch(r"Sort: ([\d ]+)", ts[1][1])[1].split()
        assert ex.answer == ('<tool_call>{"name": "sort_numbers", "arguments": {"numbers": ['
                             + ", ".join(digits) + "]}}</tool_call>")
        content, (call,) = tool_calls.parse(ex.answer, [tasks.SORT_TOOL])
        assert content is None and json.loads(call.arguments) == {"numbers": list(map(int, digits))}
    with pytest.raises(UserError, match="offers a tool"):
        tasks.heldout("toolsort", 2, fmt="raw")


def test_long_answers_span_several_blocks():
    tok = load_model("tiny-moe", with_weights=False).tokenizer
    blocks = [len(tok.encode(ex.answer)) // 8 + 1
              for ex, _ in zip(tasks.examples(["sort", "reverse", "sortrev"], 0), range(300))]
    assert max(blocks) >= 3 and np.mean([b >= 2 for b in blocks]) > 0.4
    # the long tasks: every answer (and its EOS) spans 2-6 blocks, longsort's 3-6
    for name, lo, hi in (("longsort", 3, 6), ("longreverse", 2, 4), ("longarith", 4, 5),
                         ("longsortrev", 3, 6)):
        spans = [(len(tok.encode(ex.answer)) + 1 + 7) // 8
                 for ex, _ in zip(tasks.examples([name], 0), range(200))]
        assert min(spans) == lo and max(spans) == hi, (name, collections.Counter(spans))


def test_length_buckets_hold_exactly_the_examples_that_need_them():
    model = load_model("tiny-moe", with_weights=False)
    cfg, tok = model.cfg, model.tokenizer
    eos = cfg.eos_token_ids[0]
    t = TrainConfig(name="t", model="tiny-moe", tasks=tuple(tasks.TASKS), batch_size=8,
                    seq_len=96, length_buckets=(32, 64))
    shares = length_shares(t, cfg, tok)
    assert shares.shape == (3,) and shares.sum() == pytest.approx(1) and (shares > 0.05).all()
    # the shares are the examples' own: count them independently on another sample
    need = [len(encode(tok, ex, eos)[0]) for ex, _ in zip(tasks.examples(t.tasks, 11), range(800))]
    need = np.array([n for n in need if n <= 96])
    independent = [np.mean(need <= 32), np.mean((need > 32) & (need <= 64)), np.mean(need > 64)]
    np.testing.assert_allclose(shares, independent, atol=0.05)
    lengths = collections.Counter()
    for step in range(60):
        b = batch_for_step(t, cfg, tok, step, shares)
        L = b.clean.shape[1]
        lengths[L] += 1
        lo = {32: 0, 64: 32, 96: 64}[L]
        ends = [int(np.argmax(row == eos)) + 1 for row in b.clean]  # tokens up to the first EOS
        assert all(lo < e <= L for e in ends), (L, ends)
        again = batch_for_step(t, cfg, tok, step, shares)
        np.testing.assert_array_equal(again.noisy, b.noisy)  # still a function of (seed, step)
    assert set(lengths) == {32, 64, 96} and lengths[32] > lengths[96]
    odd = TrainConfig(name="t", model="tiny-moe", seq_len=96, length_buckets=(36,))
    with pytest.raises(UserError, match=r"length_buckets \[36\]: \[36\] not a multiple of the "
                                        r"model's block_size \(8\)"):
        from mbd_jax.model.transformer import init_params
        from mbd_jax.train.trainer import Trainer
        Trainer(odd, cfg, init_params(cfg), tok)
    with pytest.raises(UserError, match="length_buckets"):
        from mbd_jax.config import from_dict
        from_dict(TrainConfig, {"name": "t", "model": "m", "seq_len": 64,
                                "length_buckets": [64]}, where="t.yaml")


def test_raw_answer_prefix_marks_raw_replies_only_and_eval_reads_past_it():
    """With raw_answer_prefix a raw reply is `Answer: <answer>` (the mark of where a raw answer
    begins), every other format's reply is unchanged, the stream draws the same questions and
    formats as without it, and is_correct reads the answer after the mark (with or without it)
    and nothing else."""
    from mbd_jax.config import from_dict
    from mbd_jax.train import trainer
    names = list(tasks.TASKS)
    plain = list(zip(tasks.examples(names, seed=6, thinking_share=0.2), range(600)))
    marked = list(zip(tasks.examples(names, seed=6, thinking_share=0.2, raw_answer_prefix=True),
                      range(600)))
    assert sum(ex.format == "raw" for ex, _ in plain) > 30
    for (a, _), (b, _) in zip(plain, marked):
        assert (a.task, a.prompt, a.answer, a.format) == (b.task, b.prompt, b.answer, b.format)
        if b.format == "raw":
            assert b.reply == f"{tasks.RAW_ANSWER_PREFIX} {b.answer}" and a.reply == a.answer
            assert b.is_correct(b.reply) and b.is_correct(b.answer) and a.is_correct(b.reply)
            assert not b.is_correct(f"{tasks.RAW_ANSWER_PREFIX} {b.answer} x")
            assert not b.is_correct(f"{b.answer} {tasks.RAW_ANSWER_PREFIX}")
        else:
            assert b.reply == a.reply and not b.prefix
            assert not b.is_correct(f"{tasks.RAW_ANSWER_PREFIX} {b.answer}")  # raw only
    tcfg = from_dict(TrainConfig, {"name": "t", "model": "m", "tasks": names,
                                   "format_weights": {"raw": 1}, "raw_answer_prefix": True},
                     where="t.yaml")
    for ex, _ in zip(trainer.example_stream(tcfg, seed=7), range(20)):
        assert ex.reply.startswith(tasks.RAW_ANSWER_PREFIX + " "), ex
    with pytest.raises(UserError, match="raw_answer_prefix"):
        from_dict(TrainConfig, {"name": "t", "model": "m", "raw_answer_prefix": "yes"},
                  where="t.yaml")


def test_the_two_key_recall_drill_trains_only_and_holds_out_what_recall_holds_out():
    """recall2 asks exactly two keys (in list order and not), its answers match the solver, its
    training stream has no held-out question (its questions in list order are recall's own kind,
    held out by the same hash of the text), and it is a training task only: eval refuses it."""
    from mbd_jax.config import from_dict
    from mbd_jax.evaluate import task_names
    orders = collections.Counter()
    for ex, _ in zip(tasks.examples(["recall2"], seed=7), range(600)):
        question = turns(ex)[-1][1]
        assert solve(question) == ex.answer and not tasks.is_heldout(question), ex
        asked, pairs = re.fullmatch(r"Recall ([a-z ]+) in: (.+)", question).groups()
        keys = [p.split("=")[0] for p in pairs.split()]
        assert len(asked.split()) == 2 and 3 <= len(keys) <= 6, ex
        where = [keys.index(k) for k in asked.split()]
        orders[where == sorted(where)] += 1
    assert 390 < orders[True] < 510 and orders[False] > 90, orders  # in list order 3 times in 4
    assert "recall2" not in tasks.TASKS and "recall2" in tasks.TRAIN_TASKS
    with pytest.raises(UserError, match="unknown task.*recall2"):
        task_names("recall2", 10)
    from_dict(TrainConfig, {"name": "t", "model": "m", "tasks": ["recall2", "sort"]},
              where="t.yaml").validate()


def test_trial_tasks_are_evaluated_by_name_only():
    """The trial tasks (long answers: worked three-digit sums, long sort-and-reverse) train and
    evaluate when named, but `all` (the suite, Table 1, the shipped models' floors) is TASKS."""
    from mbd_jax.evaluate import task_names
    assert set(tasks.TRIAL_TASKS) == {"longarith", "longsortrev"}
    assert not set(tasks.TRIAL_TASKS) & set(tasks.TASKS)
    assert task_names("all", 5) == list(tasks.TASKS)
    assert task_names("longarith,sort", 5) == ["longarith", "sort"]
    with pytest.raises(UserError, match="unknown task.*longsum.*allowed: .*longsortrev"):
        task_names("longsum", 5)
    sums = tasks.heldout("longarith", 200)
    assert all(solve(turns(ex)[-1][1]) == ex.answer for ex in sums)
    assert {ex.answer.split()[-1][3] for ex in sums} == {"+", "-"}
    # the borrowing drill: longarith's subtractions only, trained, never evaluated
    for ex, _ in zip(tasks.examples(["longsub"], seed=2), range(300)):
        question = turns(ex)[-1][1]
        assert "-" in question and solve(question) == ex.answer and not tasks.is_heldout(question)
    with pytest.raises(UserError, match="unknown task.*longsub"):
        task_names("longsub", 5)
