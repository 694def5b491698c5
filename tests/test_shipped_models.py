"""The trained models shipped in models/: they load (checksums verified), tiny-mbd is the default,
it reaches an accuracy floor on the held-out split, and MultiBD raises its tokens per forward.

The floors come from the measurement in docs/performance.md (Table 1), rounded down with margin.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mbd_jax.checkpoint import load_model
from mbd_jax.cli import DEFAULT_MODEL
from mbd_jax.config import ServeConfig, decode_config
from mbd_jax.engine import Engine
from mbd_jax.evaluate import evaluate
from mbd_jax.train import tasks

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 25  # held-out prompts per task (100 in all)
# tiny-mbd, SingleBD, accept threshold 0.95, on the tasks it was trained on: measured 0.68 on the
# task distribution it was trained on, 0.53 on today's (sort / reverse lists up to 10 long, recall
# of one or two keys), which the next shipped model (issue 18) trains on
ACCURACY_FLOOR = 0.45
TPF_GAIN_FLOOR = 1.35  # tiny-mbd: TPF(N_buf 2) / TPF(N_buf 1) (measured 1.52)


@pytest.fixture(scope="module")
def tiny_mbd():
    return load_model("tiny-mbd")


def test_tiny_mbd_is_the_default_everywhere(tiny_mbd):
    assert DEFAULT_MODEL == "tiny-mbd" and ServeConfig().model == "tiny-mbd"
    assert tiny_mbd.path == ROOT / "models" / "tiny-mbd" / "config.yaml"
    manifest = json.loads((ROOT / "models" / "tiny-mbd" / "manifest.json").read_text())
    assert manifest["train_config"]["objective"] == "multitf"
    assert manifest["train_config"]["model"] == "tiny-bd"
    sizes = sum(p.stat().st_size for d in ("tiny-bd", "tiny-mbd")
                for p in (ROOT / "models" / d).rglob("*") if p.is_file())
    assert sizes < 40 * 2**20


def test_tiny_mbd_accuracy_floor_and_multibd_gain(tiny_mbd):
    manifest = json.loads((ROOT / "models" / "tiny-mbd" / "manifest.json").read_text())
    trained = manifest["train_config"]["tasks"]  # the tasks it was trained on
    reports = {}
    for n_buf in (1, 2):
        engine = Engine(tiny_mbd.cfg, tiny_mbd.params, batch_size=16, buffer_size=n_buf,
                        tokenizer=tiny_mbd.tokenizer)
        decode = decode_config(buffer_size=n_buf, accept_threshold=0.95, add_block_threshold=0.1,
                               semi_complete_threshold=0.25, max_new_tokens=32)
        reports[n_buf] = evaluate(tiny_mbd, ",".join(trained), decode, limit=LIMIT, engine=engine)
        # TPF counts the output up to and including EOS (the paper's), not tokens unmasked
        # past it: a sort answer ends with EOS inside its last block
        prompt = tiny_mbd.tokenizer.encode(tasks.heldout("sort", 1, 0)[0].prompt)
        (r,) = engine.generate([prompt], decode)
        assert r.eos and r.finish_reason == "stop" and r.output_tokens == len(r.token_ids) + 1
        assert r.tpf == r.output_tokens / r.nfe and r.tokens_unmasked >= r.output_tokens
    single, multi = reports[1], reports[2]
    assert single.n == len(trained) * LIMIT
    assert single.accuracy >= ACCURACY_FLOOR, single.wrong
    assert multi.tpf >= TPF_GAIN_FLOOR * single.tpf, (single.tpf, multi.tpf)
    assert multi.accuracy >= single.accuracy - 0.05


def test_eval_command(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "eval", "--task", "sort", "--limit", "8",
                        "--buffer-size", "2", "--json", "--no-progress"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["model"] == "tiny-mbd" and out["task"] == "sort" and out["n"] == 8
    assert out["buffer_size"] == 2 and 0.0 <= out["accuracy"] <= 1.0
    assert out["tpf"] == pytest.approx(out["tokens"] / out["nfe"])  # eval's tokens: with EOS
    assert out["tokens_per_s"] > 0
