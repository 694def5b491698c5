"""Per-request cost at batch 1, piece by piece: building the empty state, begin_admit (the row's
fresh state on the device), prefill, the merge, decoding, results. JSON on stdout, a table on
stderr; medians over --repeats requests, per buffer size.

    python docs/lab/probes/bench_admission.py [--model tiny-mbd] [--repeats 30] [--buffer-size 1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

from mbd_jax import chat
from mbd_jax.checkpoint import load_model
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine

PARTS = ("empty_state", "begin_admit", "prefill", "merge", "decode", "results", "total")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mbd")
    ap.add_argument("--prompt", default="Sort: 7 2 9 4 1 8")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--buffer-size", default="1,2")
    args = ap.parse_args()
    m = load_model(args.model)
    prompt = np.asarray(m.tokenizer.encode(chat.render([{"role": "user", "content": args.prompt}],
                                                       template=m.cfg.chat_template)), np.int32)
    rows = []
    for n_buf in (int(x) for x in args.buffer_size.split(",")):
        e = Engine(m.cfg, m.params, batch_size=1, buffer_size=n_buf, tokenizer=m.tokenizer,
                   prefill_chunk=64)
        e.warmup()
        d = DecodeConfig(buffer_size=n_buf, add_block_threshold=0.1, semi_complete_threshold=0.25,
                         max_new_tokens=32)
        ms = {k: [] for k in PARTS}
        for _ in range(args.repeats):
            t = [time.perf_counter()]
            st = jax.block_until_ready(e.empty_state())
            t.append(time.perf_counter())
            adm = e.begin_admit({0: (prompt, d)})
            jax.block_until_ready(adm.fresh)
            t.append(time.perf_counter())
            while not e.prefill_step(adm):
                pass
            jax.block_until_ready(e.kv)
            t.append(time.perf_counter())
            st = jax.block_until_ready(e.finish_admit(st, adm))
            t.append(time.perf_counter())
            st = jax.block_until_ready(e.run_decode(st))
            t.append(time.perf_counter())
            (r,) = e.results(st, 1, 0.0, [d])
            t.append(time.perf_counter())
            for k, a, b in zip(PARTS, t, t[1:]):
                ms[k].append((b - a) * 1e3)
            ms["total"].append((t[-1] - t[0]) * 1e3)
        row = {"buffer_size": n_buf, "nfe": r.nfe, "tokens": len(r.token_ids),
               **{f"{k}_ms": round(statistics.median(v), 3) for k, v in ms.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'N_buf':>6} " + " ".join(f"{k:>12}" for k in PARTS) + "   (ms, medians)", file=sys.stderr)
    for row in rows:
        print(f"{row['buffer_size']:>6} " + " ".join(f"{row[k + '_ms']:>12.2f}" for k in PARTS),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
