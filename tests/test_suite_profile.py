"""tools/suite_profile.py: the plugin records a test's wall time and its process's compile
events; the summary splits worker time into in-process compiling, tests working through
subprocesses and the rest."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from tests.live_server import ROOT


def load_tool():
    spec = importlib.util.spec_from_file_location("suite_profile",
                                                  ROOT / "tools" / "suite_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_splits_worker_time():
    tool = load_tool()
    rows = {"w1.jsonl": [{"id": "a", "wall": 10.0, "jaxpr_trace_duration": 1.0,
                          "jaxpr_to_mlir_module_duration": 0.5, "backend_compile_duration": 6.0,
                          "compile_time_saved_sec": 2.0},
                         {"id": "b", "wall": 20.0, "backend_compile_duration": 0.5}],
            "w2.jsonl": [{"id": "c", "wall": 1.0}]}
    s = tool.summarize(rows)
    assert (s["tests"], s["worker_seconds"]) == (3, 31.0)
    assert (s["in_process_trace_and_lower_s"], s["in_process_backend_compile_s"]) == (1.5, 6.5)
    assert (s["subprocess_tests"], s["subprocess_tests_s"]) == (1, 20.0)  # b: 0.5 s compiled
    # a's 2.5 s outside compiling, and c's 1 s (b's 19.5 s are counted as subprocess work)
    assert s["rest_s"] == 3.5 and s["persistent_cache_saved_s"] == 2.0
    assert s["per_worker_s"] == {"w1": 30.0, "w2": 1.0}


def test_the_plugin_records_each_test_and_its_compiles(tmp_path):
    (tmp_path / "test_one.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def test_compiles():\n"
        "    assert int(jax.jit(lambda x: x * 3 + 1)(jnp.int32(2))) == 7\n"
        "def test_compiles_nothing():\n"
        "    assert True\n")
    out = tmp_path / "profile"
    env = dict(os.environ, JAX_PLATFORMS="cpu", SUITE_PROFILE_DIR=str(out),
               PYTHONPATH=f"{ROOT / 'tools'}{os.pathsep}{ROOT}")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_profile",
                        "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path / "test_one.py")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (log,) = out.glob("worker-*.jsonl")
    rows = {row["id"].split("::")[1]: row for row in map(json.loads, log.read_text().splitlines())}
    assert set(rows) == {"test_compiles", "test_compiles_nothing"}
    assert rows["test_compiles"]["backend_compile_duration"] > 0
    assert "backend_compile_duration" not in rows["test_compiles_nothing"]
    report = subprocess.run([sys.executable, str(ROOT / "tools" / "suite_profile.py"), str(out)],
                            capture_output=True, text=True, timeout=60)
    assert json.loads(report.stdout)["tests"] == 2 and "test_compiles" in report.stderr


def test_the_report_reads_a_run_too_short_to_share(tmp_path):
    """Tests that took under 0.05 s in all round to a zero total: the report still prints, with
    no shares (it once divided by that zero)."""
    rows = [{"id": "t.py::test_a", "wall": 0.01}, {"id": "t.py::test_b", "wall": 0.02}]
    (tmp_path / "worker-gw0.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    report = subprocess.run([sys.executable, str(ROOT / "tools" / "suite_profile.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert summary["tests"] == 2 and summary["worker_seconds"] == 0.0
    assert "Traceback" not in report.stderr and "test_b" in report.stderr
