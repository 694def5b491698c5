"""Accuracy and TPF grouped by answer length (output blocks, the EOS counted), for models at given
buffer sizes on the same held-out prompts: whether MultiBD's TPF gain grows with the answer.

    python tools/tpf_by_length.py --runs tiny-bd:1,tiny-mbd:2,tiny-mbd:3:eager [--tasks sort,sortrev,reverse] [--limit 60]

A run is MODEL:N_BUF, or MODEL:N_BUF:ACTIVATION (DecodeConfig.block_activation: progress, the
default, or eager). Decoding: Table 1's settings (evaluate.table1_decode). JSON on stdout, a table
on stderr.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
import harness  # tools/harness.py, beside this file

ROOT = pathlib.Path(__file__).resolve().parent.parent


def parse_run(run: str):
    """MODEL:N_BUF[:ACTIVATION] -> (model, DecodeConfig)."""
    import typing

    from mbd_jax.config import BlockActivation
    from mbd_jax.evaluate import table1_decode

    head, _, last = run.rpartition(":")
    activation = None
    if last in typing.get_args(BlockActivation):
        activation, (head, _, last) = last, head.rpartition(":")
    return head, table1_decode(int(last), block_activation=activation)


def main() -> None:
    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import Engine
    from mbd_jax.errors import UserError
    from mbd_jax.evaluate import task_names
    from mbd_jax.train import tasks

    ap = harness.parser(__doc__)
    ap.add_argument("--runs", required=True,
                    help="comma-separated MODEL:N_BUF or MODEL:N_BUF:ACTIVATION (progress, eager)")
    ap.add_argument("--tasks", default="sort,sortrev,reverse",
                    help=tasks.EVAL_TASKS_HELP)
    ap.add_argument("--limit", type=int, default=60, help="held-out prompts per task")
    ap.add_argument("--batch-size", type=harness.int_at_least(1), default=16)
    args = ap.parse_args()
    try:
        names = task_names(args.tasks, args.limit, where="--tasks")
        runs = [parse_run(r) for r in args.runs.split(",")]
    except (UserError, ValueError) as e:
        ap.error(f"--tasks / --runs (MODEL:N_BUF[:ACTIVATION],...): {e}")
    examples = [ex for name in names for ex in tasks.heldout(name, args.limit)]
    out = []
    for name, decode in runs:
        n_buf = decode.buffer_size
        model = load_model(name)
        prompts = [model.tokenizer.encode(ex.prompt) for ex in examples]
        engine = Engine(model.cfg, model.params, batch_size=args.batch_size, buffer_size=n_buf,
                        tokenizer=model.tokenizer)
        engine.warmup(buckets=engine.prefill_buckets_for(prompts))
        block = model.cfg.block_size
        groups = collections.defaultdict(lambda: {"n": 0, "correct": 0, "tokens": 0, "nfe": 0})
        for s in range(0, len(prompts), engine.batch_size):
            results = engine.generate(prompts[s: s + engine.batch_size], decode)
            for ex, r in zip(examples[s: s + engine.batch_size], results):
                g = groups[-(-r.output_tokens // block)]
                g["n"] += 1
                g["correct"] += ex.is_correct(r.text)
                g["tokens"] += r.output_tokens
                g["nfe"] += r.nfe
        for blocks in sorted(groups):
            g = groups[blocks]
            out.append({"model": name, "buffer_size": n_buf,
                        "block_activation": decode.block_activation, "blocks": blocks, **g,
                        "accuracy": g["correct"] / g["n"], "tpf": g["tokens"] / max(g["nfe"], 1)})
    print("\n| model | N_buf | activation | answer blocks | prompts | accuracy % | TPF |\n"
          "|---|---|---|---|---|---|---|", file=sys.stderr)
    for o in out:
        print(f"| {o['model']} | {o['buffer_size']} | {o['block_activation']} | {o['blocks']} | {o['n']} | "
              f"{100 * o['accuracy']:.0f} | {o['tpf']:.2f} |", file=sys.stderr)
    print(json.dumps({"tasks": names, "limit_per_task": args.limit, "results": out}))


if __name__ == "__main__":
    main()
