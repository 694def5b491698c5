"""The decode step's sampler alone (decoding/policy.py predict): milliseconds per call at a
vocabulary size, greedy, temperature sampling, and temperature with top-k / top-p.

    python tools/bench_policy.py [--vocab 157184] [--rows 4] [--window 32] [--repeats 7]

Random logits [rows, window, vocab], one jitted predict per mode, medians of `repeats` calls
after a warm one. The same script run on another commit's checkout (it calls `predict` and
reads its first two outputs) compares two samplers on one machine. JSON on stdout, a table on
stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MODES = {"greedy": (0.0, 0, 1.0), "sample": (1.0, 0, 1.0), "top_k_top_p": (1.0, 40, 0.9)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=157184)  # LLaDA2's vocabulary
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from mbd_jax.decoding import policy

    b, w, v = args.rows, args.window, args.vocab
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(b, w, v)).astype(np.float32) * 3)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(b))
    out = {"rows": b, "window": w, "vocab": v, "ms_median": {}}
    for mode, (t, k, p) in MODES.items():
        fn = jax.jit(lambda lg, t=t, k=k, p=p: policy.predict(
            lg, 0, jnp.full(b, t), jnp.full(b, k, jnp.int32), jnp.full(b, p), keys)[:2])
        jax.block_until_ready(fn(logits))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(logits))
            times.append(time.perf_counter() - t0)
        out["ms_median"][mode] = round(statistics.median(times) * 1e3, 2)
    print(json.dumps(out))
    print(f"| mode | ms per call ({b} x {w} positions, vocab {v}) |\n|---|---|", file=sys.stderr)
    for mode, ms in out["ms_median"].items():
        print(f"| {mode} | {ms} |", file=sys.stderr)


if __name__ == "__main__":
    main()
