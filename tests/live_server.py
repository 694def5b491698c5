"""A real `mbd-jax serve` process on free loopback ports, for the service tests."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = "test-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: pathlib.Path, keys: list[str], sections: dict | None = None,
                 args: tuple[str, ...] = (), env: dict | None = None, admin: bool = True,
                 **server_overrides):
        self.tmp = tmp
        self.port, self.admin_port = free_port(), free_port() if admin else 0
        cfg = {
            "model": "tiny-random",
            "generation": {"max_new_tokens": 24, "max_new_tokens_limit": 1024},
            "decoding": {"buffer_size": 2},
            "server": {"max_batch_size": 8, "buffer_size": 2, "prefill_chunk": 64,
                       "steps_per_call": 8, "queue_size": 128, "max_body_bytes": 65536,
                       "max_segments": 8, **server_overrides},
            "monitoring": {"log_level": "warning"},
            **(sections or {}),
        }
        (tmp / "serve.yaml").write_text(yaml.safe_dump(cfg))
        (tmp / "keys.txt").write_text("\n".join(keys) + "\n")
        self.log = open(tmp / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mbd_jax", "serve", "--config", str(tmp / "serve.yaml"),
             "--port", str(self.port), "--admin-port", str(self.admin_port),
             "--api-key-file", str(tmp / "keys.txt"), *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port or self.port}"  # no admin port: the data port
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (tmp / "server.log").read_text()
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server not ready")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.admin + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
                out[key] = s.value
        return out

    def log_text(self) -> str:
        self.log.flush()
        return (self.tmp / "server.log").read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()
