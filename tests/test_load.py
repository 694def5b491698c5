"""A small load run in CI on the shipped configuration (configs/serve.yaml: the default model, the
prefix cache with its disk tier on): 32 streaming clients for 10 s get no refusal, no in-band
error, and the engine never waits on KV persistence. tools/load_test.py runs the big one."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx

from tests.live_server import ROOT


def load_tool():
    spec = importlib.util.spec_from_file_location("load_test", ROOT / "tools" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_32_clients_on_the_default_config(tmp_path):
    tool = load_tool()
    proc, url, admin = tool.start_server(ROOT / "configs" / "serve.yaml",
                                         [f"cache.storage_path={tmp_path / 'kv'}"])
    try:
        level = asyncio.run(tool.run_level(url, None, 32, 10.0))
        metrics = httpx.get(admin + "/metrics", timeout=10).text
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0  # a clean drain
    assert level["requests"] >= 32 and level["statuses"] == {"200": level["requests"]}, level
    assert level["in_band_errors"] == 0 and level["ok"] == level["requests"], level
    assert level["tokens_per_s"] > 0
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    assert values["mbd_kv_offload_blocking_waits_total"] == 0
    assert values["mbd_prefix_cache_disk_entries"] > 0  # the disk tier was really written
    assert values["mbd_engine_failures_total"] == 0
