"""Bounded load run against the service on loopback: per concurrency level, clients loop on
streaming completions for a fixed time. Prints JSON (stdout) and a table (stderr); --plot writes a PNG.

    python tools/load_test.py [--url http://127.0.0.1:8000] [--concurrency 1,8,32,128]
                              [--seconds 20] [--api-key K] [--plot docs/load.png]

Without --url it starts `mbd-jax serve --config configs/serve.yaml` on free ports and stops it after.
Request mix (fixed, seeded): prompts of 1-9 list items, max_tokens uniform in 16..64.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(admin: str, name: str) -> float:
    for line in httpx.get(admin + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def _client(c: httpx.AsyncClient, rng: random.Random, until: float, out: list) -> None:
    while time.monotonic() < until:
        items = " ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 9)))
        body = {"prompt": f"Sort: {items}", "max_tokens": rng.randint(16, 64), "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        first, tokens, status = None, 0, 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("choices") and obj["choices"][0].get("text") and first is None:
                    first = time.monotonic() - t0
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
        out.append({"status": status, "latency": time.monotonic() - t0, "first_block": first,
                    "tokens": tokens})


async def run_level(url: str, key: str | None, concurrency: int, seconds: float) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers, limits=limits) as c:
        t0 = time.monotonic()
        until = t0 + seconds
        await asyncio.gather(*(_client(c, random.Random(i), until, results) for i in range(concurrency)))
        elapsed = time.monotonic() - t0
    ok = [r for r in results if r["status"] == 200]
    lat = sorted(r["latency"] for r in ok)
    fb = sorted(r["first_block"] for r in ok if r["first_block"] is not None)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "requests_per_s": len(ok) / elapsed, "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "p50_latency_s": q(lat, 0.5), "p99_latency_s": q(lat, 0.99),
            "p50_first_block_s": q(fb, 0.5), "p99_first_block_s": q(fb, 0.99),
            "median_latency_s": statistics.median(lat) if lat else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url")
    ap.add_argument("--admin-url")
    ap.add_argument("--api-key")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--plot")
    args = ap.parse_args()
    proc = None
    url, admin = args.url, args.admin_url
    if url is None:
        port, admin_port = _free_port(), _free_port()
        url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        proc = subprocess.Popen([sys.executable, "-m", "mbd_jax", "serve", "--config",
                                 str(ROOT / "configs/serve.yaml"), "--port", str(port),
                                 "--admin-port", str(admin_port)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, MBD_API_KEYS=""))
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not become ready")
            time.sleep(0.5)
    try:
        compiles_warm = _metric(admin, "mbd_compilations") if admin else float("nan")
        levels = [asyncio.run(run_level(url, args.api_key, int(c), args.seconds))
                  for c in args.concurrency.split(",")]
        compiles_after = (_metric(admin, "mbd_compilations") - compiles_warm) if admin else float("nan")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    report = {"url": url, "seconds": args.seconds, "levels": levels,
              "compilations_after_warmup": compiles_after}
    cols = ["concurrency", "ok", "requests_per_s", "tokens_per_s", "p50_latency_s", "p99_latency_s",
            "p50_first_block_s", "p99_first_block_s"]
    print(" ".join(f"{c:>18}" for c in cols), file=sys.stderr)
    for lv in levels:
        print(" ".join(f"{lv[c]:>18.4g}" if isinstance(lv[c], float) else f"{lv[c]:>18}" for c in cols),
              file=sys.stderr)
    print(f"compilations after warm-up: {compiles_after:g}", file=sys.stderr)
    print(json.dumps(report))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [lv["concurrency"] for lv in levels]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(xs, [lv["tokens_per_s"] for lv in levels], "o-")
        a.set(xscale="log", xlabel="concurrent clients", ylabel="tokens/s", title="throughput")
        for key, label in (("p50_latency_s", "p50 latency"), ("p99_latency_s", "p99 latency"),
                           ("p50_first_block_s", "p50 first block")):
            b.plot(xs, [lv[key] for lv in levels], "o-", label=label)
        b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="seconds",
              title="latency")
        b.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
