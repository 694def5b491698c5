"""Seconds from `mbd-jax serve` to /ready, and to every prefill bucket compiled, cold and warm.

    .venv/bin/python tools/bench_startup.py [--rounds 3] [--config configs/serve.yaml]

Each round starts the service (the shipped config unless told) on free ports with a fresh
compilation cache directory (cold: every program compiled), then again on that directory (warm:
programs read back), and polls /ready every 50 ms: `ready_s` is when it turns 200 (the decode
loop and the smallest prefill bucket compiled), `all_buckets_s` when its `prefill_chunk_compiled`
reaches `prefill_chunk` (the background compiles done). Medians over the rounds.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from load_test import _free_port  # noqa: E402


def start_once(config: str, cache: str) -> dict[str, float]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mbd_jax", "serve", "--config", config,
                             "--port", str(port), "--admin-port", "0", "--compile-cache", cache],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, MBD_API_KEYS=""))
    out: dict[str, float] = {}
    try:
        while time.monotonic() < t0 + 600 and proc.poll() is None:
            try:
                r = httpx.get(url + "/ready", timeout=2)
            except httpx.TransportError:
                r = None
            if r is not None and r.status_code == 200:
                out.setdefault("ready_s", time.monotonic() - t0)
                body = r.json()  # (a service without background buckets: all at once)
                if body.get("prefill_chunk_compiled") == body.get("prefill_chunk"):
                    out["all_buckets_s"] = time.monotonic() - t0
                    return out
            time.sleep(0.05)
        raise SystemExit(f"the service did not become ready (exit code {proc.poll()})")
    finally:
        proc.kill()
        proc.wait(30)


def main() -> int:
    import harness

    ap = harness.parser(__doc__)
    ap.add_argument("--rounds", type=harness.int_at_least(1), default=3)
    ap.add_argument("--config", default=str(ROOT / "configs" / "serve.yaml"))
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            for kind in ("cold", "warm"):
                runs[kind].append(start_once(args.config, cache))
    rows = [{"cache": kind, "rounds": args.rounds,
             **{k: round(statistics.median(r[k] for r in got), 2)
                for k in ("ready_s", "all_buckets_s")}} for kind, got in runs.items()]
    harness.report(rows, {"cache": "compile cache", "ready_s": "to /ready s",
                          "all_buckets_s": "to every bucket s"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
