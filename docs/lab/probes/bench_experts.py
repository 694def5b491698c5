"""The looped expert path alone, stacked against per-expert weights, and against another revision.

    python docs/lab/probes/bench_experts.py [--tokens 4,64,256] [--experts 16] [--hidden 384] [--width 256]
                                  [--topk 4] [--rounds 7] [--calls 20] [--against REV]

Times `moe.experts_looped` jitted on random float32 weights and a random top-k routing, one
variant after another in interleaved rounds (the order flips every round), medians of ms per call:
this tree's function over stacked [E, D, F] weights and over per-expert arrays
(model/layout.py), and with `--against REV` the same function as git revision REV has it
(mbd_jax/model/moe.py read with `git show`; over stacked weights, and per-expert ones if REV has
them). Every variant's output is checked against this tree's dense path first. The defaults are
tools/bench_vs_torch.py's 34M MoE layer. JSON on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def load_revision(rev: str, tmp: pathlib.Path):
    """mbd_jax/model/moe.py as revision `rev` has it, as a module (its imports: this tree's)."""
    src = subprocess.run(["git", "show", f"{rev}:mbd_jax/model/moe.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = tmp / f"moe_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"moe_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4,64,256", help="comma-separated tokens per call")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls timed per variant and round")
    ap.add_argument("--against", help="a git revision whose experts_looped to time too")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from mbd_jax.model import moe

    e, d, f, k = args.experts, args.hidden, args.width, args.topk
    rng = np.random.default_rng(0)
    stacked = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.05)
               for s in ((e, d, f), (e, d, f), (e, f, d))]
    split = [tuple(jnp.unstack(w)) for w in stacked]
    with tempfile.TemporaryDirectory() as tmp:
        modules = {"this tree": moe}
        if args.against:
            modules[args.against] = load_revision(args.against, pathlib.Path(tmp))
        variants = {}  # name -> (function, weights)
        for label, module in modules.items():
            variants[f"{label}, stacked"] = (jax.jit(module.experts_looped), stacked)
            if hasattr(module, "stacked"):  # per-expert weights exist there
                variants[f"{label}, per expert"] = (jax.jit(module.experts_looped), split)
        rows = []
        for n in map(int, args.tokens.split(",")):
            x = jnp.asarray(rng.standard_normal((n, d), np.float32))
            ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
                              .astype(np.int32))
            w = jnp.full((n, k), 1.0 / k, jnp.float32)
            want = np.asarray(moe.experts_dense(x, ids, w, *stacked))
            for name, (fn, ws) in variants.items():
                np.testing.assert_allclose(np.asarray(fn(x, ids, w, *ws)), want, atol=1e-4,
                                           err_msg=name)
            times = {name: [] for name in variants}
            names = list(variants)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    fn, ws = variants[name]
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn(x, ids, w, *ws).block_until_ready()
                    times[name].append((time.perf_counter() - t0) / args.calls * 1e3)
            first = statistics.median(times[names[0]])
            for name in names:
                ms = statistics.median(times[name])
                rows.append({"tokens": n, "variant": name, "ms": round(ms, 3),
                             "vs_first": round(ms / first, 3),
                             "ms_runs": [round(t, 3) for t in times[name]]})
    print(f"{'tokens':>6} {'variant':32s} {'ms/call':>8} {'vs first':>8}", file=sys.stderr)
    for row in rows:
        print(f"{row['tokens']:6d} {row['variant']:32s} {row['ms']:8.3f} {row['vs_first']:7.2f}x",
              file=sys.stderr)
    print(json.dumps({"experts": e, "hidden": d, "width": f, "topk": k, "rounds": args.rounds,
                      "calls": args.calls, "rows": rows}))


if __name__ == "__main__":
    main()
