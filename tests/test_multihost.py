"""Multi-process launch on 127.0.0.1: two processes with 2 CPU devices each (gloo collectives)
and one mesh across both, for offline generation and for the HTTP service; plus the launch
flags' errors. Every process is bounded in time and killed at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

from mbd_jax.checkpoint import load_model
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from tests.conftest import XLA_TEST_FLAGS
from tests.live_server import KEY, ROOT, Server, free_port

TWO_DEVICES = {"XLA_FLAGS": f"{XLA_TEST_FLAGS} --xla_force_host_platform_device_count=2",
               "JAX_PLATFORMS": "cpu"}
# one row: a prompt longer than a block (a prefill chunk, then decoding), compiled once per process
PROMPTS = ["1,100,200,300,33,44,55,66,77"]


def launch_flags(port: int, pid: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def run_one(args: list[str]) -> str:
    """`args` in one process on one CPU device; its stdout."""
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def run_two(args: list[str]) -> list[str]:
    """`args` as processes 0 and 1 of a job (2 CPU devices each), bounded and killed at the end;
    their stdouts."""
    port = free_port()
    procs = [subprocess.Popen(args + launch_flags(port, i), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, **TWO_DEVICES)) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    return [out for out, _ in outs]


@pytest.fixture(scope="module")
def offline():
    """tiny-mbd's engine in this process, on one device: what the two-process runs must equal."""
    m = load_model("tiny-mbd")
    engine = Engine(m.cfg, m.params, batch_size=8, buffer_size=2, prefill_chunk=64,
                    tokenizer=m.tokenizer)
    return m, engine


# `make test-slow`: the engine's calls over a mesh spanning two processes are the service test's
# below (the same calls, mirrored by process 0), the SPMD launch of a one-shot command is the
# two-process training test's
@pytest.mark.slow
def test_two_processes_generate_what_one_does(offline):
    args = [sys.executable, "-m", "mbd_jax", "generate", "--model", "tiny-mbd", "--json",
            "--max-new-tokens", "24", "--buffer-size", "2", "--ignore-eos"]
    for p in PROMPTS:
        args += ["--prompt-ids", p]
    outs = run_two(args + ["--mesh", "expert=2,tensor=2"])
    want = [r.token_ids for r in offline[1].generate(
        [[int(t) for t in p.split(",")] for p in PROMPTS],
        DecodeConfig(buffer_size=2, max_new_tokens=24, ignore_eos=True))]
    assert [len(t) for t in want] == [24]
    assert [r["token_ids"] for r in json_lines(outs[0])] == want  # process 0 prints
    assert json_lines(outs[1]) == []  # the other does not


def test_two_process_service_answers_like_offline(tmp_path, offline):
    """Process 0 serves HTTP and sends every engine call to process 1; the completions equal
    offline generation on one device, and SIGTERM on process 0 stops both cleanly."""
    port = free_port()
    follower = None
    try:
        # The follower starts with default flags: process 0's serve config and --mesh are used
        # by both. It starts first, as process 0 waits for it to join before serving.
        follower_log = open(tmp_path / "follower.log", "w")
        follower = subprocess.Popen(
            [sys.executable, "-m", "mbd_jax", "serve", *launch_flags(port, 1)],
            cwd=ROOT, stdout=follower_log, stderr=subprocess.STDOUT,
            env=dict(os.environ, **TWO_DEVICES))
        sections = {"model": "tiny-mbd", "cache": {"enabled": False}}
        srv = Server(tmp_path, [KEY], sections=sections,
                     args=("--mesh", "expert=2,tensor=2", *launch_flags(port, 0)),
                     env=dict(TWO_DEVICES, MBD_HEARTBEAT_S="1"),
                     prefill_chunk=8)  # 2 prefill buckets to compile; a prompt may take 2 chunks
        try:
            m, engine = offline
            prompts = ["12+30=", "sort: 3 1 2", "reverse: a b c d"]
            want = engine.generate([m.tokenizer.encode(p) for p in prompts],
                                   DecodeConfig(buffer_size=2, max_new_tokens=20))
            with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
                for p, w in zip(prompts, want):
                    r = http.post(srv.url + "/v1/completions",
                                  json={"model": "tiny-mbd", "prompt": p, "max_tokens": 20})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == w.text
                    assert r.json()["usage"]["completion_tokens"] == len(w.token_ids)
            time.sleep(2.5)  # idle past two heartbeats; the service still answers after them
            r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "tiny-mbd", "prompt": prompts[0], "max_tokens": 20},
                           timeout=120)
            assert r.json()["choices"][0]["text"] == want[0].text
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.proc.wait(timeout=60) == 0
            assert follower.wait(timeout=60) == 0
        finally:
            srv.stop()
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait(timeout=30)


def test_heartbeat_setting_is_checked(monkeypatch):
    from mbd_jax.errors import UserError
    from mbd_jax.parallel.multihost import HEARTBEAT_S, heartbeat_seconds

    monkeypatch.delenv("MBD_HEARTBEAT_S", raising=False)
    assert heartbeat_seconds() == HEARTBEAT_S
    monkeypatch.setenv("MBD_HEARTBEAT_S", "2.5")
    assert heartbeat_seconds() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("MBD_HEARTBEAT_S", bad)
        with pytest.raises(UserError, match="MBD_HEARTBEAT_S=.*a number of seconds > 0"):
            heartbeat_seconds()


@pytest.mark.parametrize("flags,needle", [
    (["--process-id", "0"], "--process-id needs --coordinator and --num-processes"),
    (["--coordinator", "127.0.0.1:1"], "needs --num-processes, --process-id too"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "expected HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "must be in [0, --num-processes 2)"),
    (["--mesh", "tensor=3"], "needs 3 devices, 1 are present"),
])
def test_launch_flag_mistakes_exit_2_naming_them(flags, needle):
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "generate", "--prompt-ids", "1,2",
                        "--max-new-tokens", "4", *flags], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr[-1000:]
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_two_process_training_matches_one_process(tmp_path):
    """`mbd-jax train` over a (data 2, expert 2) mesh spanning two processes writes, shard by
    shard, the same model as one process trains on one device. The model is tiny-moe's routing
    and tokenizer at a fraction of its size (the sharded arithmetic at full size is
    test_train.py's 8-device test; this one is about the processes)."""
    preset = (ROOT / "configs" / "models" / "tiny-moe.yaml").read_text()
    small = tmp_path / "small-moe.yaml"
    small.write_text(preset.replace("hidden_size: 128", "hidden_size: 32")
                     .replace("num_layers: 4", "num_layers: 2")
                     .replace("intermediate_size: 384", "intermediate_size: 64")
                     .replace("moe_intermediate_size: 128", "moe_intermediate_size: 32")
                     .replace("head_dim: 32", "head_dim: 8")
                     .replace("../tokenizers/", str(ROOT / "configs" / "tokenizers") + "/"))

    def config(name: str) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"name: {name}\nmodel: {small}\noutput: {tmp_path / name}\nsteps: 3\n"
                        f"batch_size: 4\ncheckpoint_dir: {tmp_path / (name + '-ckpt')}\n"
                        "checkpoint_every: 2\n")
        return str(path)

    train = [sys.executable, "-m", "mbd_jax", "train", "--no-progress", "--config"]
    run_one(train + [config("one")])
    outs = run_two(train + [config("two"), "--mesh", "data=2,expert=2"])
    assert json_lines(outs[0]) == [{"model_dir": str(tmp_path / "two")}]
    a, b = load_model(str(tmp_path / "one")), load_model(str(tmp_path / "two"))
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert manifest["steps"] == 3
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=2e-5, rtol=1e-4)
    start = load_model(str(small)).params  # 3 steps moved them well past the tolerance
    assert max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(start), jax.tree.leaves(b.params))) > 1e-4


def test_a_call_not_mirrored_is_refused_on_the_leader(offline, monkeypatch):
    """The leader makes the MIRRORED calls (sending each first) and the READS; anything else is an
    AttributeError naming where to list it, never a silent call on process 0 alone. A follower
    replaying the sent calls substitutes its own decode state for the leader's."""
    from mbd_jax.engine import mirror
    from mbd_jax.parallel import multihost

    sent = []
    monkeypatch.setattr(multihost, "share", lambda obj: sent.append(obj) or obj)
    m, engine = offline
    leader = mirror.EngineLeader(engine)
    try:
        assert leader.cfg is engine.cfg and leader.stats().rows == 8  # reads: not sent
        with pytest.raises(AttributeError, match="not mirrored.*engine/mirror.py"):
            leader.generate
        with pytest.raises(AttributeError, match="not mirrored"):
            leader.admit  # changes the engine, but is not one of the service's calls
        state = leader.empty_state()
        state = leader.decode_call(state, 1)
        leader.release([0])
    finally:
        leader._closed = True  # stops the heartbeat thread; the engine stays open for others
    assert [c[0] for c in sent] == ["empty_state", "decode_call", "release"]
    assert sent[1][1] == [mirror._Local.STATE, 1]  # the follower's own state goes in its place

    # a follower replays them: each result replaces its own state where MIRRORED says so
    replay = iter([*sent, ("stop",)])
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *a, **k: calls.append((name, a)) or f"{name} result"

    monkeypatch.setattr(multihost, "share", lambda obj: next(replay))
    mirror.follow(Recorder())
    assert calls == [("empty_state", ()), ("decode_call", ("empty_state result", 1)),
                     ("release", ([0],)), ("close", ())]
