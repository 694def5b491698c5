"""Prefill of one long prompt: seconds and prompt tokens/s per (engine rows, prefill chunk,
attention chunk), all in one process, against the attention FLOPs that prefill needs.

    python tools/bench_long_prefill.py --max-seq-len 16384 --prompt-len 8192 \
        --variants 1:256:64,8:256:64,8:256:1024

The model is a preset (default tiny-random, random weights) with `max_seq_len` raised. A variant
`ROWS:PREFILL_CHUNK:ATTENTION_CHUNK` builds an engine with ROWS rows and admits the prompt into one
of them; the timed part is the admission's prefill calls (compiled first). Prints one JSON object
per variant and a table (docs/performance.md, issue 16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random", help="a preset")
    ap.add_argument("--max-seq-len", type=int, default=16384)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--variants", default="1:256:64,8:256:64,1:256:1024,8:256:1024",
                    help="comma-separated ROWS:PREFILL_CHUNK:ATTENTION_CHUNK")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax
    import numpy as np

    from mbd_jax.config import DecodeConfig, load_model_config, resolve_model_path
    from mbd_jax.engine import Engine
    from mbd_jax.model.transformer import init_params

    base = dataclasses.replace(load_model_config(resolve_model_path(args.model)),
                               max_seq_len=args.max_seq_len, tokenizer=None)
    base.validate("model")
    params = init_params(base)
    prompt = np.random.default_rng(0).integers(10, base.vocab_size - 1, args.prompt_len).tolist()
    # Block-causal attention over the prompt: each query sees about half the prompt on average;
    # QK^T and PV are 2 FLOPs per multiply-add each, per layer and query head.
    p = args.prompt_len
    attn_flop = base.num_layers * base.num_heads * base.head_dim * 4 * p * p / 2
    rows = []
    for spec in args.variants.split(","):
        n_rows, chunk, att = (int(x) for x in spec.split(":"))
        cfg = dataclasses.replace(base, attention_chunk=att)
        engine = Engine(cfg, params, batch_size=n_rows, buffer_size=1, prefill_chunk=chunk)
        engine.warmup(buckets=engine.prefill_buckets_for([prompt]))
        t = time.perf_counter()
        adm = engine.begin_admit({0: (prompt, DecodeConfig(max_new_tokens=4))})
        calls = 1
        while not engine.prefill_step(adm):
            calls += 1
        jax.block_until_ready(engine.kv)
        seconds = time.perf_counter() - t
        row = {"rows": n_rows, "prefill_chunk": chunk, "attention_chunk": att,
               "prompt_len": p, "seconds": round(seconds, 3), "calls": calls,
               "prompt_tokens_per_s": round(p / seconds), "attention_gflop": round(attn_flop / 1e9, 2),
               "attention_gflops_achieved": round(attn_flop / seconds / 1e9, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| rows | prefill chunk | attention chunk | seconds | prompt tok/s | attention GFLOP/s |\n"
          "|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['rows']} | {r['prefill_chunk']} | {r['attention_chunk']} | {r['seconds']} | "
              f"{r['prompt_tokens_per_s']} | {r['attention_gflops_achieved']} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
