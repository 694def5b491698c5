"""Several models on the same held-out prompts: accuracy, TPF and tokens/s per task and pooled,
for each buffer size and question format (the attention-only vs hybrid table; any models
with a tokenizer).

    python tools/compare_models.py --models runs/a-model,runs/b-model --buffer-size 1,2 [--limit 20]
                                   [--formats chat,system,multiturn,raw] [--tasks arith,sort]
                                   [--threshold 0.95,0.9] [--semi-complete-threshold 0.25,0]
                                   [--add-block-threshold 0.1]

Prints JSON (stdout) and a table (stderr). Decoding: Table 1's settings (evaluate.table1_decode);
the three threshold flags take comma-separated values and sweep every combination (decode
settings are runtime arguments: one engine per model and buffer size serves them all).
"""

from __future__ import annotations

import itertools
import json
import pathlib
import sys
import harness  # tools/harness.py, beside this file

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import Engine
    from mbd_jax.errors import UserError
    from mbd_jax.evaluate import evaluate_tasks, pool, table1_decode, task_names
    from mbd_jax.train import tasks

    ap = harness.parser(__doc__)
    ap.add_argument("--models", required=True, help="comma-separated models (names or directories)")
    ap.add_argument("--buffer-size", default="1,2", help="comma-separated N_buf values")
    ap.add_argument("--formats", default="chat", help=f"comma-separated: {', '.join(tasks.FORMATS)}")
    ap.add_argument("--limit", type=int, default=20, help="held-out prompts per task")
    ap.add_argument("--tasks", default="all",
                    help=f"{tasks.EVAL_TASKS_HELP} (default: all)")
    ap.add_argument("--batch-size", type=harness.int_at_least(1), default=16)
    for flag in ("threshold", "semi-complete-threshold", "add-block-threshold"):
        ap.add_argument(f"--{flag}", help="comma-separated values (default: table1_decode's)")
    args = ap.parse_args()
    try:  # every decode config of the run, validated before any model loads
        buffers = [int(b) for b in args.buffer_size.split(",")]
        sweep = {key: [float(v) for v in value.split(",")] if value else [None]
                 for key, value in (("accept_threshold", args.threshold),
                                    ("semi_complete_threshold", args.semi_complete_threshold),
                                    ("add_block_threshold", args.add_block_threshold))}
        decodes = {n_buf: [table1_decode(n_buf, **dict(zip(sweep, values)))
                           for values in itertools.product(*sweep.values())] for n_buf in buffers}
    except (ValueError, UserError) as e:
        ap.error(f"--buffer-size / decode thresholds: {e}")
    formats = args.formats.split(",")
    if bad := [f for f in formats if f not in tasks.FORMATS]:
        ap.error(f"--formats: unknown {', '.join(bad)}; allowed: {', '.join(tasks.FORMATS)}")
    try:
        names = task_names(args.tasks, args.limit, where="--tasks")
    except UserError as e:
        ap.error(str(e))
    out = []
    for name in args.models.split(","):
        model = load_model(name)
        for n_buf in decodes:
            engine = Engine(model.cfg, model.params, batch_size=args.batch_size,
                            buffer_size=n_buf, tokenizer=model.tokenizer)
            engine.warmup()
            for fmt, decode in itertools.product(formats, decodes[n_buf]):
                reports = evaluate_tasks(model, decode, engine, limit=args.limit, fmt=fmt,
                                         names=names)
                row = {"model": name, "buffer_size": n_buf, "format": fmt,
                       "decode": {k: getattr(decode, k) for k in sweep}, **pool(reports),
                       "tasks": {r.task: r.accuracy for r in reports}}
                out.append(row)
                print(f"{name} N_buf={n_buf} {fmt} {_settings(row)} acc={row['accuracy']:.3f} "
                      f"tpf={row['tpf']:.2f} tok/s={row['tokens_per_s']:.0f}", file=sys.stderr,
                      flush=True)
    print("\n| model | N_buf | format | tau accept / semi / add | accuracy | TPF | tokens/s | "
          + " | ".join(names) + " |\n|---|---|---|---|---|---|---|" + "---|" * len(names),
          file=sys.stderr)
    for o in out:
        cells = " | ".join(f"{100 * o['tasks'][t]:.0f}" for t in names)
        print(f"| {o['model']} | {o['buffer_size']} | {o['format']} | {_settings(o)} | "
              f"{100 * o['accuracy']:.1f} | {o['tpf']:.2f} | {o['tokens_per_s']:.0f} | {cells} |",
              file=sys.stderr)
    print(json.dumps({"limit_per_task": args.limit, "results": out}))


def _settings(row: dict) -> str:
    d = row["decode"]
    return (f"{d['accept_threshold']:g} / {d['semi_complete_threshold']:g} / "
            f"{d['add_block_threshold']:g}")


if __name__ == "__main__":
    main()
