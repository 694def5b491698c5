"""Prefill of a full batch admitted at once: one call per row against one call shared by every
row, per prompt length (what sets engine.ROW_PREFILL_MIN).

    python docs/lab/probes/bench_prefill_rows.py --model tiny-random --prompt-lens 16,48,128

An engine of --rows rows (prefill chunk 128) admits --rows prompts of each length together; the
timed part is the admission's prefill calls, once with every chunk run per row
(row_prefill_min = block size) and once with every chunk shared (row_prefill_min above any
chunk), interleaved, median of --repeats. Prints one JSON object per length and a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random", help="a preset (random weights)")
    ap.add_argument("--prompt-lens", default="16,48,128")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    import jax
    import numpy as np

    from mbd_jax.config import DecodeConfig, load_model_config, resolve_model_path
    from mbd_jax.engine import Engine
    from mbd_jax.model.transformer import init_params

    cfg = dataclasses.replace(load_model_config(resolve_model_path(args.model)), tokenizer=None)
    cfg.validate("model")
    params = init_params(cfg)
    rng = np.random.default_rng(0)
    out = []
    for n in (int(x) for x in args.prompt_lens.split(",")):
        prompts = {i: (rng.integers(10, cfg.vocab_size - 1, n).tolist(),
                       DecodeConfig(max_new_tokens=4)) for i in range(args.rows)}
        kinds = {"per_row": cfg.block_size, "shared": 10**9}
        engines = {k: Engine(cfg, params, batch_size=args.rows, prefill_chunk=128,
                             row_prefill_min=m) for k, m in kinds.items()}
        for e in engines.values():
            e.warmup(buckets=e.prefill_buckets_for([p for p, _ in prompts.values()]))
        times: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(args.repeats):
            for k, e in engines.items():
                t = time.perf_counter()
                adm = e.begin_admit(prompts)
                while not e.prefill_step(adm):
                    pass
                jax.block_until_ready(e.kv)
                times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": args.model, "prompt_len": n, "rows": args.rows,
               "per_row_s": round(med["per_row"], 4), "shared_s": round(med["shared"], 4),
               "per_row_over_shared": round(med["per_row"] / med["shared"], 2)}
        out.append(row)
        print(json.dumps(row), flush=True)
    print("\n| model | prompt tokens | per row / shared |\n|---|---|---|", file=sys.stderr)
    for r in out:
        print(f"| {r['model']} | {r['prompt_len']} | {r['per_row_over_shared']} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
