"""The delta rule's block outputs (model/delta_rule.block_outputs) at one chunk size against
another: what `gated_deltanet._chunk` chooses between (one block per chunk on CPU).

    python docs/lab/probes/bench_delta_rule.py [--rows 8] [--tokens 256] [--block 8] [--chunks 8,64]
                                     [--heads 16,32] [--dims 128,128] [--repeats 7]

Shapes default to a 256-token prefill of the 35B-A3B preset's linear heads (16 key heads, 32
value heads, dims 128). Each chunk size is compiled once, then timed in alternation; medians.
Prints JSON (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import jax
    import numpy as np

    from mbd_jax.model import delta_rule

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--chunks", default="8,64", help="comma-separated, multiples of --block")
    ap.add_argument("--heads", default="16,32", help="key heads, value heads")
    ap.add_argument("--dims", default="128,128", help="key dim, value dim")
    ap.add_argument("--mode", default="bidirectional", choices=delta_rule.BLOCK_MODES)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    hk, hv = (int(x) for x in args.heads.split(","))
    dk, dv = (int(x) for x in args.dims.split(","))
    chunks = [int(c) for c in args.chunks.split(",")]
    b, t = args.rows, args.tokens
    rng = np.random.default_rng(0)
    normal = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    x = [jax.device_put(a) for a in (
        normal(b, t, hk, dk), normal(b, t, hk, dk), normal(b, t, hv, dv),
        -0.1 * np.abs(normal(b, t, hv)), 1 / (1 + np.exp(-normal(b, t, hv))), normal(b, hv, dk, dv))]
    fns = {c: jax.jit(lambda *a, c=c: delta_rule.block_outputs(*a, args.block, args.mode, chunk=c))
           for c in chunks}
    for f in fns.values():
        jax.block_until_ready(f(*x))
    times = {c: [] for c in chunks}
    for _ in range(args.repeats):
        for c, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*x))
            times[c].append(time.perf_counter() - t0)
    rows = [{"chunk": c, "ms": 1e3 * statistics.median(v)} for c, v in times.items()]
    print(f"{jax.default_backend()}: {b} rows x {t} tokens, block {args.block}, heads {hk}/{hv}, "
          f"dims {dk}/{dv}, {args.mode}; medians of {args.repeats}\n\n| chunk | ms | vs first |\n"
          "|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['chunk']} | {r['ms']:.2f} | {r['ms'] / rows[0]['ms']:.2f}x |", file=sys.stderr)
    print(json.dumps({"backend": jax.default_backend(), "rows": b, "tokens": t,
                      "block": args.block, "heads": [hk, hv], "dims": [dk, dv],
                      "mode": args.mode, "results": rows}))


if __name__ == "__main__":
    main()
