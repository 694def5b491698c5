"""What building an engine again costs in one process (engine/programs.py): the first engine's
warm-up (every program compiled, each written to a fresh persistent compilation cache), a second
engine of the same model and shapes (its programs shared), and a third after `programs.clear()`
(every program traced and lowered again, XLA's compile read back from the persistent cache: what
each new engine cost before the programs were shared).

    python docs/lab/probes/bench_rebuild.py [--model tiny-random] [--batch 8] [--buffer-size 2] [--moe-impl measure]

Prints one JSON object (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import typing

os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mbd-jax-rebuild-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

from mbd_jax import compile_stats  # noqa: E402
from mbd_jax.checkpoint import load_model  # noqa: E402
from mbd_jax.config import MoeImpl  # noqa: E402
from mbd_jax.engine import Engine, programs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--buffer-size", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--moe-impl", choices=typing.get_args(MoeImpl),
                    help="the expert path (default: the model's); measure times its candidates")
    args = ap.parse_args()
    m = load_model(args.model, runtime={"moe_impl": args.moe_impl} if args.moe_impl else None)

    def warm() -> dict:
        c0, t0 = compile_stats.compiles(), time.perf_counter()
        Engine(m.cfg, m.params, batch_size=args.batch, buffer_size=args.buffer_size,
               prefill_chunk=args.prefill_chunk).warmup()
        return {"warmup_s": round(time.perf_counter() - t0, 3),
                "compiles": compile_stats.compiles() - c0}

    rows = {"first": warm(), "rebuilt, shared": warm()}
    programs.clear()
    rows["rebuilt, from the persistent cache"] = warm()
    print(json.dumps({"model": args.model, "moe_impl": args.moe_impl, "batch": args.batch,
                      "buffer_size": args.buffer_size, "prefill_chunk": args.prefill_chunk,
                      "rows": rows}))
    print(f"{'engine':36} {'warm-up s':>10} {'compiles':>9}", file=sys.stderr)
    for name, r in rows.items():
        print(f"{name:36} {r['warmup_s']:>10} {r['compiles']:>9}", file=sys.stderr)


if __name__ == "__main__":
    main()
