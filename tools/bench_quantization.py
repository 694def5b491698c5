"""8-bit weights and KV pool against float on one model: accuracy and TPF per task on the held-out
prompts, decode tokens/s (the settings interleaved, medians), bytes of the weights, of the KV pool
and of one prefix block as the prefix store keeps it (each engine has a RAM store).

    python tools/bench_quantization.py [--model tiny-mbd] [--settings float,int8,fp8,kv-int8,int8+kv-int8]
                                       [--limit 20] [--batch 16] [--new-tokens 64] [--repeats 5]

A setting names the weights' scheme (float, int8, fp8), the KV pool's (kv-int8, kv-fp8), or both
joined by `+`. Decoding: Table 1's MBD settings (evaluate.table1_decode, N_buf 2). The timed runs
decode random prompts for exactly --new-tokens (EOS ignored), every setting once per repeat in
turn, so a noisy machine slows them alike. JSON lines on stdout, the table on stderr.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import harness  # tools/harness.py, beside this file
import numpy as np


def runtime(setting: str) -> dict[str, str]:
    """`int8+kv-fp8` -> {"quantization": "int8", "kv_quantization": "fp8"}."""
    out = {}
    for part in setting.split("+"):
        if part.startswith("kv-"):
            out["kv_quantization"] = part.removeprefix("kv-")
        elif part != "float":
            out["quantization"] = part
    return out


def main() -> int:
    import jax

    from mbd_jax.cache.prefix_store import PrefixStore
    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import Engine
    from mbd_jax.evaluate import evaluate_tasks, pool, table1_decode

    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="tiny-mbd")
    ap.add_argument("--settings", default="float,int8,fp8,kv-int8,int8+kv-int8")
    ap.add_argument("--limit", type=harness.int_at_least(1), default=20,
                    help="held-out prompts per task")
    ap.add_argument("--batch", type=harness.int_at_least(1), default=16)
    ap.add_argument("--new-tokens", type=harness.int_at_least(1), default=64)
    ap.add_argument("--repeats", type=harness.int_at_least(1), default=5)
    args = ap.parse_args()

    decode = table1_decode(2)
    runs = {}
    for setting in args.settings.split(","):
        print(f"[bench_quantization] {setting}: load, compile, evaluate", file=sys.stderr,
              flush=True)
        model = load_model(args.model, runtime=runtime(setting))
        store = PrefixStore(setting, model.cfg.block_size, ram_bytes=1 << 26)
        engine = Engine(model.cfg, model.params, batch_size=args.batch, buffer_size=2,
                        tokenizer=model.tokenizer, prefix_store=store)
        reports = evaluate_tasks(model, decode, engine, limit=args.limit)
        block, block_dtype = store.entry_spec[""]  # what the engine stores per block
        runs[setting] = {
            "setting": setting, **pool(reports),
            **{f"acc_{r.task}": r.accuracy for r in reports},
            "param_mb": sum(a.nbytes for a in jax.tree.leaves(model.params)) / 2**20,
            "kv_mb": engine.stats().kv_bytes / 2**20,
            "block_entry_kb": int(np.prod(block)) * block_dtype.itemsize / 1024,
            "engine": engine, "model": model, "tokens_per_s": []}
    rng = np.random.default_rng(0)
    first = next(iter(runs.values()))["model"].cfg
    banned = {first.mask_token_id, *first.eos_token_ids}
    allowed = np.array([i for i in range(first.vocab_size) if i not in banned], np.int32)
    prompts = [rng.choice(allowed, 32).tolist() for _ in range(args.batch)]
    timed = dataclasses.replace(decode, max_new_tokens=args.new_tokens, ignore_eos=True)
    for run in runs.values():
        run["engine"].generate(prompts, timed)  # the programs these prompts use, compiled
    for _ in range(args.repeats):
        for run in runs.values():
            t = time.perf_counter()
            results = run["engine"].generate(prompts, timed)
            run["tokens_per_s"].append(sum(len(r.token_ids) for r in results)
                                       / (time.perf_counter() - t))
    rows = []
    for run in runs.values():
        run.pop("engine"), run.pop("model")
        rows.append({**run, "tokens_per_s": statistics.median(run["tokens_per_s"])})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_first"] = row["tokens_per_s"] / base
    harness.report(rows, {"setting": "setting", "accuracy": "accuracy (pooled)", "tpf": "TPF",
                          "tokens_per_s": "decode tok/s (median)",
                          "speed_vs_first": "vs first", "param_mb": "weights MB",
                          "kv_mb": "KV pool MB", "block_entry_kb": "stored block KB"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
