"""No request can stop the service: hostile values, malformed bodies, a property-based fuzz run,
disconnects, idle and slow connections, drain timeouts and key guessing, each against a real
`mbd-jax serve` process on loopback. After the hostile traffic the engine still serves and a
fixed request gives the same output as before it."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.live_server import KEY, OPTIMISED, Server

AUTH = {"Authorization": f"Bearer {KEY}"}
FIXED = {"prompt": "Sort: 3 1 2", "max_tokens": 8}
LIMITS = {"generation": {"max_new_tokens": 8, "max_new_tokens_limit": 1024, "max_nfe_limit": 2048}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("hardening"), [KEY], sections=LIMITS,
                 auth_failures_per_min=5, max_batch_size=4, env=OPTIMISED)
    srv.fixed_before = post(srv, "/v1/completions", FIXED).json()["choices"][0]["text"]
    yield srv
    srv.stop()


def post(srv, path, body=None, content=None, headers=None, timeout=60):
    """json.dumps escapes lone surrogates (\\ud800), so hostile strings travel as valid JSON."""
    h = {**AUTH, "content-type": "application/json", **(headers or {})}
    content = json.dumps(body).encode() if content is None else content
    return httpx.post(srv.url + path, content=content, headers=h, timeout=timeout)


def assert_serves_as_before(srv):
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
    r = post(srv, "/v1/completions", FIXED)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == srv.fixed_before
    assert srv.metrics()["mbd_engine_failures_total"] == 0


def assert_client_error(r, param: str | None = None):
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == r.status_code
    if param is not None:
        assert err["param"] == param or param in err["message"], err


# Each of these once reached the device or the engine thread and stopped the engine for everyone
# (int32 overflow, exp overflow, a 150 s regex, 500s), or ran unbounded.
HOSTILE = [
    ({"decoding": {"max_nfe": 2**31}}, "max_nfe"),
    ({"decoding": {"max_nfe": 4096}}, "max_nfe"),  # above the server's max_nfe_limit
    ({"decoding": {"max_post_edit_steps": 2**31}}, "max_post_edit_steps"),
    ({"decoding": {"steps_per_block": 2**40}}, "steps_per_block"),
    ({"decoding": {"factor": 10**400}}, "factor"),
    ({"decoding": {"voting": {"alpha": 900.0}}}, "alpha"),
    ({"decoding": {"voting": {"extractor": "regex", "pattern": "(ab"}}}, "pattern"),
    ({"decoding": {"voting": {"extractor": "regex", "pattern": "a{100000}"}}}, "pattern"),
    ({"decoding": {"voting": {"extractor": "regex", "pattern": "(a)\\1"}}}, "pattern"),
    ({"decoding": {"voting": {"extractor": "regex", "pattern": "x" * 5000}}}, "pattern"),
    ({"stream_options": "yes"}, "stream_options"),
    ({"stream": True, "stream_options": [1]}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"model": 5}, "model"),
    ({"user": {"id": 1}}, "user"),
    ({"seed": -1}, "seed"),
    ({"prompt": "hi \ud800 there"}, "prompt"),
    ({"decoding": {"\udc80": 1}}, "decoding"),
]


@pytest.mark.parametrize("extra,param", HOSTILE, ids=[p for _, p in HOSTILE])
def test_hostile_values_are_4xx_naming_the_field(server, extra, param):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})
    assert_client_error(r, param)


RAW = {
    "deep_array": b"[" * 100_000 + b"]" * 100_000,
    "deep_object": b'{"a": ' * 50 + b"1" + b"}" * 50,
    "huge_integer": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    "nan": b'{"prompt": "hi", "temperature": NaN}',
    "infinity": b'{"prompt": "hi", "top_p": -Infinity}',
    "lone_surrogate_key": b'{"prompt": "hi", "\\udc00": 1}',
    "not_utf8": b'{"prompt": "\xff\xfe"}',
    "not_an_object": b'"just a string"',
}


@pytest.mark.parametrize("name", list(RAW))
def test_malformed_bodies_are_400(server, name):
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        assert_client_error(post(server, path, content=RAW[name]))


def test_a_catastrophic_regex_is_bounded(server):
    """(.*.*)*\\x01 backtracks exponentially in Python's re on any text without \\x01 (14 chars
    took 5 s); the voting extractor runs it with RE2, off the engine thread."""
    body = {"prompt": "What is 12 + 30?", "max_tokens": 48,
            "decoding": {"voting": {"extractor": "regex", "pattern": "(.*.*)*\u0001"}}}
    t0 = time.monotonic()
    r = post(server, "/v1/completions", body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["voting"]["answer"] is None
    assert time.monotonic() - t0 < 60


def test_unknown_routes_and_methods_answer_json(server):
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------- fuzz

FIELDS = ["prompt", "messages", "segments", "max_tokens", "max_completion_tokens",
          "max_new_tokens", "temperature", "top_p", "seed", "stream", "stream_options", "model",
          "user", "n", "stop", "logprobs", "thinking", "decoding"]
DECODE_FIELDS = ["buffer_size", "accept_threshold", "add_block_threshold", "policy",
                 "steps_per_block", "factor", "sampling_mode", "edit_confirm", "block_activation",
                 "max_post_edit_steps", "max_nfe", "temperature", "seed", "max_new_tokens", "voting"]
extreme_ints = st.sampled_from([0, 1, 2, 3, -1, 2**31 - 1, 2**31, 2**63, -(2**63), 10**30])
extreme_floats = st.sampled_from([0.0, 0.5, 1.0, -0.0, 1e-300, 1e300, -1e300, 2.5, 800.0])
scalars = st.one_of(st.none(), st.booleans(), extreme_ints, st.integers(-10**6, 10**6),
                    extreme_floats, st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12),
                    st.sampled_from(["threshold", "edit", "context", "eager", "regex", "user"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
good_prompt = st.sampled_from(["Sort: 3 1 2", "hi", "What is 1+1?"])
voting = st.fixed_dictionaries({}, optional={
    "weighting": st.sampled_from(["fixed", "linear", "exp", "nope"]),
    "alpha": st.one_of(extreme_floats, values),
    "extractor": st.sampled_from(["last_number", "boxed", "regex"]),
    "pattern": st.one_of(st.sampled_from(["(\\d+)", "(a+)+$", "(.*.*)*\u0001", "(", "\\1"]),
                         st.text(max_size=8))})
decoding = st.dictionaries(st.sampled_from(DECODE_FIELDS),
                           st.one_of(values, extreme_ints, extreme_floats, voting), max_size=4)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot", 3]),
                                           "content": st.one_of(good_prompt, values)}), max_size=3)
body = st.dictionaries(st.sampled_from(FIELDS), values, max_size=5).flatmap(
    lambda extra: st.fixed_dictionaries({
        "prompt": good_prompt, "messages": messages,
        "segments": st.lists(good_prompt, min_size=1, max_size=3),
        "max_tokens": st.integers(1, 8), "decoding": decoding}).map(
        lambda base: {**base, **extra}))
routes = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"])


def send_and_check(client: httpx.Client, route: str, payload: dict,
                   refusals: list | None = None) -> int:
    """One fuzzed request: never a 5xx; a 4xx is a JSON error (kept in `refusals` with its
    body); a stream ends cleanly. Returns the status."""
    r = client.post(route, content=json.dumps(payload).encode())
    assert r.status_code < 500, (route, payload, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["code"] == r.status_code, r.text[:300]
        if refusals is not None:
            refusals.append((route, payload, err))
    elif payload.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    return r.status_code


def send_all(server, requests: list[tuple[str, dict]], refusals: list | None = None
             ) -> collections.Counter:
    """Sends every (route, body), eight at a time (the server's rows), through send_and_check;
    the status codes counted."""
    from concurrent.futures import ThreadPoolExecutor

    with httpx.Client(base_url=server.url, headers={**AUTH, "content-type": "application/json"},
                      timeout=120) as client, ThreadPoolExecutor(8) as pool:
        return collections.Counter(pool.map(
            lambda rp: send_and_check(client, *rp, refusals=refusals), requests))


@settings(max_examples=1500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(route=routes, payload=body, drop=st.sets(st.sampled_from(FIELDS)))
def _fuzz_one(out, route, payload, drop):
    payload = {k: v for k, v in payload.items() if k not in drop}
    if route == "/generate":  # its own field names
        payload.pop("prompt", None), payload.pop("messages", None)
        payload.pop("max_tokens", None)
    out.append((route, payload))


def test_fuzzed_requests_never_get_a_5xx_and_the_engine_survives(server):
    """1,500 generated bodies (extreme numbers, wrong types, nested junk, hostile patterns) on
    the three generation routes, eight in flight at a time: no 5xx, every 4xx a JSON error, and
    afterwards the engine still serves the fixed request exactly as before."""
    requests: list[tuple[str, dict]] = []
    _fuzz_one(requests)
    codes = send_all(server, requests)
    print("fuzz status codes:", dict(codes))
    assert sum(codes.values()) >= 1500, codes
    assert codes[200] > 50 and codes[400] > 200, codes
    assert_serves_as_before(server)


def from_schema(schema: dict, defs: dict, budget_cap: int = 8) -> st.SearchStrategy:
    """Values valid under a JSON schema, for the subset pydantic publishes (type, anyOf, enum,
    const, $ref, bounds, lengths, properties/required/additionalProperties). Token budgets are
    capped at `budget_cap` and n at 2 so 1,000 mostly valid requests fit the suite (large
    values are covered by HOSTILE and the hand-written fuzz above)."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":  # JSON Schema's integers include integer-valued numbers (37.0)
        low = schema.get("minimum", -(2**40))
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**64) - 1)
        ints = st.integers(low, high)
        if "not" in schema:
            ints = ints.filter(lambda v: v != schema["not"]["const"])
        return st.one_of(ints, ints.filter(lambda v: abs(v) < 2**53).map(float))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                         schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=24)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs),
                        min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" and "properties" in schema:
        props = {}
        for name, sub in schema["properties"].items():
            if name == "n":
                sub = {"type": "integer", "minimum": 1, "maximum": 2}
            elif name in ("max_tokens", "max_completion_tokens", "max_new_tokens", "max_nfe"):
                capped = {"type": "integer", "minimum": 1, "maximum": budget_cap}
                sub = {"anyOf": [capped, {"type": "null"}]} if "anyOf" in sub else capped
            props[name] = from_schema(sub, defs)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    if kind == "object":
        extra = schema.get("additionalProperties", True)
        return st.dictionaries(st.text(max_size=8), from_schema(extra, defs) if isinstance(
            extra, dict) else values, max_size=3)
    return values  # {}: any JSON value


# What a published schema cannot say: a voting pattern must compile as a regex (and an extractor
# of "regex" needs one), a text prompt must leave at least one token once tokenized, a
# structured output's schema, regex or grammar must compile (one such field per request), a
# tool choice must name an offered tool, and a message's content may be null only beside calls.
def inexpressible(err: dict) -> bool:
    param = err.get("param") or ""
    return (param.startswith(("decoding.voting", "response_format", "structured_outputs",
                              "guided_", "tools", "tool_choice"))
            or "structured output cannot be combined" in err["message"]
            or "need thinking off" in err["message"]
            or "it may be null only on an assistant turn" in err["message"]
            or "arguments must be a JSON object" in err["message"]
            or "empty prompt; give at least one token" in err["message"])


def test_requests_generated_from_the_published_schema_are_served(server):
    """1,000 requests generated from /openapi.json (from_schema above: its limits, the decoding
    fields' types and ranges, integers also as integer-valued numbers), eight in flight at a
    time: none is a 5xx, and any refusal is a JSON error for one of the few rules a schema cannot
    express (`inexpressible`), naming its field."""
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    defs = doc["components"]["schemas"]
    requests: list[tuple[str, dict]] = []
    for route, item in doc["paths"].items():
        ref = item["post"]["requestBody"]["content"]["application/json"]["schema"]
        bodies: list[dict] = []

        @settings(max_examples=334, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(payload=from_schema(ref, defs))
        def one(payload):
            bodies.append(payload)
        one()
        requests += [(route, b) for b in bodies]
    refusals: list = []
    codes = send_all(server, requests, refusals)
    print("schema fuzz status codes:", dict(codes))
    assert sum(codes.values()) >= 1000 and codes[200] > 400, codes
    odd = [(route, body, err) for route, body, err in refusals if not inexpressible(err)]
    assert not odd, {err['message'][:80]: (route, body) for route, body, err in odd}
    assert_serves_as_before(server)


# ------------------------------------------------------------------------------- lifecycle

def raw_request(port: int, body: dict) -> socket.socket:
    """A non-streaming request sent on a plain socket (so the test can hang up mid-request)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_accepted_connections_send_without_waiting_for_acks():
    """A response leaves in two writes (head, then body). With Nagle's algorithm on the accepted
    socket the body waits for the client's ACK of the head, which a kept-alive client delays by
    40 ms or more: every request after a connection's first paid that. asyncio turns Nagle off
    only for sockets made with proto IPPROTO_TCP, and serving/server.py's listening socket (like
    this one) has proto 0, so the service's protocol does it: here a real uvicorn server with
    that protocol answers a request, and its accepted socket has TCP_NODELAY set."""
    import asyncio

    import uvicorn

    from mbd_jax.serving.connections import guarded_protocol
    from mbd_jax.serving.metrics import Metrics

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def serve_one() -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # as server.listen makes it
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        server = uvicorn.Server(uvicorn.Config(app, http=guarded_protocol(8, 10.0, Metrics()),
                                               lifespan="off", log_config=None))
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:  # a server that fails to start ends its task: no endless wait
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*listener.getsockname())
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"ok")
        (connection,) = server.server_state.connections
        accepted = connection.transport.get_extra_info("socket")
        nodelay = accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        server.should_exit = True
        await task
        return nodelay

    assert asyncio.run(serve_one()) != 0


def test_a_non_streaming_client_that_hangs_up_frees_its_row(server):
    before = server.metrics()
    long = {"prompt": "hi", "max_tokens": 1000,
            "decoding": {"buffer_size": 1, "policy": "fixed_steps", "steps_per_block": 8}}
    socks = [raw_request(server.port, long) for _ in range(4)]  # every row busy
    assert wait_for(lambda: server.metrics()["mbd_busy_rows"] == 4, 30)
    for s in socks:
        s.close()
    assert wait_for(lambda: server.metrics()["mbd_busy_rows"] == 0, 30)
    after = server.metrics()
    gone = 'mbd_requests_total{"route": "completions", "status": "499"}'
    assert after[gone] == before.get(gone, 0) + 4
    assert after["mbd_request_seconds_count"] == before["mbd_request_seconds_count"]
    assert after["mbd_generated_tokens_total"] < before["mbd_generated_tokens_total"] + 4 * 1000
    assert_serves_as_before(server)


def test_request_id_is_echoed_only_when_clean(server):
    r = post(server, "/v1/completions", FIXED, headers={"x-request-id": "trace-42.a"})
    assert r.headers["x-request-id"] == "trace-42.a"
    r = post(server, "/v1/completions", FIXED, headers={"x-request-id": "evil\x7f\x01id"})
    assert r.status_code == 200 and r.headers["x-request-id"] != "evil\x7f\x01id"
    assert "\x01" not in server.log_text()


def test_key_guessing_is_rate_limited_and_401_says_how_to_authenticate(server):
    """Runs last in this module: it locks 127.0.0.1 out of authenticated routes for a while."""
    r = post(server, "/v1/completions", FIXED, headers={"Authorization": "Bearer guess-0"})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    codes = [post(server, "/v1/completions", FIXED,
                  headers={"Authorization": f"Bearer guess-{i}"}).status_code for i in range(1, 8)]
    assert codes[:4] == [401] * 4 and codes[-1] == 429, codes
    r = post(server, "/v1/completions", FIXED)  # even the right key waits: no guessing through
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ------------------------------------------------------------------------------- connections

def test_idle_and_slow_connections_are_capped_and_timed_out(tmp_path):
    """A cap of 16 connections: the 17th and later get a 503 at once instead of using up file
    descriptors; idle sockets, a client stalling in its headers and one stalling in its body
    are closed by the timeouts, after which /health answers again. Then SIGTERM with nothing in
    flight: the port keeps answering 503 (not refusing connections) for drain_min_s, exit 0."""
    srv = Server(tmp_path, [KEY], max_connections=16, header_timeout_s=1.0, body_timeout_s=1.0,
                 drain_min_s=3.0)
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(16)]
        time.sleep(0.2)
        extra = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(200)]
        answers = [s.recv(200) for s in extra[:5]]
        assert all(a.startswith(b"HTTP/1.1 503") for a in answers), answers
        for s in extra:
            s.close()
        for s in idle:  # closed by the server: recv sees the end of the stream
            s.settimeout(10)
            assert s.recv(10) == b""
            s.close()
        stall = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        stall.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes
        assert stall.recv(10) == b""
        slow_body = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nauthorization: Bearer "
                          + KEY.encode() + b"\r\ncontent-length: 100\r\n\r\n{\"prompt\"")
        assert b" 408 " in slow_body.recv(300).split(b"\r\n")[0]
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        m = srv.metrics()
        assert m["mbd_connections_refused_total"] >= 200 and m["mbd_connections_timed_out_total"] >= 17
        log = srv.log_text()
        assert "Traceback" not in log and len(log) < 20_000

        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 503  # not refused
        assert srv.proc.wait(timeout=60) == 0
        assert time.monotonic() - t0 >= 3.0  # the listener stayed up for drain_min_s
    finally:
        srv.stop()


# ------------------------------------------------------------------------------- shutdown

def test_drain_timeout_ends_requests_with_an_error_and_exits_non_zero(tmp_path):
    """SIGTERM with a stream and a plain request that outlast drain_timeout_s: the ports keep
    answering 503 (/ready too) while draining; the stream ends with a typed error event, the
    plain request with a JSON 503, and the exit code says accepted work was dropped."""
    srv = Server(tmp_path, [KEY], drain_timeout_s=1.0, drain_min_s=2.0,
                 generation_timeout_ms=600000)
    long = {"prompt": "hi", "max_tokens": 1000,
            "decoding": {"buffer_size": 1, "policy": "fixed_steps", "steps_per_block": 8}}

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers=AUTH) as c:
            started = asyncio.Event()

            async def stream():
                lines = []
                async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            started.set()  # its first block: it is decoding
                return lines

            streamed = asyncio.create_task(stream())
            plain = asyncio.create_task(c.post("/v1/completions", json=long))
            await asyncio.wait_for(started.wait(), 120)
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            ready = await c.get("/ready")
            refused = await c.post("/v1/completions", json=long)
            return await streamed, await plain, ready, refused

    try:
        lines, plain, ready, refused = asyncio.run(main())
        assert ready.status_code == 503
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        error = json.loads(lines[-2])["error"]
        assert lines[-1] == "[DONE]" and error["code"] == 503 and "shut down" in error["message"]
        assert plain.status_code == 503 and "drain_timeout_s" in plain.json()["error"]["message"]
        assert srv.proc.wait(timeout=60) == 3
    finally:
        srv.stop()


def test_repeated_log_lines_are_limited_and_counted():
    import logging

    from mbd_jax.serving.connections import RepeatFilter

    flt = RepeatFilter(burst=5, window_s=60.0)
    make = lambda: logging.LogRecord("asyncio", logging.ERROR, __file__, 1,  # noqa: E731
                                     "socket.accept() out of system resource", None, None)
    passed = [flt.filter(make()) for _ in range(1000)]
    assert sum(passed) == 5 and passed[:5] == [True] * 5
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "another message", None, None)
    assert flt.filter(other)  # a different line has its own budget
    flt._seen[("asyncio", logging.ERROR, "socket.accept() out of system resource")][0] -= 61
    record = make()
    assert flt.filter(record) and "995 similar messages suppressed" in record.getMessage()


def test_integer_valued_numbers_count_as_integers_and_the_schema_states_the_limits(server):
    """8.0 is JSON Schema's integer 8: the same answer as 8 for max_tokens, seed, n, top_k and a
    decoding field (8.5 stays a 400 naming the field); /openapi.json carries this server's
    limits: the token budget, the model name, token ids, N_buf."""
    body = {"prompt": "Sort: 3 1 2", "max_tokens": 8, "seed": 3, "n": 2, "top_k": 4,
            "temperature": 0.7, "decoding": {"max_nfe": 64}}
    floats = {**body, "max_tokens": 8.0, "seed": 3.0, "n": 2.0, "top_k": 4.0,
              "decoding": {"max_nfe": 64.0}}
    texts = [[c["text"] for c in post(server, "/v1/completions", b).json()["choices"]]
             for b in (body, floats)]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    r = post(server, "/v1/completions", {**body, "max_tokens": 8.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(server, "/v1/completions", {**body, "max_tokens": 2000})  # says what to send
    assert r.status_code == 400 and "got 2000: send 1024 or less" in r.json()["error"]["message"]
    schemas = httpx.get(server.url + "/openapi.json", timeout=10).json()["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == LIMITS["generation"]["max_new_tokens_limit"]
    assert props["model"]["anyOf"][0] == {"enum": ["tiny-test"]}
    ids = props["prompt"]["anyOf"][2]["items"]
    assert ids["minimum"] == 0 and ids["maximum"] > 0 and "const" in ids["not"]
    assert schemas["DecodeConfig"]["properties"]["buffer_size"]["maximum"] == 2
    assert schemas["DecodeConfig"]["additionalProperties"] is False
