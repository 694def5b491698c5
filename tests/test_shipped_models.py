"""The trained models shipped in models/: they load (checksums verified), tiny-mbd is the default,
SingleBD reaches a floor on every task's held-out prompts, MBD keeps that accuracy at a higher
TPF, every way a question reaches the service works (chat, a system line, a second turn, raw
text; and through a real `mbd-jax serve`: completions, /generate, a streamed chat), the edit
mode keeps the answers, tiny-bd's thinking switch writes a worked trace, and the README's demos
answer what the README shows.

The floors come from the same fixed samples measured on the shipped pair (20 prompts per task,
8 per task for the other formats), rounded down with margin, except SingleBD's per-task floor:
the 95% on every task (measured 100 on each but recall and longsort, 95 on those two).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from mbd_jax import chat
from mbd_jax.checkpoint import load_model
from mbd_jax.cli import DEFAULT_MODEL
from mbd_jax.config import ServeConfig, Structure, load_serve_config
from mbd_jax.engine import Engine
from mbd_jax.evaluate import evaluate, evaluate_tasks, pool, table1_decode
from mbd_jax.train import tasks

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 20  # held-out prompts per task in the chat format (140 in all)
FORMAT_LIMIT = 8  # per task, for each other format
ACCURACY_FLOOR = 0.95  # SingleBD (tiny-bd, N_buf 1) on every task
# the default model (MBD), pooled over the tasks; measured at 20 per task (docs/training.md, the
# pair in every format): system 97.1, multiturn 78.6 (the long lists after an earlier turn), raw
# 88.6 (27 before raw replies were marked `Answer:`), thinking 92.1
FORMAT_FLOORS = {"system": 0.85, "multiturn": 0.7, "raw": 0.8, "thinking": 0.85}
TPF_GAIN_FLOOR = 1.45  # MBD (tiny-mbd, N_buf 2) over SingleBD, pooled (measured 1.67)
# MBD with eager block activation (every slot active at once), N_buf 2, over SingleBD: the 2x
# goal (measured 2.09x, 139 against 138 of 140; N_buf 3 in Table 1: 2.79x)
EAGER_GAIN_FLOOR = 2.0
EDIT_FLOOR = 0.85  # MBD in the edit sampling mode, pooled (N_buf 3 in Table 1: 99.3)
# tiny-bd (SingleBD) with the thinking switch on, pooled; measured 97.9 (20 per task)
THINKING_FLOOR = 0.85


@pytest.fixture(scope="module")
def engines():
    """{"single": tiny-bd with SingleBD, "mbd": tiny-mbd with N_buf 2}: (model, engine)."""
    out = {}
    for key, name, n_buf in (("single", "tiny-bd", 1), ("mbd", "tiny-mbd", 2)):
        model = load_model(name)
        out[key] = model, Engine(model.cfg, model.params, batch_size=16, buffer_size=n_buf,
                                 tokenizer=model.tokenizer)
    return out


def answer(engines, messages: list[dict] | str, thinking: bool = False) -> str:
    """The default model's reply to a chat (messages) or to raw text, with the service's default
    decoding (configs/serve.yaml)."""
    model, engine = engines["mbd"]
    template = chat.for_model(model.path.parent, model.cfg.chat_template)
    text = messages if isinstance(messages, str) else template.render(messages, thinking=thinking)
    decode = load_serve_config(ROOT / "configs" / "serve.yaml").decoding
    (r,) = engine.generate([model.tokenizer.encode(text)],
                           dataclasses.replace(decode, max_new_tokens=48))
    return r.text.strip()


def test_tiny_mbd_is_the_default_everywhere(engines):
    model, _ = engines["mbd"]
    assert DEFAULT_MODEL == "tiny-mbd" and ServeConfig().model == "tiny-mbd"
    assert model.path == ROOT / "models" / "tiny-mbd" / "config.yaml"
    manifest = json.loads((ROOT / "models" / "tiny-mbd" / "manifest.json").read_text())
    assert manifest["train_config"]["objective"] == "multitf"
    # stage 12 (the structured tasks) on stage 11 (MultiTF on tiny-bd): docs/training.md
    assert manifest["train_config"]["model"] == "runs/tiny-mbd-model"
    assert {"jsonsort", "toolsort"} <= set(manifest["train_config"]["tasks"])
    assert model.cfg.block_size >= 8  # answers span several blocks: MultiBD has room
    sizes = sum(p.stat().st_size for d in ("tiny-bd", "tiny-mbd")
                for p in (ROOT / "models" / d).rglob("*") if p.is_file())
    assert sizes < 40 * 2**20


def test_every_task_single_bd_floor_and_mbd_keeps_it_at_a_higher_tpf(engines):
    reports = {}
    for key, n_buf in (("single", 1), ("mbd", 2)):
        model, engine = engines[key]
        reports[key] = evaluate_tasks(model, table1_decode(n_buf), engine, limit=LIMIT)
    assert [r.task for r in reports["single"]] == list(tasks.TASKS)
    for r in reports["single"]:
        assert r.accuracy >= ACCURACY_FLOOR, (r.task, r.accuracy, r.wrong)

    single, mbd = pool(reports["single"]), pool(reports["mbd"])
    # not below SingleBD, but for a prompt or two: measured 139 against 138 of 140 (137 against
    # 137 and 137 against 138 in the pairs before)
    assert mbd["correct"] >= single["correct"] - 2, [(r.task, r.accuracy) for r in reports["mbd"]]
    assert mbd["tpf"] >= TPF_GAIN_FLOOR * single["tpf"], (single["tpf"], mbd["tpf"])
    # Every block of the buffer decoded from the first forward: what MultiTF trained the model for
    model, engine = engines["mbd"]
    eager = pool(evaluate_tasks(model, table1_decode(2, block_activation="eager"), engine,
                                limit=LIMIT))
    assert eager["correct"] >= single["correct"], eager
    assert eager["tpf"] >= EAGER_GAIN_FLOOR * single["tpf"], (single["tpf"], eager["tpf"])
    # TPF counts the output up to and including EOS (the paper's), not tokens unmasked past it
    prompt = model.tokenizer.encode(tasks.heldout("sort", 1, 0)[0].prompt)
    (r,) = engine.generate([prompt], table1_decode(2))
    assert r.eos and r.finish_reason == "stop" and r.output_tokens == len(r.token_ids) + 1
    assert r.tpf == r.output_tokens / r.nfe and r.tokens_unmasked >= r.output_tokens


def test_the_default_model_answers_as_json_and_calls_its_tool(engines):
    """The structured tasks on the default model: under the task's JSON Schema every reply is
    valid and most are right (tools/bench_structured.py measured 31 of 40 at N_buf 1); under the
    forced call's grammar every reply is a call of the offered tool (its arguments are often
    wrong: docs/performance.md)."""
    from mbd_jax import tool_calls
    from mbd_jax.serving.tool_use import ToolUse
    model, engine = engines["mbd"]
    for task, structure, floor in (
            ("jsonsort", Structure.json_schema(tasks.JSONSORT_SCHEMA), 0.6),
            ("toolsort", ToolUse((tasks.SORT_TOOL,), "required", False).structure(), 0.0)):
        examples = tasks.heldout(task, LIMIT)
        results = engine.generate([model.tokenizer.encode(ex.prompt) for ex in examples],
                                  table1_decode(2, max_new_tokens=120, structure=structure))
        for r in results:
            assert r.finish_reason == "stop", (task, r.text)
            if task == "jsonsort":
                assert set(json.loads(r.text)) == {"sorted"}, r.text
            else:
                assert tool_calls.parse(r.text, [tasks.SORT_TOOL])[1], r.text
        correct = sum(ex.is_correct(r.text) for ex, r in zip(examples, results))
        assert correct >= floor * len(examples), (task, correct)


@pytest.mark.parametrize("fmt", sorted(FORMAT_FLOORS))
def test_every_way_a_question_arrives(engines, fmt):
    """A system line first, an earlier answered turn first, raw text with no template (what
    /v1/completions and /generate send), or the thinking switch on: the default model answers
    held-out questions."""
    model, engine = engines["mbd"]
    r = evaluate(model, "all", table1_decode(2), limit=FORMAT_LIMIT, engine=engine, fmt=fmt)
    assert sorted(FORMAT_FLOORS) == sorted(set(tasks.FORMATS) - {"chat"})
    assert r.accuracy >= FORMAT_FLOORS[fmt], (fmt, r.accuracy, r.wrong)


def test_a_chat_with_a_system_prompt_and_a_second_turn(engines):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Sort: 8 3 5"},
                {"role": "assistant", "content": "3 5 8"},
                {"role": "user", "content": "Reverse: p k z w"}]
    assert answer(engines, messages) == "w z k p"
    # after an earlier turn its sums slipped more often (47+38 -> 95 for an earlier pair)
    messages[-1]["content"] = "What is 93-27?"
    assert answer(engines, messages) == "93-27=66"
    messages[-1]["content"] = "Recall k in: a=1 k=7 z=2"
    assert answer(engines, messages) == "k=7"


def test_edit_mode_keeps_the_answers(engines):
    """The edit sampling mode (rewrite a filled token the model is confident is wrong) on the
    default model, which was trained token to token for it (TrainConfig.edit_share): the
    accuracy stays near the plain mode's (it fell to 6% on models trained on masked positions
    only), whichever blocks wait for a confirming forward; confirming only the blocks written
    ahead of an unfinished one (edit_confirm "context") spends fewer forwards on the same
    answers (3219 against 4147 on the nine-task trial's 900 prompts)."""
    model, engine = engines["mbd"]
    always = evaluate(model, "all", table1_decode(2, sampling_mode="edit"), limit=FORMAT_LIMIT,
                      engine=engine)
    context = evaluate(model, "all", table1_decode(2, sampling_mode="edit", edit_confirm="context"),
                       limit=FORMAT_LIMIT, engine=engine)
    for r in (always, context):
        assert r.accuracy >= EDIT_FLOOR, (r.accuracy, r.wrong)
    assert context.nfe < always.nfe and context.tokens == always.tokens, (context, always)


def test_tiny_bd_thinks_before_it_answers(engines):
    """With the thinking switch on, tiny-bd writes the trace it was trained on (sortrev: the
    sorted list, then the answer) and answers held-out questions after it (96% of this sample,
    98% without the switch on the chat sample)."""
    model, engine = engines["single"]
    r = evaluate(model, "all", table1_decode(1), limit=FORMAT_LIMIT, engine=engine, fmt="thinking")
    assert r.accuracy >= THINKING_FLOOR, (r.accuracy, r.wrong)
    ex = tasks.heldout("sortrev", 1, fmt="thinking")[0]
    assert ex.prompt.endswith("<think>")
    (out,) = engine.generate([model.tokenizer.encode(ex.prompt)], table1_decode(1))
    reasoning, reply = (part.strip() for part in chat.split_reasoning(out.text))
    assert reasoning == ex.reasoning and reply, (ex, out.text)  # the answer: the floor above


def test_generate_thinking_from_the_command_line():
    """`generate --chat --thinking`: the reply is a worked trace, </think>, the answer; --thinking
    without --chat is refused before anything loads."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "mbd_jax", "generate", "--model", "tiny-bd", "--prompt",
           "Sort and reverse: 7 2 9 4", "--max-new-tokens", "32", "--json"]
    r = subprocess.run(cmd + ["--chat", "--thinking"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    reasoning, reply = chat.split_reasoning(json.loads(r.stdout.splitlines()[-1])["text"])
    assert (reasoning.strip(), reply.strip()) == ("2 4 7 9", "9 7 4 2")
    r = subprocess.run(cmd + ["--thinking"], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=300)
    assert r.returncode == 2 and "--thinking switches the chat template's thinking section on: " \
        "add --chat" in r.stderr


def test_ignore_eos_decodes_every_new_token(engines):
    """`ignore_eos` (benchmarks: fixed work per row) runs past the answer's EOS to the limit; what
    comes before is the ordinary answer and its EOS (later blocks never change earlier ones)."""
    model, engine = engines["mbd"]
    prompt = model.tokenizer.encode(tasks.heldout("sort", 1, 0)[0].prompt)
    (short,) = engine.generate([prompt], table1_decode(2))
    (full,) = engine.generate([prompt], dataclasses.replace(table1_decode(2), ignore_eos=True,
                                                            max_new_tokens=40))
    assert short.eos and not full.eos and full.finish_reason == "length"
    assert len(full.token_ids) == 40
    n = len(short.token_ids)
    assert full.token_ids[:n + 1] == short.token_ids + [model.cfg.eos_token_ids[0]]


def readme_demos() -> list[tuple[str, str, str]]:
    """(how, prompt, answer) rows of the README's demo table."""
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- demos -->")[1].split("<!-- /demos -->")[0]
    rows = re.findall(r"^\| (chat|think|raw) \| `([^`]+)` \| `([^`]+)` \|$", table, re.M)
    assert len(rows) >= 5, table
    return rows


def test_readme_demos_answer_as_shown(engines):
    """Each demo row with the service's default decoding (configs/serve.yaml); the prompts of the
    README's curl, openai and `make generate` examples are demo rows."""
    demos = readme_demos()
    for how, prompt, want in demos:
        if how == "raw":
            got = answer(engines, prompt)
        else:
            got = answer(engines, [{"role": "user", "content": prompt}], thinking=how == "think")
            if how == "think":  # the answer after the worked trace
                reasoning, got = (part.strip() for part in chat.split_reasoning(got))
                assert reasoning, (prompt, got)
        assert got == want, (how, prompt, got)
    readme = (ROOT / "README.md").read_text()
    chats = {p: a for how, p, a in demos if how == "chat"}
    curl = re.search(r'"content": "([^"]+)"\}\], "max_tokens".*?\n# -> "content": "([^"]+)"',
                     readme, re.S)
    assert curl and chats.get(curl.group(1)) == curl.group(2)
    assert re.search(r'messages=\[\{"role": "user", "content": "([^"]+)"\}\]', readme).group(1) in chats
    make_prompt = re.search(r"^PROMPT \?= (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert make_prompt in chats
    assert re.search(r'make generate PROMPT="([^"]+)"', readme).group(1) in chats


def test_eval_command(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "eval", "--task", "sort", "--limit", "8",
                        "--buffer-size", "2", "--format", "raw", "--json", "--no-progress"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["model"] == "tiny-mbd" and out["task"] == "sort" and out["n"] == 8
    assert out["buffer_size"] == 2 and out["format"] == "raw" and 0.0 <= out["accuracy"] <= 1.0
    assert out["tpf"] == pytest.approx(out["tokens"] / out["nfe"])  # eval's tokens: with EOS
    assert out["tokens_per_s"] > 0


def test_every_service_path_answers_on_the_default_model(tmp_path):
    """`mbd-jax serve` on the shipped default model with configs/serve.yaml's decoding, over real
    HTTP with the official openai client: raw text through /v1/completions and /generate (the
    model writes `Answer:` first), a streamed chat with a system line and an earlier turn, and
    the README's curl and openai examples as written."""
    import httpx
    import openai

    from tests.live_server import KEY, Server

    shipped = load_serve_config(ROOT / "configs" / "serve.yaml").decoding
    decoding = {k: v for k, v in dataclasses.asdict(shipped).items() if v is not None}
    # no API keys: open, as `make run` serves (the clients' key is ignored)
    srv = Server(tmp_path, [], sections={"model": "tiny-mbd", "decoding": decoding})
    try:
        c = srv.openai_client()
        r = c.completions.create(model="tiny-mbd", max_tokens=48,
                                 prompt=["Sort: 9 1 8 2 7 3 6 4 5 0 9 1", "Reverse: k d a q"])
        assert [ch.text.strip() for ch in sorted(r.choices, key=lambda ch: ch.index)] == [
            "Answer: 0 1 1 2 3 4 5 6 7 8 9 9", "Answer: q a d k"]
        r = httpx.post(srv.url + "/generate", headers={"Authorization": f"Bearer {KEY}"},
                       json={"segments": ["Sort and reverse: 7 2 9 4", "Recall k in: a=1 k=7 z=2"],
                             "max_new_tokens": 48}, timeout=120)
        assert r.status_code == 200, r.text
        assert [t.strip() for t in r.json()["output"]] == ["Answer: 9 7 4 2", "Answer: k=7"]
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Sort: 8 3 5"},
                    {"role": "assistant", "content": "3 5 8"},
                    {"role": "user", "content": "Reverse: p k z w"}]
        stream = c.chat.completions.create(model="tiny-mbd", messages=messages, max_tokens=48,
                                           stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream
                       if ch.choices).strip() == "w z k p"
        # The trial pair's most accurate MBD row, and eager activation, asked for per request; a
        # wrong value is a 400 that names the field and what it may be.
        edit = {"sampling_mode": "edit", "edit_confirm": "context", "policy": "factor",
                "factor": 2.0}
        for decoding in (edit, {"block_activation": "eager"}):
            r = c.chat.completions.create(model="tiny-mbd", max_tokens=48,
                                          extra_body={"decoding": decoding},
                                          messages=[{"role": "user", "content": "What is 47+38?"}])
            assert r.choices[0].message.content.strip() == "47+38=85", decoding
        with pytest.raises(openai.BadRequestError, match="edit_confirm.*'always', 'context'"):
            c.chat.completions.create(model="tiny-mbd", max_tokens=48,
                                      extra_body={"decoding": {**edit, "edit_confirm": "later"}},
                                      messages=[{"role": "user", "content": "What is 47+38?"}])
        readme_examples_run_as_shown(srv.url)
    finally:
        srv.stop()


def readme_examples_run_as_shown(url: str) -> None:
    """The README's first two examples, as written, against a live open service (its port put
    in): the curl request's body gets the answer the README shows after it, and the openai
    snippet prints its demo row's answer."""
    import contextlib
    import io

    import httpx

    readme = (ROOT / "README.md").read_text()
    curl = re.search(r"```bash\n(curl -s localhost:8000(\S+) .*?)\n# -> (.+?)\n```", readme, re.S)
    body = json.loads(re.search(r"-d '(.*)'", curl.group(1), re.S).group(1))
    r = httpx.post(url + curl.group(2), json=body, timeout=120)  # no key: the service is open
    assert r.status_code == 200, r.text
    assert f'"content": "{r.json()["choices"][0]["message"]["content"].strip()}"' == curl.group(3)
    snippet = re.search(r"```python\n(from openai import OpenAI\n.*?)```", readme, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet.replace("http://127.0.0.1:8000", url), {})  # noqa: S102 - the README's code
    prompt = re.search(r'"content": "([^"]+)"\}\]', snippet).group(1)
    chats = {p: a for how, p, a in readme_demos() if how == "chat"}
    assert out.getvalue().strip() == chats[prompt], (prompt, out.getvalue())
    # structured output and tool calls (openai and LangChain): each print shows its `# ->` line
    snippet = re.search(r"```python\n(from pydantic import BaseModel\n.*?)```", readme,
                        re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet.replace("http://127.0.0.1:8000", url), {})  # noqa: S102 - the README's code
    shown = re.findall(r"# -> (.*)$", snippet, re.M)
    assert out.getvalue().strip().splitlines() == shown, out.getvalue()
