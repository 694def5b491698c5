"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time and the
JAX compile events of the test process (tracing, lowering, XLA's backend compile, persistent-cache
reads), one JSON line per test in $SUITE_PROFILE_DIR (default /tmp/mbd-suite-profile), a file per
worker; and, run as a script, the summary table of docs/performance.md.

    rm -rf /tmp/mbd-suite-profile
    PYTHONPATH=tools .venv/bin/python -m pytest -q -p suite_profile -n 2 --dist worksteal
    .venv/bin/python tools/suite_profile.py [DIR] [--top 20]

Subprocesses (servers, CLIs, multi-device runs) report no events here: a test whose process
compiled almost nothing but ran for seconds did its work through them.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import pathlib
import sys
import time

import pytest

DIR = os.environ.get("SUITE_PROFILE_DIR", "/tmp/mbd-suite-profile")
COMPILE = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
_totals: collections.Counter = collections.Counter()
_listening = False


def _on_duration(event: str, duration: float, **_: object) -> None:
    _totals[event.rsplit("/", 1)[-1]] += duration


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Wraps each test (setup, call, teardown). JAX is imported here, not at plugin load, so
    tests/conftest.py still sets XLA_FLAGS and the compilation cache before JAX starts."""
    global _listening
    if not _listening:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True
    _totals.clear()
    start = time.perf_counter()
    yield
    row = {"id": item.nodeid, "wall": round(time.perf_counter() - start, 2),
           **{k: round(v, 2) for k, v in _totals.items() if v >= 0.01}}
    pathlib.Path(DIR).mkdir(parents=True, exist_ok=True)
    with open(pathlib.Path(DIR) / f"worker-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def compile_seconds(row: dict) -> float:
    return sum(row.get(k, 0.0) for k in COMPILE)


def summarize(rows_by_worker: dict[str, list[dict]]) -> dict:
    """The table's figures: in-process compile by kind, tests that work through subprocesses
    (under 2 s compiled in-process, over 3 s of wall), the rest; per worker."""
    rows = [r for rs in rows_by_worker.values() for r in rs]
    wall = sum(r["wall"] for r in rows)
    sub = [r for r in rows if compile_seconds(r) < 2 and r["wall"] > 3]
    compiled = sum(compile_seconds(r) for r in rows)
    return {
        "tests": len(rows), "worker_seconds": round(wall, 1),
        "in_process_trace_and_lower_s": round(sum(
            r.get(k, 0.0) for r in rows for k in COMPILE[:2]), 1),
        "in_process_backend_compile_s": round(sum(r.get(COMPILE[2], 0.0) for r in rows), 1),
        "persistent_cache_saved_s": round(sum(r.get("compile_time_saved_sec", 0.0)
                                              for r in rows), 1),
        "subprocess_tests": len(sub), "subprocess_tests_s": round(sum(r["wall"] for r in sub), 1),
        "rest_s": round(wall - compiled - sum(r["wall"] - compile_seconds(r) for r in sub), 1),
        "per_worker_s": {pathlib.Path(w).stem: round(sum(r["wall"] for r in rs), 1)
                         for w, rs in rows_by_worker.items()},
    }


def main() -> None:
    import harness  # tools/harness.py, beside this file (the plugin half needs nothing of it)

    ap = harness.parser(__doc__)
    ap.add_argument("dir", nargs="?", default=DIR)
    ap.add_argument("--top", type=int, default=20, help="the slowest tests listed")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.dir, "worker-*.jsonl")))
    if not files:
        sys.exit(f"no worker-*.jsonl under {args.dir}: run pytest with -p suite_profile first")
    by_worker = {f: [json.loads(line) for line in pathlib.Path(f).read_text().splitlines()]
                 for f in files}
    summary = summarize(by_worker)
    print(json.dumps(summary))

    def share(seconds: float) -> str:  # "-" where the tests took under 0.05 s in all
        total = summary["worker_seconds"]
        return f"{100 * seconds / total:.0f}%" if total else "-"

    print(f"{'':58} {'worker-s':>9} {'share':>6}", file=sys.stderr)
    for label, key in (("in-process tracing + lowering", "in_process_trace_and_lower_s"),
                       ("in-process XLA backend compile", "in_process_backend_compile_s"),
                       (f"tests through subprocesses ({summary['subprocess_tests']})",
                        "subprocess_tests_s"),
                       ("in-process, the rest (running, Python, fixtures)", "rest_s")):
        print(f"{label:58} {summary[key]:>9} {share(summary[key]):>6}", file=sys.stderr)
    print(f"{'persistent-cache reads saved in-process':58} "
          f"{summary['persistent_cache_saved_s']:>9}", file=sys.stderr)
    rows = sorted((r for rs in by_worker.values() for r in rs), key=lambda r: -r["wall"])
    for r in rows[:args.top]:
        print(f"{r['wall']:7.1f} s  compile {compile_seconds(r):5.1f} s  {r['id']}", file=sys.stderr)


if __name__ == "__main__":
    main()
