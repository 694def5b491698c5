"""The README's command blocks stay true to the code: every `mbd-jax` line parses with the CLI's
own parser (its subcommand, flags and choices), every tool it names exists and takes the flags
the line gives it, and the Python API example runs as written. (The curl and openai examples and
the demo answers run against a live service in test_shipped_models.py.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from mbd_jax import cli

from tests.live_server import ROOT

README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)


def command_lines() -> list[str]:
    """Each command of the README's bash blocks, comments and the venv activation left out."""
    lines = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip() if not line.lstrip().startswith("#") else ""
            if line and not line.startswith((". ", "cd ", "git ", "pip ", "make", "docker ",
                                             "curl ")):
                lines.append(line)
    return lines


def test_the_readme_shows_commands_of_each_kind():
    lines = command_lines()
    kinds = {shlex.split(line)[1] for line in lines if line.startswith("mbd-jax ")}
    assert {"generate", "eval", "train", "bench", "serve", "plan", "convert", "verify"} <= kinds
    assert any(line.startswith(("python tools/", "tools/")) for line in lines)


@pytest.mark.parametrize("line", [x for x in command_lines() if x.startswith("mbd-jax ")])
def test_every_mbd_jax_command_in_the_readme_parses(line):
    parser = cli.build_parser()
    try:
        args = parser.parse_args(shlex.split(line)[1:])
    except SystemExit as e:  # argparse's own message is on stderr, naming the flag
        pytest.fail(f"README command does not parse ({e.code}): {line}")
    assert callable(args.func)


@pytest.mark.parametrize("line", [x for x in command_lines()
                                  if x.startswith(("python tools/", "tools/"))])
def test_every_tool_in_the_readme_exists_and_takes_its_flags(line):
    words = shlex.split(line)
    script = words[1] if words[0] == "python" else words[0]
    assert (ROOT / script).is_file(), script
    if script.endswith(".sh"):
        assert os.access(ROOT / script, os.X_OK), script
        return
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert flag in r.stdout, f"{script} --help does not list {flag}"


def test_the_python_api_example_runs_as_written(tmp_path):
    (example,) = blocks("python")[-1:]
    assert "engine.generate" in example
    r = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    text, nfe, tpf, finish = r.stdout.strip().rsplit(" ", 3)
    assert text.strip() == "2 4 7 9" and finish == "stop"  # the demo table's sort answer
    assert int(nfe) > 0 and float(tpf) > 0
