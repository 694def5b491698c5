"""Bounded load run against the service on loopback: per concurrency level, clients loop on
streaming completions for a fixed time. Prints JSON (stdout) and a table (stderr); --plot writes a PNG.

    python tools/load_test.py [--url http://127.0.0.1:8000] [--concurrency 1,8,32,128]
                              [--seconds 20] [--api-key K] [--plot docs/load.png]
                              [--config configs/serve.yaml] [--set cache.storage_path=null ...]

Without --url it starts `mbd-jax serve --config CONFIG` (with the --set overrides, YAML values)
on free ports and stops it after. Request mix (fixed, seeded): prompts of 1-9 list items,
max_tokens uniform in 16..64. Every level counts non-200 answers and in-band error events.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(admin: str, name: str) -> float:
    """A sample of the admin port's /metrics (a counter `name` is exposed as `name_total`);
    NaN when the server does not report it (e.g. offload counters with the cache off)."""
    for line in httpx.get(admin + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "_total ")):
            return float(line.split()[1])
    return float("nan")


async def _client(c: httpx.AsyncClient, rng: random.Random, until: float, out: list) -> None:
    while time.monotonic() < until:
        items = " ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 9)))
        body = {"prompt": f"Sort: {items}", "max_tokens": rng.randint(16, 64), "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        first, tokens, status, error = None, 0, 0, None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"]
                if obj.get("choices") and obj["choices"][0].get("text") and first is None:
                    first = time.monotonic() - t0
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
        out.append({"status": status, "latency": time.monotonic() - t0, "first_block": first,
                    "tokens": tokens, "in_band_error": error})


async def run_level(url: str, key: str | None, concurrency: int, seconds: float) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers, limits=limits) as c:
        t0 = time.monotonic()
        until = t0 + seconds
        await asyncio.gather(*(_client(c, random.Random(i), until, results) for i in range(concurrency)))
        elapsed = time.monotonic() - t0
    ok = [r for r in results if r["status"] == 200 and r["in_band_error"] is None]
    lat = sorted(r["latency"] for r in ok)
    fb = sorted(r["first_block"] for r in ok if r["first_block"] is not None)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {"concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "statuses": statuses,
            "in_band_errors": sum(r["in_band_error"] is not None for r in results),
            "requests_per_s": len(ok) / elapsed, "tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "p50_latency_s": q(lat, 0.5), "p99_latency_s": q(lat, 0.99),
            "p50_first_block_s": q(fb, 0.5), "p99_first_block_s": q(fb, 0.99),
            "median_latency_s": statistics.median(lat) if lat else float("nan")}


def with_overrides(config: pathlib.Path, overrides: list[str]) -> pathlib.Path:
    """A copy of `config` (in a fresh temporary folder) with `overrides` applied, each
    section.field=YAML value."""
    cfg = yaml.safe_load(config.read_text()) or {}
    for item in overrides:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        cfg.setdefault(section, {})[field] = yaml.safe_load(value)
    path = pathlib.Path(tempfile.mkdtemp(prefix="mbd-load-")) / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_server(config: pathlib.Path, overrides: list[str], keys: str = "") -> tuple:
    """`mbd-jax serve` on free ports with `overrides` (section.field=YAML value) applied to
    `config`; returns (process, url, admin url) once /ready is 200."""
    path = with_overrides(config, overrides)
    port, admin_port = _free_port(), _free_port()
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    proc = subprocess.Popen([sys.executable, "-m", "mbd_jax", "serve", "--config", str(path),
                             "--port", str(port), "--admin-port", str(admin_port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, MBD_API_KEYS=keys))
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url, admin
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("the server did not become ready")
        time.sleep(0.5)


def main() -> int:
    import harness  # tools/harness.py, beside this file (tests load this module alone)

    ap = harness.parser(__doc__)
    ap.add_argument("--url")
    ap.add_argument("--admin-url")
    ap.add_argument("--api-key")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--plot")
    ap.add_argument("--config", default=str(ROOT / "configs/serve.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override a serve config field of the started server (repeatable)")
    args = ap.parse_args()
    proc = None
    url, admin = args.url, args.admin_url
    if url is None:
        proc, url, admin = start_server(pathlib.Path(args.config), args.set)
    try:
        compiles_warm = _metric(admin, "mbd_compilations") if admin else float("nan")
        levels = [asyncio.run(run_level(url, args.api_key, int(c), args.seconds))
                  for c in args.concurrency.split(",")]
        compiles_after = (_metric(admin, "mbd_compilations") - compiles_warm) if admin else float("nan")
        offload = {name: _metric(admin, name) if admin else float("nan") for name in (
            "mbd_kv_offload_blocking_waits", "mbd_kv_offload_deferred_calls",
            "mbd_prefix_cache_disk_dropped")}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    report = {"url": url, "seconds": args.seconds, "config": args.config, "set": args.set,
              "levels": levels, "compilations_after_warmup": compiles_after, **offload}
    cols = ["concurrency", "ok", "in_band_errors", "requests_per_s", "tokens_per_s", "p50_latency_s", "p99_latency_s",
            "p50_first_block_s", "p99_first_block_s"]
    print(" ".join(f"{c:>18}" for c in cols), file=sys.stderr)
    for lv in levels:
        print(" ".join(f"{lv[c]:>18.4g}" if isinstance(lv[c], float) else f"{lv[c]:>18}" for c in cols),
              file=sys.stderr)
    print(f"compilations after warm-up: {compiles_after:g}; offload: {offload}", file=sys.stderr)
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
