"""API keys with names and policies (serving/keys.py) and the access log (serving/access.py):
key files read and refused by field; over real HTTP, route scopes, the admin right, per-key
request rates and token budgets enforced each on its own; every request of a burst has exactly
one access-log line with its id and key name, and no key appears in any log; a stream the client
cuts is a 499, and the KV gauge shows its pages back in the pool without another request."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mbd_jax.config import ServerConfig
from mbd_jax.errors import ConfigError
from mbd_jax.serving import keys

from tests.live_server import Server

ALICE, BOB, OPS = "sk-alice-0123456789", "sk-bob-0123456789ab", "sk-ops-0123456789abc"
NAMED = [
    {"name": "alice", "key": ALICE, "routes": ["chat_completions", "models"], "tokens_per_min": 10},
    {"name": "bob", "key": BOB, "requests_per_s": 0.01},
    {"name": "ops", "key": OPS, "admin": True},
]


def test_key_files_plain_and_named(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("# comment\nfirst-key\n\n  second-key  \n")
    got = keys.load_key_file(plain)
    assert [k.key for k in got] == ["first-key", "second-key"]
    assert all(re.fullmatch(r"key-[0-9a-f]{8}", k.name) and k.admin for k in got)
    assert "first-key" not in repr(got)  # a key never shows in a log or a traceback
    named = tmp_path / "named.yaml"
    import yaml
    named.write_text(yaml.safe_dump(NAMED))
    alice, bob, ops = keys.load_key_file(named)
    assert alice.routes == ("chat_completions", "models") and alice.tokens_per_min == 10
    assert not alice.admin and bob.requests_per_s == 0.01 and ops.admin
    assert bob.routes == keys.DATA_ROUTES


@pytest.mark.parametrize("entry,named", [
    ({"name": "x", "key": "short"}, "'key' must have at least 16"),
    ({"name": "x", "key": ALICE, "routes": ["admin"]}, "field 'routes': unknown route"),
    ({"name": "x", "key": ALICE, "rate": 2}, "unknown field(s) rate"),
    ({"key": ALICE}, "name"),
    ({"name": "x", "key": ALICE, "tokens_per_min": -1}, "'tokens_per_min' must be >= 0"),
])
def test_a_bad_key_entry_names_its_field(tmp_path, entry, named):
    import yaml
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump([NAMED[0], entry]))
    with pytest.raises(ConfigError, match=re.escape(named)) as e:
        keys.load_key_file(path)
    assert "key 2" in str(e.value) and ALICE not in str(e.value)


def test_a_name_or_key_given_twice_is_refused():
    twice = [keys.ApiKey("a", ALICE), keys.ApiKey("a", BOB)]
    with pytest.raises(ConfigError, match="the name 'a' is given twice"):
        keys.Gate(twice, ServerConfig())
    with pytest.raises(ConfigError, match="key of key 'b'") as e:
        keys.check_unique([keys.ApiKey("a", ALICE), keys.ApiKey("b", ALICE)])
    assert ALICE not in str(e.value)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    srv = Server(tmp, NAMED, rate_limit_burst=1,
                 sections={"monitoring": {"log_level": "warning",
                                          "access_log_file": str(tmp / "access.log")}})
    yield srv
    srv.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat(srv, key: str, **extra) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", headers=auth(key), timeout=60,
                      json={"messages": [{"role": "user", "content": "Sort: 3 1 2"}],
                            "max_tokens": 8, **extra})


def test_scopes_admin_rates_and_budgets_each_on_their_own(server):
    r = httpx.post(server.url + "/v1/completions", headers=auth(ALICE), timeout=60,
                   json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 403 and "'alice' may not call completions" in r.json()["error"]["message"]
    assert chat(server, ALICE).status_code == 200  # overdraws alice's 10 tokens a minute
    r = chat(server, ALICE)
    assert r.status_code == 429 and "token budget" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert chat(server, BOB).status_code == 200  # alice's budget is hers alone
    r = chat(server, BOB)
    assert r.status_code == 429 and "rate limit: 0.01 requests/s" in r.json()["error"]["message"]
    assert "for key 'bob'" in r.json()["error"]["message"]
    assert chat(server, OPS).status_code == 200  # neither limit is ops'
    r = httpx.post(server.admin + "/admin/profile", headers=auth(BOB), json={"seconds": 0.2},
                   timeout=30)
    assert r.status_code == 403 and "admin route" in r.json()["error"]["message"]
    r = httpx.post(server.admin + "/admin/profile", headers=auth(OPS), json={"seconds": 0.2},
                   timeout=30)
    assert r.status_code == 200, r.text
    m = server.metrics()
    rejected = {reason: m.get(f'mbd_requests_rejected_total{{"reason": "{reason}"}}', 0)
                for reason in ("scope", "token_budget", "rate_limit")}
    assert rejected == {"scope": 2, "token_budget": 1, "rate_limit": 1}, rejected


def access_lines(srv) -> list[str]:
    return (srv.tmp / "access.log").read_text().splitlines()


def test_every_request_of_a_burst_has_one_access_line_and_no_key_is_logged(server):
    """1,000 requests (models lists, a few completions, some with a wrong key), 8 at a time:
    each id once in the access log, with its key's name, route and status."""
    def one(i: int) -> tuple[str, int]:
        rid = f"burst-{i:04d}"
        key = "sk-wrong-0123456789" if i % 50 == 7 else OPS
        if i % 100 == 3:
            r = httpx.post(server.url + "/v1/completions", headers={**auth(key), "x-request-id": rid},
                           json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        else:
            r = httpx.get(server.url + "/v1/models", headers={**auth(key), "x-request-id": rid},
                          timeout=30)
        return rid, r.status_code

    with ThreadPoolExecutor(8) as pool:
        sent = dict(pool.map(one, range(1000)))
    # (a non-streamed answer's line is written before the answer goes out: no wait needed)
    lines = [x for x in access_lines(server) if " burst-" in x]
    by_id = {}
    for x in lines:
        by_id.setdefault(re.search(r"request (burst-\d+) ", x).group(1), []).append(x)
    assert len(by_id) == 1000 and all(len(v) == 1 for v in by_id.values())
    for rid, status in sent.items():
        (x,) = by_id[rid]
        assert f"status={status} " in x and "client=127.0.0.1" in x
        assert (" key=ops " in x) if status != 401 else (" key=- " in x)
    assert sum(status == 401 for status in sent.values()) == 20
    completions = [x for x in lines if "/v1/completions status=200" in x]
    assert completions and all(re.search(r"prompt_tokens=[1-9]\d* completion_tokens=[1-9]", x)
                               for x in completions)
    logs = access_lines(server) + server.log_text().splitlines()
    for key in (ALICE, BOB, OPS, "sk-wrong-0123456789"):
        assert not [x for x in logs if key in x], key


def test_a_stream_the_client_cuts_is_a_499_and_the_kv_gauge_sees_its_pages_freed(server):
    before = server.metrics()
    status = 'mbd_requests_total{"route": "chat_completions", "status": "499"}'
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=auth(OPS), timeout=60,
                      json={"messages": [{"role": "user", "content": "Sort: 3 1 2"}],
                            "max_tokens": 900, "stream": True,  # a token a forward: seconds
                            "decoding": {"ignore_eos": True, "policy": "fixed_steps",
                                         "steps_per_block": 8, "max_nfe": 2000}}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the stream is open (900 forwards to go): hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metrics().get(status, 0) == before.get(status, 0):
        time.sleep(0.05)
    after = server.metrics()
    assert after.get(status, 0) == before.get(status, 0) + 1
    assert [x for x in access_lines(server) if "/v1/chat/completions status=499" in x]
    while time.monotonic() < deadline and server.metrics()["mbd_busy_rows"]:
        time.sleep(0.05)
    # the gauge reads the pool when scraped: its pages are back with the row, no request since
    assert server.metrics()["mbd_kv_buffer_usage_ratio"] == 0
