"""Disk-tier cost as the store grows: what a block write costs at 100 / 10,000 / 100,000 entries.

    python docs/lab/probes/bench_disk_tier.py [--entries 100,10000,100000] [--writes 500] [--entry-kb 1]

For each size N a fresh store is filled to exactly N entries (its byte cap), then `--writes`
more blocks are put, each one evicting the oldest. Reported per size (medians):
  put_us          what `put` costs its caller (the offload drain thread): RAM insert + queueing
  write_us        the writer thread's time per block (file write + rename + eviction), from the
                  wall time of flushing the writes
  legacy_scan_ms  what every write cost before the in-memory index: one glob + stat of the whole
                  directory (measured here on the same directory, for the side-by-side)
  restart_s       a new store indexing the directory (startup only)
Prints JSON (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from mbd_jax.cache.prefix_store import PrefixStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", default="100,10000,100000")
    ap.add_argument("--writes", type=int, default=500)
    ap.add_argument("--entry-kb", type=int, default=1)
    args = ap.parse_args()

    entry = np.random.default_rng(0).standard_normal(args.entry_kb * 256).astype(np.float32)
    file_bytes = entry.nbytes + 112  # the header
    rows = []
    for n in (int(x) for x in args.entries.split(",")):
        with tempfile.TemporaryDirectory(prefix="mbd-disk-bench-") as tmp:
            store = PrefixStore("bench", 8, ram_bytes=0, storage_path=tmp,
                                disk_bytes=n * file_bytes)
            t0 = time.perf_counter()
            for i in range(n):
                store.put(f"{i:064x}", entry)
                if i % 1000 == 999:
                    store.flush()  # keep the queue from dropping while filling
            store.flush()
            fill_s = time.perf_counter() - t0
            assert store.stats.disk_entries == n, store.stats
            put_us = []
            t0 = time.perf_counter()
            for i in range(n, n + args.writes):
                t = time.perf_counter()
                store.put(f"{i:064x}", entry)
                put_us.append((time.perf_counter() - t) * 1e6)
            store.flush()
            write_us = (time.perf_counter() - t0) * 1e6 / args.writes
            assert store.stats.disk_entries == n and store.stats.disk_dropped == 0, store.stats
            directory = store._disk
            scans = []
            for _ in range(3):
                t = time.perf_counter()
                files = sorted(directory.glob("*.kv"), key=lambda p: p.stat().st_mtime)
                sum(p.stat().st_size for p in files)
                scans.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            again = PrefixStore("bench", 8, ram_bytes=0, storage_path=tmp, disk_bytes=n * file_bytes)
            restart_s = time.perf_counter() - t
            assert again.stats.disk_entries == n
            store.close()
            again.close()
        rows.append({"entries": n, "put_us": statistics.median(put_us), "write_us": write_us,
                     "legacy_scan_ms": statistics.median(scans), "restart_s": restart_s,
                     "fill_s": fill_s})
        print(f"  {n} entries done", file=sys.stderr, flush=True)

    cols = ["entries", "put_us", "write_us", "legacy_scan_ms", "restart_s"]
    print(" ".join(f"{c:>15}" for c in cols), file=sys.stderr)
    for r in rows:
        print(" ".join(f"{r[c]:>15.4g}" if isinstance(r[c], float) else f"{r[c]:>15}" for c in cols),
              file=sys.stderr)
    print(json.dumps({"entry_bytes": int(entry.nbytes), "writes": args.writes, "rows": rows}))


if __name__ == "__main__":
    main()
