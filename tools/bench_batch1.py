"""Batch-1 requests on the held-out task prompts, one after another, per N_buf: where a
request's time goes (the decode calls, which include the wait for the prefill, and the rest:
admission, transfers, results) and what MultiBD gains over SingleBD. The buffer sizes alternate
within each round; medians over the rounds. JSON lines on stdout, a table on stderr.

    python tools/bench_batch1.py [--model tiny-mbd] [--buffer-size 1,2] [--rounds 3] [--limit 20]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import numpy as np

from mbd_jax.checkpoint import load_model
from mbd_jax.config import DecodeConfig, resolve_auto
from mbd_jax.engine import Engine
from mbd_jax.evaluate import table1_decode
from mbd_jax.train import tasks
import harness  # tools/harness.py, beside this file


def run(engine: Engine, prompts: list[np.ndarray], decode: DecodeConfig) -> dict:
    before = engine.stats()
    tokens = nfe = 0
    t = time.perf_counter()
    for p in prompts:
        (r,) = engine.generate([p], decode)
        tokens, nfe = tokens + r.output_tokens, nfe + r.nfe
    wall = time.perf_counter() - t
    decode_s = sum(s for s, _ in engine.stats().calls_since(before))
    return {"wall_ms_per_request": wall / len(prompts) * 1e3,
            "decode_ms_per_request": decode_s / len(prompts) * 1e3,
            "other_ms_per_request": (wall - decode_s) / len(prompts) * 1e3,
            "tokens_per_s": tokens / wall, "tpf": tokens / max(nfe, 1), "nfe": nfe}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="tiny-mbd")
    ap.add_argument("--buffer-size", type=harness.int_list(1), default=[1, 2])
    ap.add_argument("--rounds", type=harness.int_at_least(1), default=3)
    ap.add_argument("--limit", type=harness.int_at_least(1), default=20,
                    help="held-out prompts per task")
    ap.add_argument("--moe-impl", default="auto")
    args = ap.parse_args()
    m = load_model(args.model)
    cfg = dataclasses.replace(m.cfg, moe_impl=resolve_auto("moe_impl", args.moe_impl))
    prompts = [np.asarray(m.tokenizer.encode(ex.prompt), np.int32)
               for task in tasks.TASKS for ex in tasks.heldout(task, args.limit)]
    sizes = args.buffer_size
    engines, decodes = {}, {}
    for n in sizes:
        engines[n] = Engine(cfg, m.params, batch_size=1, buffer_size=n, tokenizer=m.tokenizer,
                            prefill_chunk=64)
        engines[n].warmup()
        decodes[n] = table1_decode(n)
        engines[n].generate(prompts[:5], decodes[n])  # the first calls' one-time costs
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for _ in range(args.rounds):
        for n in sizes:
            runs[n].append(run(engines[n], prompts, decodes[n]))
    rows = []
    for n in sizes:
        row = {"model": args.model, "moe_impl": cfg.moe_impl, "buffer_size": n,
               "requests": len(prompts), "rounds": args.rounds}
        for key in runs[n][0]:
            row[key] = round(statistics.median(r[key] for r in runs[n]), 3)
        row["tokens_per_s_runs"] = [round(r["tokens_per_s"], 1) for r in runs[n]]
        row["vs_first"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 3) if rows else 1.0
        rows.append(row)
    harness.report(rows, {"buffer_size": "N_buf", "wall_ms_per_request": "wall ms/req",
                          "decode_ms_per_request": "decode ms", "other_ms_per_request": "other ms",
                          "tpf": "TPF", "tokens_per_s": "tokens/s", "vs_first": "vs first"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
