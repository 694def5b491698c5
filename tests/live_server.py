"""A real `mbd-jax serve` process on free loopback ports, for the service tests."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import ssl
import subprocess
import sys
import time

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = "test-key-0123456789"


def self_signed_certificate(tmp: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A fresh self-signed certificate for 127.0.0.1 / localhost: (cert.pem, key.pem)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# For a server that answers many requests in a test: its programs compiled with LLVM's
# optimisation passes, which the suite otherwise leaves out (tests/conftest.py): the hardening
# fuzz spends 49 s serving its 1,000 requests so compiled, 72 s without.
OPTIMISED = {"XLA_FLAGS": ""}


class Server:
    def __init__(self, tmp: pathlib.Path, keys: list, sections: dict | None = None,
                 args: tuple[str, ...] = (), env: dict | None = None, admin: bool = True,
                 tls: tuple[pathlib.Path, pathlib.Path] | None = None, warm: bool = True,
                 **server_overrides):
        """tls: (cert, key) serves the data port over HTTPS; `verify` is then a client context
        that trusts that certificate. `warm`: return once every program is compiled (the
        larger prefill buckets compile after /ready turns 200), not at /ready."""
        self.tmp = tmp
        self.port, self.admin_port = free_port(), free_port() if admin else 0
        cfg = {
            "model": "tiny-test",
            "generation": {"max_new_tokens": 24, "max_new_tokens_limit": 1024},
            "decoding": {"buffer_size": 2},
            "server": {"max_batch_size": 8, "buffer_size": 2, "prefill_chunk": 64,
                       "steps_per_call": 8, "queue_size": 128, "max_body_bytes": 65536,
                       "max_segments": 8, **server_overrides},
            "monitoring": {"log_level": "warning"},
            **(sections or {}),
        }
        (tmp / "serve.yaml").write_text(yaml.safe_dump(cfg))
        (tmp / "keys.txt").write_text(  # named keys (dicts) as YAML, plain ones a line each
            yaml.safe_dump(keys) if keys and isinstance(keys[0], dict) else "\n".join(keys) + "\n")
        self.log = open(tmp / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mbd_jax", "serve", "--config", str(tmp / "serve.yaml"),
             "--port", str(self.port), "--admin-port", str(self.admin_port),
             "--api-key-file", str(tmp / "keys.txt"),
             *(("--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])) if tls else ()),
             *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.verify = ssl.create_default_context(cafile=str(tls[0])) if tls else True
        self.admin = f"http://127.0.0.1:{self.admin_port or self.port}"  # no admin port: the data port
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (tmp / "server.log").read_text()
            try:
                r = httpx.get(self.url + "/ready", timeout=2, verify=self.verify)
                if r.status_code == 200 and (not warm or r.json()["prefill_chunk_compiled"]
                                             == r.json()["prefill_chunk"]):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server not ready")

    def openai_client(self, key: str = KEY, **kw):
        """The official openai client on this server's data port (no retries: a test sees every
        error)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120,
                             **kw)

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
