"""Several models on the same held-out prompts: accuracy, TPF and tokens/s per task and pooled,
for each buffer size (issue 17's attention-only vs hybrid table; any models with a tokenizer).

    python tools/compare_models.py --models runs/a-model,runs/b-model --buffer-size 1,2 [--limit 20]

Prints JSON (stdout) and a table (stderr). Decoding: tools/table1.py's main setting (accept
threshold 0.95, add-block 0.1, semi-complete 0.25).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import decode_config
    from mbd_jax.engine import Engine
    from mbd_jax.evaluate import evaluate, pool
    from mbd_jax.train import tasks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="comma-separated models (names or directories)")
    ap.add_argument("--buffer-size", default="1,2", help="comma-separated N_buf values")
    ap.add_argument("--limit", type=int, default=20, help="held-out prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    buffers = [int(b) for b in args.buffer_size.split(",")]
    names = list(tasks.TASKS)
    out = []
    for name in args.models.split(","):
        model = load_model(name)
        for n_buf in buffers:
            engine = Engine(model.cfg, model.params, batch_size=args.batch_size,
                            buffer_size=n_buf, tokenizer=model.tokenizer)
            engine.warmup()
            decode = decode_config(buffer_size=n_buf, accept_threshold=0.95,
                                   add_block_threshold=0.1, semi_complete_threshold=0.25,
                                   max_new_tokens=args.max_new_tokens)
            reports = [evaluate(model, t, decode, limit=args.limit, engine=engine) for t in names]
            row = {"model": name, "buffer_size": n_buf, **pool(reports),
                   "tasks": {r.task: r.accuracy for r in reports}}
            out.append(row)
            print(f"{name} N_buf={n_buf} acc={row['accuracy']:.3f} tpf={row['tpf']:.2f} "
                  f"tok/s={row['tokens_per_s']:.0f}", file=sys.stderr, flush=True)
    print("\n| model | N_buf | accuracy | TPF | tokens/s | " + " | ".join(names) + " |\n|---|---|---|"
          "---|---|" + "---|" * len(names), file=sys.stderr)
    for o in out:
        cells = " | ".join(f"{100 * o['tasks'][t]:.0f}" for t in names)
        print(f"| {o['model']} | {o['buffer_size']} | {100 * o['accuracy']:.1f} | {o['tpf']:.2f} | "
              f"{o['tokens_per_s']:.0f} | {cells} |", file=sys.stderr)
    print(json.dumps({"limit_per_task": args.limit, "results": out}))


if __name__ == "__main__":
    main()
