"""`mbd-jax eval --dataset`: the user's JSONL examples, each scorer, and a malformed line named by
its number before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mbd_jax import eval_data
from mbd_jax.checkpoint import load_model
from mbd_jax.config import DecodeConfig
from mbd_jax.errors import UserError
from mbd_jax.evaluate import evaluate, evaluate_dataset

from tests.live_server import ROOT


def write(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def scorers_test_module(tmp_path) -> str:
    (tmp_path / "my_scorer.py").write_text(
        "def digits_reversed(reply, answer):\n    return reply.replace(' ', '')[::-1] == "
        "answer.replace(' ', '')\n")
    return "my_scorer:digits_reversed"


@pytest.mark.parametrize("name,reply,answer,want", [
    ("exact", " 2 4 7 9 ", "2 4 7 9", True),
    ("exact", "2 4 7", "2 4 7 9", False),
    ("regex", "Answer: 42.", r"\b42\b", True),
    ("regex", "Answer: 421", r"\b42\b", False),
    ("number", "so 47+38=85", "85", True),
    ("number", "1,250 apples", "1250.0", True),
    ("number", "85 or 86", "85", False),
    ("number", "no digits", "85", False),
])
def test_scorers(name, reply, answer, want):
    assert eval_data.scorer(name)(reply, answer) is want


def test_a_python_entry_point_scores(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    judge = eval_data.scorer(scorers_test_module(tmp_path))
    assert judge("9 7 4 2", "2 4 7 9") and not judge("2 4 7 9", "2 4 7 9")
    for bad, named in (("nope", "expected one of exact"), ("no_such_module:f", "cannot load"),
                       ("json:no_such_function", "cannot load")):
        with pytest.raises(UserError, match=named):
            eval_data.scorer(bad)


@pytest.mark.parametrize("line,named", [
    ('{"prompt": "x"', "line 2: not JSON"),
    ('["x"]', "line 2: expected a JSON object"),
    ('{"prompt": "x", "answer": "y", "extra": 1}', "line 2: unknown field 'extra'"),
    ('{"answer": "y"}', "line 2: give exactly one of 'prompt'"),
    ('{"prompt": "x", "messages": [], "answer": "y"}', "line 2: give exactly one of 'prompt'"),
    ('{"prompt": "", "answer": "y"}', "line 2: field 'prompt' must be a non-empty string"),
    ('{"messages": [{"role": "robot", "content": "x"}], "answer": "y"}', "line 2: field 'messages'"),
    ('{"prompt": "x", "answer": null}', "line 2: field 'answer' must be a string or a number"),
])
def test_a_malformed_line_is_named_by_its_number(tmp_path, line, named):
    path = write(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, line])
    with pytest.raises(UserError, match=named):
        eval_data.load(path)


def test_a_dataset_of_the_built_in_questions_scores_as_the_built_in_split(tmp_path):
    """The first 8 held-out sort questions written as a dataset (their chat messages, their
    answers) score exactly as `evaluate` scores the split: same accuracy, tokens and forwards;
    the number scorer on raw arithmetic prompts, and a regex, judge the same replies."""
    from mbd_jax.train import tasks

    model = load_model("tiny-mbd")
    decode = DecodeConfig(buffer_size=2, max_new_tokens=48)
    split = evaluate(model, "sort", decode, limit=8, batch_size=8)
    raw = tasks.heldout("sort", 8, 1234, "raw")  # the same questions, bare
    rows = [{"messages": [{"role": "user", "content": ex.prompt}], "answer": ex.answer}
            for ex in raw]
    mine = evaluate_dataset(model, write(tmp_path / "sort.jsonl", rows), decode, batch_size=8)
    assert (mine.n, mine.correct, mine.tokens, mine.nfe) == (split.n, split.correct, split.tokens,
                                                            split.nfe)
    assert mine.correct >= 7 and mine.format == "dataset:exact"
    arith = [{"prompt": "What is 12+30?", "answer": 42}, {"prompt": "What is 23+19?", "answer": "42"}]
    # the raw replies are "Answer: 12+30=42" and "Answer: 23+19=42": right by their last number,
    # wrong by exact match, and a pattern finds 42 where 43 is not found
    numbers = evaluate_dataset(model, write(tmp_path / "arith.jsonl", arith), decode, "number")
    assert (numbers.n, numbers.correct) == (2, 2)
    exact = evaluate_dataset(model, write(tmp_path / "arith.jsonl", arith), decode, "exact")
    assert exact.correct == 0 and exact.wrong[0]["got"].strip() == "Answer: 12+30=42"
    regex = evaluate_dataset(model, write(tmp_path / "arith2.jsonl", [
        {"prompt": "What is 12+30?", "answer": r"=42\b"},
        {"prompt": "What is 12+30?", "answer": r"=43\b"}]), decode, "regex")
    assert (regex.n, regex.correct) == (2, 1)


def test_the_eval_command_reports_per_file(tmp_path):
    a = write(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "Sort: 3 1 2"}],
                                      "answer": "1 2 3"}])
    b = write(tmp_path / "b.jsonl", ['{"prompt": "Reverse: k d a q", "answer": "q a d k"}', ""])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "eval", "--dataset", a, "--dataset", b,
                        "--json", "--no-progress"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    reports = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["task"] for x in reports] == [a, b] and [x["n"] for x in reports] == [1, 1]
    assert reports[0]["correct"] == 1  # the demo answer
    bad = write(tmp_path / "bad.jsonl", ['{"prompt": "x", "answer": "y"}', '{"prompt": 3}'])
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "eval", "--dataset", bad],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2 and "line 2" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "eval", "--dataset", a, "--task", "sort"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2 and "not both" in r.stderr
