"""The scheduler's admission order, fifo against dynamic, on a mixed-length load.

    .venv/bin/python tools/bench_scheduler.py [--rounds 3] [--seconds 20] [--concurrency 16]

Per round, each order in turn (interleaved, so drift hits both alike) gets a fresh
`mbd-jax serve` with the shipped config and `scheduler.type` set, and the same seeded closed-
loop load: `--concurrency` clients, each sending streamed completions back to back, a fifth of
them long prompts (a recall list of 18 to 30 pairs, about 105 to 175 tokens), a tenth thinking
chats, the rest short sort prompts; max_tokens 16 to 48. Reports tokens/s, p50 / p99 latency
of all requests and p99 of the thinking ones, medians over rounds.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import statistics
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from load_test import start_server  # noqa: E402


def request(rng: random.Random) -> tuple[str, str, dict]:
    """(kind, route, body) of one request of the mix."""
    roll = rng.random()
    budget = rng.randint(16, 48)
    if roll < 0.1:
        items = " ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 6)))
        return "thinking", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Sort and reverse: {items}"}],
            "thinking": True, "max_tokens": budget}
    if roll < 0.3:
        pairs = " ".join(f"{chr(97 + i % 26)}{i}={rng.randint(0, 9)}"
                         for i in range(rng.randint(18, 30)))
        return "long", "/v1/completions", {"prompt": f"Recall a0 in: {pairs}", "max_tokens": budget}
    items = " ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(2, 8)))
    return "short", "/v1/completions", {"prompt": f"Sort: {items}", "max_tokens": budget}


async def client(c: httpx.AsyncClient, rng: random.Random, until: float, out: list) -> None:
    while time.monotonic() < until:
        kind, route, body = request(rng)
        t0 = time.monotonic()
        tokens, status = 0, 0
        try:
            async with c.stream("POST", route, json={**body, "stream": True, "stream_options":
                                                     {"include_usage": True}}) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        if obj.get("usage"):
                            tokens = obj["usage"]["completion_tokens"]
        except httpx.HTTPError:  # counted as not ok (status 0)
            status = 0
        out.append({"kind": kind, "status": status, "latency": time.monotonic() - t0,
                    "tokens": tokens})


async def load(url: str, concurrency: int, seconds: float) -> dict:
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(client(c, random.Random(i), t0 + seconds, results)
                               for i in range(concurrency)))
        elapsed = time.monotonic() - t0
    ok = [r for r in results if r["status"] == 200]
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    lat = [r["latency"] for r in ok]
    return {"requests": len(results), "ok": len(ok),
            "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "p50_latency_s": q(lat, 0.5), "p99_latency_s": q(lat, 0.99),
            "p99_thinking_s": q([r["latency"] for r in ok if r["kind"] == "thinking"], 0.99),
            "p99_long_s": q([r["latency"] for r in ok if r["kind"] == "long"], 0.99)}


def main() -> int:
    import harness

    ap = harness.parser(__doc__)
    ap.add_argument("--rounds", type=harness.int_at_least(1), default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=harness.int_at_least(1), default=16)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"fifo": [], "dynamic": []}
    for _ in range(args.rounds):
        for kind in runs:
            proc, url, _ = start_server(ROOT / "configs" / "serve.yaml",
                                        [f"scheduler.type={kind}", "cache.enabled=false"])
            try:
                asyncio.run(load(url, args.concurrency, 3.0))  # first touches, not measured
                runs[kind].append(asyncio.run(load(url, args.concurrency, args.seconds)))
            finally:
                proc.terminate()
                proc.wait(60)
    keys = ("tokens_per_s", "p50_latency_s", "p99_latency_s", "p99_thinking_s", "p99_long_s")
    rows = [{"scheduler": kind, "rounds": args.rounds,
             "requests": sum(r["requests"] for r in got), "ok": sum(r["ok"] for r in got),
             **{k: round(statistics.median(r[k] for r in got), 3) for k in keys}}
            for kind, got in runs.items()]
    harness.report(rows, {"scheduler": "scheduler", "tokens_per_s": "tokens/s",
                          "p50_latency_s": "p50 s", "p99_latency_s": "p99 s",
                          "p99_thinking_s": "thinking p99 s", "p99_long_s": "long p99 s"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
