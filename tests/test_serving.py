"""The HTTP service as clients see it: a real `mbd-jax serve` process on 127.0.0.1, the official
`openai` client and httpx; outputs compared with offline generation."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import typing

import httpx
import jsonschema
import openai
import pydantic
import pytest

from mbd_jax import chat
from mbd_jax.checkpoint import load_model
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine

from tests.live_server import KEY, ROOT, Server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # 64 concurrent requests queue for 8 rows: on a slow or shared host the last ones waited past
    # the default 30 s queue timeout (a 503 seen once); its own test covers that timeout
    srv = Server(tmp_path_factory.mktemp("serve"), [KEY, "other-key"], queue_timeout_ms=300_000)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline():
    """Offline generation with the server's model and decoding defaults."""
    m = load_model("tiny-test")
    engine = Engine(m.cfg, m.params, batch_size=8, buffer_size=2, prefill_chunk=64,
                    tokenizer=m.tokenizer)

    def run(prompts_ids, **decode):
        return engine.generate(prompts_ids, DecodeConfig(**{"buffer_size": 2, **decode}))

    run.tokenizer = m.tokenizer
    return run


def client(server, key=KEY) -> openai.OpenAI:
    return server.openai_client(key)


def test_openai_client_matches_offline_generate(server, offline):
    c = client(server)
    tok = offline.tokenizer
    prompt = "What is 12 + 30?"
    (want,) = offline([tok.encode(prompt)], max_new_tokens=20, temperature=0.7, seed=5)
    r = c.completions.create(model="tiny-test", prompt=prompt, max_tokens=20, temperature=0.7, seed=5)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-test", prompt=prompt, max_tokens=20, temperature=0.7, seed=5, stream=True)
        if ch.choices)
    assert streamed == want.text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: 3 1 2"}]
    (want,) = offline([tok.encode(chat.render(messages))], max_new_tokens=30)
    r = c.chat.completions.create(model="tiny-test", messages=messages, max_tokens=30)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(model="tiny-test", messages=messages, max_tokens=30,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) >= 2  # per block
    assert [m.id for m in c.models.list().data] == ["tiny-test"]


def test_unknown_models_are_404_and_the_model_card_is_served(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="hi", max_tokens=4)
    assert e.value.body["param"] == "model" and "tiny-test" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    card = c.models.retrieve("tiny-test")
    assert card.id == "tiny-test" and card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "hi", "max_tokens": 4}, timeout=60)  # no model: the served one
    assert r.status_code == 200 and r.json()["model"] == "tiny-test"


def test_sampling_without_a_seed_is_fresh_and_a_seed_replays(server):
    c = client(server)

    def texts(**seed):
        return [c.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=24,
                                     temperature=2.0, **seed).choices[0].text for _ in range(3)]

    assert len(set(texts())) > 1
    assert len(set(texts(seed=11))) == 1


def test_usage_carries_nfe_and_tpf_and_generate_batches_segments(server, offline):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=h, timeout=60,
                   json={"prompt": "Remember abc = 12.", "max_tokens": 16,
                         "decoding": {"buffer_size": 1, "policy": "fixed_steps", "steps_per_block": 2}})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["completion_tokens"] == 16 and u["nfe"] >= 4 and u["tokens_per_forward"] > 0
    segments = ["Sort: 5 4", "What is 1 + 1?", "hello"]
    r = httpx.post(server.url + "/generate", headers=h, timeout=60,
                   json={"segments": segments, "max_new_tokens": 12})
    assert r.status_code == 200, r.text
    want = offline([offline.tokenizer.encode(s) for s in segments], max_new_tokens=12)
    assert r.json()["output"] == [w.text for w in want]
    assert [s["nfe"] for s in r.json()["segments"]] == [w.nfe for w in want]
    # a bad segment among good ones gets its own error entry; the others are served as alone
    r = httpx.post(server.url + "/generate", headers=h, timeout=60,
                   json={"segments": [segments[0], "", segments[2], "x " * 600],
                         "max_new_tokens": 12})
    assert r.status_code == 200, r.text
    out, entries = r.json()["output"], r.json()["segments"]
    assert out == [want[0].text, None, want[2].text, None]
    assert entries[1]["error"]["code"] == 400 and "segments[1]" in entries[1]["error"]["message"]
    assert entries[3]["error"]["code"] == 400 and "segments[3]" in entries[3]["error"]["message"]


def test_64_concurrent_requests_equal_offline(server, offline):
    tok = offline.tokenizer
    prompts = [("Sort: " + " ".join(str((i * 7 + j) % 50) for j in range(i % 9 + 1))) for i in range(64)]
    lengths = [8 + (i * 5) % 40 for i in range(64)]

    async def one(c, p, n):
        r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": n})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths)))

    got = asyncio.run(main())
    for p, n, text in zip(prompts, lengths, got):
        (want,) = offline([tok.encode(p)], max_new_tokens=n)
        assert text == want.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1024}, "max_tokens"),  # + prompt > 1024
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "decoding": {"policy": "magic"}}, "policy"),
    ("/v1/completions", {"prompt": "hi", "decoding": {"accept_threshold": 1.5}}, "accept_threshold"),
    ("/v1/completions", {"prompt": "hi", "decoding": {"buffer_size": 9}}, "decoding"),
    ("/v1/completions", {"prompt": "hi", "decoding": {"nope": 1}}, "decoding"),
    ("/v1/completions", {"prompt": "hi", "n": 99}, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, "n"),  # 9 choices > max_segments 8
    ("/v1/completions", {"prompt": ["a"] * 9}, "prompt"),  # 9 prompts of one choice each
    ("/v1/completions", {"prompt": [[1, 2], "x"]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 10**6]]}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", [5, 6]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", ""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/generate", {"segments": []}, "segments"),
    ("/generate", {"segments": ["a"] * 9}, "segments"),
    ("/generate", {"segments": [""]}, "segments[0]"),  # every segment bad: the request fails
])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_malformed_and_oversize_bodies(server):
    h = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=h, timeout=30)
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"[1, 2]", headers=h, timeout=30)
    assert r.status_code == 400
    big = json.dumps({"prompt": "x" * 70000}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers=h, timeout=30)
    assert r.status_code == 413
    # Nothing accepted before was lost: the server still serves.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                   headers=h, timeout=30)
    assert r.status_code == 200


def test_auth_and_admin_isolation(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30,
                   headers={"Authorization": "Bearer wrong-key"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(server, key="nope").models.list()
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 404
    assert httpx.post(server.url + "/admin/profile", json={"seconds": 1}, timeout=10).status_code == 404
    assert httpx.get(server.admin + "/health", timeout=10).status_code == 200


def test_metrics_parse_and_move(server):
    before = server.metrics()
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8},
                   headers=h, timeout=60)
    assert r.status_code == 200
    after = server.metrics()
    key = 'mbd_requests_total{"route": "completions", "status": "200"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["mbd_generated_tokens_total"] >= before["mbd_generated_tokens_total"] + 8
    assert after["mbd_request_seconds_count"] == before["mbd_request_seconds_count"] + 1
    assert after["mbd_compilations_total"] > 0 and after["mbd_compilations_total"] == before["mbd_compilations_total"]
    assert after["mbd_device_busy_seconds_total"] > before["mbd_device_busy_seconds_total"]
    for name in ("mbd_queue_length", "mbd_busy_rows", "mbd_kv_buffer_usage_ratio",
                 "mbd_tokens_per_forward_count", "mbd_first_block_seconds_count",
                 "mbd_inter_block_seconds_count"):
        assert name in after
    assert after["mbd_prompt_tokens_total"] == before.get("mbd_prompt_tokens_total", 0) + \
        r.json()["usage"]["prompt_tokens"]
    length = 'mbd_finished_requests_total{"finish_reason": "length"}'
    assert after[length] == before.get(length, 0) + 1
    assert not [k for k in after if "_created" in k]
    # What the alert rules (deploy/prometheus) read: startup costs, the step time, the queue's
    # limit, the process's CPU time (no accelerator memory on CPU).
    assert after["mbd_model_load_seconds"] > 0 and after["mbd_warmup_seconds"] > 0
    assert after["mbd_decode_step_seconds_count"] > before["mbd_decode_step_seconds_count"]
    assert 0 < after["mbd_decode_step_seconds_sum"] / after["mbd_decode_step_seconds_count"] < 5
    assert after["mbd_queue_limit"] == 128  # live_server's queue_size
    assert after["process_cpu_seconds_total"] > 0 and after["mbd_cpu_cores"] >= 1
    assert "mbd_empty_responses_total" in after
    info = [k for k in after if k.startswith("mbd_model_info")]  # which model (version) serves
    assert len(info) == 1 and after[info[0]] == 1, info
    assert '"name": "tiny-test"' in info[0] and 'tiny-test.yaml", "version": ""' in info[0], info
    from mbd_jax import __version__
    assert f'"code_version": "{__version__}+g' in info[0], info  # a checkout: the commit too
    assert not [k for k in after if k.startswith("mbd_device_memory_bytes")]
    text = httpx.get(server.admin + "/metrics", timeout=10).text
    assert re.search(r"# TYPE mbd_compilations(_total)? counter", text)


def test_closed_stream_frees_its_row(server):
    before = server.metrics()
    body = {"prompt": "hi", "max_tokens": 1000, "stream": True,
            "decoding": {"policy": "fixed_steps", "steps_per_block": 8, "max_nfe": 1024}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text": ""' not in line:
                break  # the first block arrived: hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metrics()["mbd_busy_rows"] != 0:
        time.sleep(0.1)
    after = server.metrics()
    assert after["mbd_busy_rows"] == 0
    # It was stopped, not run to the end: no finished request and no 1000 tokens were counted.
    assert after["mbd_request_seconds_count"] == before["mbd_request_seconds_count"]
    assert after["mbd_generated_tokens_total"] < before["mbd_generated_tokens_total"] + 1000


def test_profile_capture_one_at_a_time(server):
    """One capture at a time (409 for a second), with a key (a plain key may; none: 401)."""
    assert httpx.post(server.admin + "/admin/profile", json={"seconds": 1},
                      timeout=10).status_code == 401

    async def main():
        async with httpx.AsyncClient(base_url=server.admin, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            first = asyncio.create_task(c.post("/admin/profile", json={"seconds": 1.0}))
            await asyncio.sleep(0.3)
            second = await c.post("/admin/profile", json={"seconds": 1.0})
            return await first, second

    first, second = asyncio.run(main())
    assert second.status_code == 409
    assert first.status_code == 200, first.text
    traces = list(pathlib.Path(first.json()["directory"]).rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    bad = httpx.post(server.admin + "/admin/profile", json={"seconds": -1}, timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seconds"


def test_thinking_requests_use_their_template_and_budget(server, offline):
    h = {"Authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"messages": messages, "thinking": True, "max_tokens": 16})
    assert r.status_code == 200, r.text
    (want,) = offline([offline.tokenizer.encode(chat.render(messages, thinking=True))],
                      max_new_tokens=16)
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == chat.split_reasoning(want.text)
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, timeout=60,
                   json={"messages": messages, "thinking": True, "max_tokens": 600})
    assert r.status_code == 400 and "thinking" in r.json()["error"]["message"]


def test_bad_serve_config_names_the_field(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("server:\n  max_batch_sise: 4\n")
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "unknown field(s) max_batch_sise" in r.stderr
    cfg.write_text("decoding:\n  buffer_size: 4\nserver:\n  buffer_size: 2\n")
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "decoding.buffer_size must be <= server.buffer_size" in r.stderr
    assert "Traceback" not in r.stderr


def test_rate_limit_queue_full_and_sigterm_drain(tmp_path):
    """2 rows, a queue of 4: of 8 concurrent long requests 6 are accepted and 2 refused (429);
    SIGTERM while they run: /ready turns 503, all 6 accepted finish, the process exits 0."""
    keys = [f"key-{i}" for i in range(10)]
    srv = Server(tmp_path, keys, rate_limit_per_s=0.1, rate_limit_burst=2, max_batch_size=2,
                 queue_size=4)
    try:
        h = {"Authorization": "Bearer key-0"}
        codes = [httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                            headers=h, timeout=60).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=h, timeout=60)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1

        async def load():
            async with httpx.AsyncClient(base_url=srv.url, timeout=180) as c:
                tasks = []
                for i in range(1, 9):
                    tasks.append(asyncio.create_task(c.post(
                        "/v1/completions", json={"prompt": f"Sort: {i} 3 1", "max_tokens": 300,
                                                 "decoding": {"policy": "fixed_steps", "steps_per_block": 8}},
                        headers={"Authorization": f"Bearer key-{i}"})))
                await asyncio.sleep(1.0)  # all answered or queued
                srv.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                ready = await c.get("/ready")
                return await asyncio.gather(*tasks), ready.status_code

        responses, ready_status = asyncio.run(load())
        assert ready_status == 503
        codes = [r.status_code for r in responses]
        assert sorted(codes) == [200] * 6 + [429] * 2, codes
        accepted = [r for r in responses if r.status_code == 200]
        assert all(r.json()["usage"]["completion_tokens"] == 300 for r in accepted)
        assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()


def test_busy_port_is_one_error_line_at_once(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "mbd_jax", "serve", "--port", str(port),
                            "--admin-port", "0"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    # one line and nothing else: no model was loaded, nothing compiled (the order is what the
    # test asserts; the bound only catches a hang, as a loaded CI may take seconds to import jax)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines == [
        f"error: cannot listen on 127.0.0.1:{port} (--port): Address already in use"], r.stderr
    assert time.monotonic() - t0 < 30


def test_generate_keeps_finished_segments_when_others_time_out(tmp_path):
    """One row, a 60 ms queue timeout: the first segment decodes 200 tokens (200+ forwards, far
    longer than 60 ms) while the others wait and time out. The answer keeps the finished
    segment and gives each failed one its own error. The same server checks the deployment
    knobs: settings from MBD_* variables, --api-key, no admin port (/metrics on the data port),
    --served-model-name and --max-model-len."""
    srv = Server(tmp_path, [KEY], max_batch_size=4, queue_timeout_ms=60, admin=False,
                 args=("--api-key", "flag-key", "--served-model-name", "my-model",
                       "--max-model-len", "512"),
                 env={"MBD_SERVER_MAX_BATCH_SIZE": "1"})
    try:
        c = srv.openai_client("flag-key")
        assert [m.id for m in c.models.list().data] == ["my-model"]
        assert c.models.retrieve("my-model").model_extra["max_model_len"] == 512
        assert c.completions.create(model="my-model", prompt="hi", max_tokens=2).choices
        metrics = httpx.get(srv.url + "/metrics", timeout=10)
        assert metrics.status_code == 200 and "mbd_busy_rows" in metrics.text
        r = httpx.post(srv.url + "/generate", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=120, json={"segments": ["hi", "yo", "ok"], "max_new_tokens": 200,
                                          "decoding": {"buffer_size": 1, "policy": "fixed_steps",
                                                       "steps_per_block": 8}})
        assert r.status_code == 200, r.text
        out, segments = r.json()["output"], r.json()["segments"]
        assert isinstance(out[0], str) and segments[0]["tokens"] == 200
        assert out[1:] == [None, None]
        assert [s["error"]["code"] for s in segments[1:]] == [503, 503]
        assert "queue_timeout_ms" in segments[1]["error"]["message"]
        # the YAML says 4 rows, the environment 1: only one segment ran, so the others timed out
    finally:
        srv.stop()


def test_voting_through_the_service(server):
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60, json={"prompt": "What is 12 + 30?", "max_tokens": 16,
                                     "decoding": {"voting": {"extractor": "regex", "pattern": r"(\w+)"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["voting"]["answer"] is not None
    assert choice["voting"]["final_answer"] is not None


def test_shared_system_prompt_hits_the_prefix_cache_across_a_restart(tmp_path, offline):
    """Requests sharing a long system prompt reuse its KV blocks (RAM, then disk after a
    restart) and still equal offline generation."""
    cache = {"cache": {"enabled": True, "storage_path": str(tmp_path / "kv"), "ram_capacity_mb": 64,
                       "disk_capacity_mb": 64}}
    system = "You are a careful assistant. " * 12
    questions = ["Sort: 3 1 2", "Reverse: a b c", "What is 12+30?"]
    messages = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                for q in questions]
    expected = [r.text for r in offline([offline.tokenizer.encode(chat.render(m))
                                         for m in messages], max_new_tokens=16)]
    for attempt in range(2):  # the second server starts on the first one's disk tier
        (tmp_path / f"s{attempt}").mkdir()
        srv = Server(tmp_path / f"s{attempt}", [KEY], sections=cache)
        try:
            c = client(srv)
            got, cached = [], []
            for m in messages:  # one after another: each finds the blocks the last one stored
                r = c.chat.completions.create(model="tiny-test", messages=m, max_tokens=16)
                got.append(r.choices[0].message.content)
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
            assert got == expected
            # usage reports the prompt tokens served from the cache: whole shared blocks
            assert (cached[0] == 0) == (attempt == 0) and all(c > 0 for c in cached[1:]), cached
            assert all(c % 4 == 0 and c < r.usage.prompt_tokens for c in cached), cached
            met = srv.metrics()
            # every cached token came from the pool's shared pages or the store's blocks (block
            # 8): the later requests map the first one's pages; the store serves the blocks past
            # them, and after the restart the first request's whole prefix
            pool, store = met["mbd_kv_pool_prefix_tokens_total"], met["mbd_prefix_cache_hit_blocks_total"]
            assert pool > 0 and store > 0 and pool + 8 * store >= sum(cached), (pool, store, cached)
            if attempt == 1:
                assert 8 * store >= cached[0] > 0
            assert met['mbd_prefix_cache_bytes{"tier": "disk"}'] > 0
            assert met["mbd_kv_offload_blocking_waits_total"] == 0
            assert 0 < met["mbd_prefix_cache_hit_ratio"] <= 1
        finally:
            srv.stop()


# ------------------------------------------------------------------ the OpenAI request surface

def test_batched_prompts_token_ids_and_n_choices_match_offline(server, offline):
    """prompt as a list (what the SDK sends for batches) and as token ids; n choices per prompt
    (index = prompt * n + j, choice j sampled with seed + j); usage counts each prompt once."""
    c, tok = client(server), offline.tokenizer
    prompts = ["Once upon a time", "Sort: 3 1 2"]
    r = c.completions.create(model="tiny-test", prompt=prompts, n=2, max_tokens=10,
                             temperature=1.0, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for ch in r.choices:
        (want,) = offline([tok.encode(prompts[ch.index // 2])], max_new_tokens=10,
                          temperature=1.0, seed=7 + ch.index)
        assert ch.text == want.text, ch.index
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 40
    by_ids = c.completions.create(model="tiny-test", prompt=[tok.encode(p) for p in prompts],
                                  max_tokens=10, temperature=1.0, seed=7, n=2)
    assert [ch.text for ch in by_ids.choices] == [ch.text for ch in r.choices]
    single = c.completions.create(model="tiny-test", prompt=tok.encode(prompts[1]),
                                  max_tokens=10, temperature=1.0, seed=9)
    assert single.choices[0].text == r.choices[2].text  # seed 9 = choice 2's seed 7 + 2


def test_stop_strings_cut_the_text_and_free_the_row(server):
    c = client(server)
    full = c.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=40)
    text = full.choices[0].text
    stop = next(text[i: i + 3] for i in range(4, len(text) - 3) if text[i: i + 3].strip())
    cut = text[: text.index(stop)]
    r = c.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=40,
                             stop=["never appears \u2603", stop])
    assert r.choices[0].text == cut and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40
    streamed = list(c.completions.create(model="tiny-test", prompt="Once upon a time",
                                         max_tokens=40, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"
    # the stopped rows were freed: nothing busy, and [] stops nothing
    deadline = time.monotonic() + 10
    while server.metrics()["mbd_busy_rows"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metrics()["mbd_busy_rows"] == 0
    assert c.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=40,
                                stop=[]).choices[0].text == text


def test_chat_stream_with_n_and_usage_developer_role_and_content_parts(server, offline):
    c, tok = client(server), offline.tokenizer
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be"},
                                                  {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "What is 2 + 2?"}]
    as_system = [{"role": "system", "content": "Be\nbrief."}, messages[1]]
    chunks = list(c.chat.completions.create(
        model="tiny-test", messages=messages, max_tokens=12, n=2, temperature=1.0, seed=4,
        stream=True, stream_options={"include_usage": True}))
    texts, reasons = {0: "", 1: ""}, {}
    for ch in chunks[:-1]:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    for j in (0, 1):
        (want,) = offline([tok.encode(chat.render(as_system))], max_new_tokens=12,
                          temperature=1.0, seed=4 + j)
        assert texts[j] == want.text, j
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


class Point(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    x: int = pydantic.Field(ge=0, le=9)
    y: int = pydantic.Field(ge=0, le=9)


class Shape(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    kind: typing.Literal["circle", "square"]
    at: Point
    tags: list[typing.Annotated[str, pydantic.StringConstraints(max_length=3)]] = pydantic.Field(
        max_length=2)


def test_structured_output_through_the_official_client(server, offline):
    """parse() with a pydantic model returns the parsed object (random weights: the constraint
    alone makes it valid); json_object; vLLM's structured_outputs and guided_* fields; a stream
    reassembles to the non-streamed text (greedy), each chunk extending a valid prefix."""
    c = client(server)
    messages = [{"role": "user", "content": "Describe a shape."}]
    for seed in range(3):
        r = c.chat.completions.parse(model="tiny-test", messages=messages, response_format=Shape,
                                     max_completion_tokens=200, temperature=1.0, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Shape), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="tiny-test", messages=messages, max_tokens=200,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")
    r = c.completions.create(model="tiny-test", prompt="Pick:", max_tokens=32,
                             extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].text in ("red", "green", "blue")
    r = c.completions.create(model="tiny-test", prompt="Code:", max_tokens=32, n=2, seed=3,
                             temperature=1.0,
                             extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert all(re.fullmatch("[A-Z]{2}-[0-9]{3}", ch.text) for ch in r.choices)
    body = dict(model="tiny-test", messages=messages, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "Shape", "schema": Shape.model_json_schema()}})
    whole = c.chat.completions.create(**body).choices[0].message.content
    text = ""
    for ch in c.chat.completions.create(**body, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
            assert whole.startswith(text)  # (validity of each prefix: the offline tests)
    assert text == whole and Shape.model_validate_json(whole)


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}, "then": {}}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": functools.reduce(lambda inner, _: {"items": inner}, range(25), {})}}},
     "response_format.json_schema.schema", "nests deeper"),
    ({"guided_json": json.dumps(functools.reduce(lambda inner, _: [inner], range(40), []))},
     "guided_json", "nests deeper"),
    ({"guided_regex": "a" * 40_000}, "guided_regex", "the limit is"),
    ({"structured_outputs": {"regex": "[a&&b]"}}, "structured_outputs.regex", "matches no text"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar",
     "nowhere"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex",
     "both constrain"),
    ({"guided_choice": "red"}, "guided_choice", "list of strings"),
])
def test_bad_structured_output_requests_are_400_naming_the_field(server, extra, param, message):
    assert_chat_400(server, extra, param, message)


def assert_chat_400(server, extra: dict, param: str, message: str) -> None:
    """A chat request with `extra` fields is a 400 naming `param` and saying `message`."""
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


SORT_TOOL = {"type": "function", "function": {
    "name": "sort_numbers", "description": "Sort a list of integers", "parameters": {
        "type": "object", "properties": {"numbers": {"type": "array", "maxItems": 4, "items": {
            "type": "integer", "minimum": 0, "maximum": 9}}},
        "required": ["numbers"], "additionalProperties": False}}}
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}


def _check_calls(calls, tools=(SORT_TOOL, ADD_TOOL)):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_calls_through_the_official_client(server):
    """required, named, parallel or not, auto, a follow-up turn with the tool's answer, and a
    stream whose deltas reassemble into the non-streamed calls (random weights: the grammar
    alone makes the calls valid)."""
    c = client(server)
    messages = [{"role": "user", "content": "Sort 3 1 2, then add 2 and 2."}]
    tools = [SORT_TOOL, ADD_TOOL]
    common = dict(model="tiny-test", messages=messages, tools=tools, max_tokens=200)
    r = c.chat.completions.create(**{**common, "max_tokens": 800}, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    _check_calls(choice.message.tool_calls)
    for seed in range(3):
        r = c.chat.completions.create(**common, tool_choice="required", parallel_tool_calls=False,
                                      temperature=1.0, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1
        _check_calls(r.choices[0].message.tool_calls)
    r = c.chat.completions.create(**common, tool_choice={"type": "function",
                                                         "function": {"name": "add"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and r.choices[0].finish_reason == "tool_calls"
    _check_calls([call])
    r = c.chat.completions.create(**{**common, "max_tokens": 16}, tool_choice="auto")
    assert r.choices[0].message.tool_calls or r.choices[0].message.content is not None
    r = c.chat.completions.create(**{**common, "max_tokens": 16}, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "4"}]
    r = c.chat.completions.create(model="tiny-test", messages=follow_up, tools=tools,
                                  max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    common["max_tokens"] = 800
    whole = c.chat.completions.create(**common, tool_choice="required").choices[0].message
    parts: dict[int, dict] = {}
    reason = None
    for ch in c.chat.completions.create(**common, tool_choice="required", stream=True):
        for delta_call in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            part = parts.setdefault(delta_call.index, {"name": "", "arguments": ""})
            part["name"] += delta_call.function.name or ""
            part["arguments"] += delta_call.function.arguments or ""
        if ch.choices and ch.choices[0].finish_reason:
            reason = ch.choices[0].finish_reason
    assert reason == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.tool_calls]


def test_langchain_structured_output_and_tool_binding(server):
    """LangChain's ChatOpenAI against the service: with_structured_output (OpenAI's json_schema)
    returns the pydantic object, bind_tools with a forced choice returns a valid call."""
    from langchain_openai import ChatOpenAI

    class Add(pydantic.BaseModel):
        """Add two small numbers."""
        a: int = pydantic.Field(ge=0, le=99)
        b: int = pydantic.Field(ge=0, le=99)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="tiny-test",
                     max_tokens=200, temperature=0)
    shape = llm.with_structured_output(Shape, method="json_schema").invoke("Describe a shape.")
    assert isinstance(shape, Shape)
    message = llm.bind_tools([Add], tool_choice="Add").invoke("Add 2 and 2.")
    (call,) = message.tool_calls
    assert call["name"] == "Add" and Add.model_validate(call["args"])


@pytest.mark.parametrize("extra,param,message", [
    ({"tools": [ADD_TOOL], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools", "parameters must be a JSON Schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"tools": [ADD_TOOL, ADD_TOOL]}, "tools", "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tools", "strin"),
    ({"tools": [ADD_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "both constrain"),
    ({"tools": [ADD_TOOL], "tool_choice": "required", "thinking": True}, "thinking",
     "need thinking off"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0]", "null only"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "add", "arguments": "[1]"}}]}]},
     "messages[0]", "arguments must be a JSON object"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param, message):
    assert_chat_400(server, extra, param, message)


def test_top_k_one_is_greedy_at_any_temperature(server):
    c = client(server)
    greedy = c.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=16)
    for _ in range(2):  # unseeded: fresh randomness, which top_k 1 leaves no room for
        r = c.completions.create(model="tiny-test", prompt="Once upon a time", max_tokens=16,
                                 temperature=2.0, extra_body={"top_k": 1})
        assert r.choices[0].text == greedy.choices[0].text


def test_harmless_fields_are_accepted_and_logged_and_thinking_kwargs_work(server, offline):
    c = client(server)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = c.chat.completions.create(
        model="tiny-test", messages=messages, max_tokens=8, user="u1", store=False,
        metadata={"team": "a"}, parallel_tool_calls=False, tool_choice="none",
        response_format={"type": "text"}, extra_body={"chat_template_kwargs": {"foo": 1}})
    assert r.choices[0].message.content
    assert "ignoring store, metadata, parallel_tool_calls, chat_template_kwargs.foo" in server.log_text()
    # thinking switched by chat_template_kwargs: the thinking template, the reply in
    # reasoning_content up to </think> (this random model never closes it)
    r = c.chat.completions.create(model="tiny-test", messages=messages, max_tokens=16,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    (want,) = offline([offline.tokenizer.encode(chat.render(messages, thinking=True))],
                      max_new_tokens=16)
    reasoning, answer = chat.split_reasoning(want.text)
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == (reasoning, answer)


def test_openapi_schema_is_published(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/generate"}
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "stop", "n", "top_k", "seed", "max_tokens"} <= set(props)
    assert doc["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False


def test_logprobs_of_the_chosen_tokens(server, offline):
    """Each token's log-probability when it was written (the engine's, checked against a full
    forward in test_decoding), its text, offsets that rebuild the completion; streamed too."""
    c, tok = client(server), offline.tokenizer
    prompt = "Once upon a time"
    (want,) = offline([tok.encode(prompt)], max_new_tokens=12)
    r = c.completions.create(model="tiny-test", prompt=prompt, max_tokens=12, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert "".join(lp.tokens) == r.choices[0].text == want.text
    assert [r.choices[0].text[: o] for o in lp.text_offset] == \
        ["".join(lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(
        model="tiny-test", prompt=prompt, max_tokens=12, logprobs=0, stream=True)]
    assert [x for s in streamed if s for x in s.token_logprobs] == lp.token_logprobs
    chat_r = c.chat.completions.create(model="tiny-test", max_tokens=8, logprobs=True,
                                       messages=[{"role": "user", "content": prompt}])
    content = chat_r.choices[0].logprobs.content
    assert len(content) == chat_r.usage.completion_tokens and all(t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat_r.choices[0].message.content
    assert c.completions.create(model="tiny-test", prompt=prompt,
                                max_tokens=4).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-test", max_tokens=4, logprobs=True, top_logprobs=3,
                                  messages=[{"role": "user", "content": prompt}])
    assert e.value.body["param"] == "top_logprobs"


def test_https_on_the_data_port_and_plain_http_refused_there(tmp_path, offline):
    """--ssl-certfile / --ssl-keyfile: the official openai client completes over HTTPS (trusting
    the self-signed certificate) as offline generate does; plain HTTP on that port gets no
    answer; the admin port stays plain HTTP. A key that does not load is one error line at
    start, naming the setting. The same server logs to a file rotated by size (monitoring.log_*),
    and no log line carries a request's text."""
    import ssl

    from tests.live_server import free_port, self_signed_certificate

    cert, key = self_signed_certificate(tmp_path)
    log_file = tmp_path / "mbd.log"
    s = Server(tmp_path, [KEY], tls=(cert, key), sections={"monitoring": {
        "log_level": "info", "log_file": str(log_file), "log_max_bytes": 1024, "log_backups": 2}})
    secret = "Sort: 3 1 2 zebra-7781"
    try:
        assert s.url.startswith("https://")
        c = s.openai_client(http_client=httpx.Client(verify=s.verify))
        (want,) = offline([offline.tokenizer.encode(secret)], max_new_tokens=12)
        r = c.completions.create(model="tiny-test", prompt=secret, max_tokens=12)
        assert r.choices[0].text == want.text
        c.chat.completions.create(model="tiny-test", max_tokens=4, store=True,  # one warning
                                  messages=[{"role": "user", "content": secret}])
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{s.port}/ready", timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(s.url + "/ready", timeout=10, verify=ssl.create_default_context())
        assert httpx.get(s.admin + "/metrics", timeout=10).status_code == 200
    finally:
        s.stop()
    logs = sorted(tmp_path.glob("mbd.log*"))
    names = [p.name for p in logs]  # rotated at 1 KiB, at most 2 old files kept
    assert names[:2] == ["mbd.log", "mbd.log.1"] and set(names) <= {"mbd.log", "mbd.log.1",
                                                                     "mbd.log.2"}
    text = "".join(p.read_text() for p in logs)
    assert all(p.stat().st_size <= 1024 for p in logs)
    assert "ignoring store" in text  # the request was logged about ...
    assert "zebra" not in text  # ... without its text
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "serve", "--model", "tiny-test",
                        "--port", str(free_port()), "--admin-port", "0",
                        "--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "none.pem")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "server.ssl_certfile" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_the_info_log_has_every_request_one_start_and_no_noise(tmp_path):
    """At log_level info: every warm-up step (the decode loop too) and every request has its
    line (12 alike in a row: none dropped as repeats), uvicorn's start is said once for the two
    ports, and neither orbax's checkpoint narration nor the /ready and /metrics polls appear."""
    s = Server(tmp_path, [KEY], sections={"monitoring": {"log_level": "info"}})
    try:
        for _ in range(12):
            r = httpx.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "tiny-test", "prompt": "12+30=", "max_tokens": 4},
                           timeout=60)
            assert r.status_code == 200, r.text
        assert httpx.get(s.admin + "/metrics", timeout=10).status_code == 200
        text = s.log_text()
    finally:
        s.stop()
    assert "warm-up: compiling the decode loop" in text, text[-3000:]
    assert len(re.findall(r"POST /v1/completions status=200", text)) == 12, text[-3000:]
    assert text.count("Started server process") == 1, text[-3000:]
    assert " absl: " not in text and "GET /ready" not in text and "GET /metrics" not in text


def interrupted_while_compiling(tmp_path, at: str) -> tuple[subprocess.Popen, list[str]]:
    """`mbd-jax serve` with many programs to compile (no compile cache, prefill buckets up to
    1024), sent SIGINT at its first log line holding `at`: (the process, every line it logged)."""
    from tests.live_server import free_port

    (tmp_path / "serve.yaml").write_text(
        "model: tiny-test\nmonitoring:\n  log_level: info\ncache:\n  enabled: false\n"
        "server:\n  prefill_chunk: 1024\n  drain_min_s: 0\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mbd_jax", "serve", "--config", str(tmp_path / "serve.yaml"),
         "--port", str(free_port()), "--admin-port", "0", "--compile-cache", "off"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if at in line:
            break
    proc.send_signal(signal.SIGINT)
    return proc, lines + proc.stdout.readlines()


def test_ctrl_c_during_warm_up_stops_at_once_and_is_never_ready(tmp_path):
    """SIGINT while the warm-up compiles (no compile cache, prefill buckets up to 1024: many
    programs): the process exits with 0 and the compile loop stops there. Judged by the log's
    order, not by time: after "stopping during warm-up" no further program is announced (one at
    most, when the engine thread was announcing it as the signal came), and the engine is never
    ready."""
    proc, lines = interrupted_while_compiling(tmp_path, "warm-up: compiling prefill")
    text = "".join(lines)
    assert proc.wait(timeout=120) == 0, text
    assert "stopping during warm-up" in text, text
    after = text[text.index("stopping during warm-up"):]
    assert "engine ready" not in text and "warm-up done" not in text, text
    assert after.count("warm-up: compiling") <= 1, after


def test_ready_before_the_larger_prefill_buckets_and_no_compile_once_they_are_in(tmp_path):
    """/ready turns 200 once the smallest prefill bucket and the decode loop are compiled and
    says how far the rest has come; a long prompt sent at once is answered (on the buckets
    compiled so far), the same answer as once every bucket is in, after which requests
    compile nothing."""
    s = Server(tmp_path, [KEY], warm=False, prefill_chunk=256)
    try:
        ready = httpx.get(s.url + "/ready", timeout=10).json()
        assert ready["prefill_chunk"] == 256 and ready["prefill_chunk_compiled"] in (8, 16, 32, 64,
                                                                                      128, 256)
        h = {"Authorization": f"Bearer {KEY}"}
        body = {"model": "tiny-test", "prompt": "7+5=12; " * 30, "max_tokens": 8}
        first = httpx.post(s.url + "/v1/completions", headers=h, json=body, timeout=120)
        assert first.status_code == 200, first.text
        deadline = time.monotonic() + 240
        while httpx.get(s.url + "/ready", timeout=10).json()["prefill_chunk_compiled"] < 256:
            assert time.monotonic() < deadline, s.log_text()[-3000:]
            time.sleep(0.2)
        before = s.metrics()["mbd_compilations_total"]
        again = httpx.post(s.url + "/v1/completions", headers=h, json=body, timeout=120)
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert s.metrics()["mbd_compilations_total"] == before
        assert s.metrics()["mbd_prefill_chunk_ready_tokens"] == 256
    finally:
        s.stop()


def test_ctrl_c_while_the_background_buckets_compile_exits_at_once(tmp_path):
    """SIGINT after /ready while the larger prefill buckets still compile (no compile cache,
    buckets up to 1024): the service drains and exits 0, and no further bucket is announced
    after the drain began (one at most, announced as the signal came)."""
    # at ready the background compiles have begun
    proc, lines = interrupted_while_compiling(tmp_path, "engine ready")
    text = "".join(lines)
    assert proc.wait(timeout=120) == 0, text
    assert "engine ready" in text and "draining" in text, text
    after = text[text.index("draining"):]
    assert after.count("in the background (") <= 1, after
    assert "prefill buckets compiled in the background" not in text, text
