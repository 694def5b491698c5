"""The shape of the MBD paper's Table 1 on the shipped tiny models, in one run on the same prompts.

    python tools/table1.py [--limit 50] [--thresholds 0.5,0.7,0.8,0.9,0.95,0.99] [--plot docs/table1.png]
                           [--bd tiny-bd] [--mbd tiny-mbd] [--tasks all] > run.json
    python tools/table1.py --plot-from run.json --plot docs/table1.png   # redraw, no run

Rows: SingleBD (the BD model, N_buf 1), training-free MultiBD (the BD model, N_buf N), MBD (the
MultiTF model, N_buf N; N: --buffer-size, default the G_max the MultiTF model was trained with,
from its manifest, as the paper decodes with N_buf = G_max), both again with eager block
activation (every slot of the buffer active at once rather than one more block per forward once
the last is tau_add full), MBD eager with the factor policy, MBD with the edit sampling mode
(every block confirmed by a forward that changes nothing in it, then only the blocks written
ahead of an unfinished one: edit_confirm "context"), with the factor policy, with the factor
policy at f = 2 and the context-confirmed edit mode together, with the thinking switch on (the
same questions; the answer after the worked trace is checked, and the trace's tokens count as
output), and the MultiTF model with SingleBD for reference. Columns: accuracy, TPF, tokens/s per
task and pooled over every task's held-out split (`limit` prompts per task, the chat format;
--tasks: the suite by default, or any tasks eval takes, the trial's too). The main table uses
accept threshold 0.95; every threshold in --thresholds gives one point of the accuracy-vs-TPF
plot (rows with the threshold policy). --bd / --mbd take any model (a run's output directory
before it ships). Prints JSON (stdout) and tables (stderr).
"""

from __future__ import annotations

import json
import pathlib
import sys
import harness  # tools/harness.py, beside this file

ROOT = pathlib.Path(__file__).resolve().parent.parent

MULTI = 0  # in ROWS: the MultiBD buffer (--buffer-size)
ROWS = [  # (label, which model, N_buf, decode settings beyond the threshold policy's, format)
    ("SingleBD", "bd", 1, {}, "chat"),
    ("training-free MultiBD", "bd", MULTI, {}, "chat"),
    ("MBD (MultiTF + MultiBD)", "mbd", MULTI, {}, "chat"),
    ("training-free MultiBD, eager", "bd", MULTI, {"block_activation": "eager"}, "chat"),
    ("MBD, eager activation", "mbd", MULTI, {"block_activation": "eager"}, "chat"),
    ("MBD, eager + factor policy", "mbd", MULTI,
     {"block_activation": "eager", "policy": "factor", "factor": 1.0}, "chat"),
    ("MBD, edit mode", "mbd", MULTI, {"sampling_mode": "edit"}, "chat"),
    ("MBD, edit mode, context confirm", "mbd", MULTI,
     {"sampling_mode": "edit", "edit_confirm": "context"}, "chat"),
    ("MBD, factor policy", "mbd", MULTI, {"policy": "factor", "factor": 1.0}, "chat"),
    ("MBD, factor 2 + edit (context)", "mbd", MULTI,
     {"policy": "factor", "factor": 2.0, "sampling_mode": "edit", "edit_confirm": "context"}, "chat"),
    ("MBD, thinking on", "mbd", MULTI, {}, "thinking"),
    ("MultiTF model, SingleBD", "mbd", 1, {}, "chat"),
]


def trained_g_max(model) -> int | None:
    """The G_max a trained model's MultiTF stage used (its manifest), None if not recorded."""
    manifest = model.path.parent / "manifest.json"
    if not manifest.exists():
        return None
    train = json.loads(manifest.read_text()).get("train_config") or {}
    return train.get("g_max") if train.get("objective") == "multitf" else None


def main() -> None:
    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import Engine
    from mbd_jax.errors import UserError
    from mbd_jax.evaluate import evaluate_tasks, pool, table1_decode, task_names
    from mbd_jax.train import tasks

    ap = harness.parser(__doc__)
    ap.add_argument("--limit", type=harness.int_at_least(1), default=50, help="held-out prompts per task")
    ap.add_argument("--thresholds", default="0.5,0.7,0.8,0.9,0.95,0.99")
    ap.add_argument("--main-threshold", type=float, default=0.95)
    ap.add_argument("--add-block-threshold", type=float, help="default: evaluate.table1_decode's")
    ap.add_argument("--semi-complete-threshold", type=float, help="default: table1_decode's")
    ap.add_argument("--max-new-tokens", type=int, help="default: table1_decode's")
    ap.add_argument("--batch-size", type=harness.int_at_least(1), default=16)
    ap.add_argument("--tasks", default="all", help=f"{tasks.EVAL_TASKS_HELP} (default: all)")
    ap.add_argument("--bd", default="tiny-bd", help="the block-diffusion (SingleBD) model")
    ap.add_argument("--mbd", default="tiny-mbd", help="the MultiTF post-trained model")
    ap.add_argument("--buffer-size", type=harness.int_at_least(2),
                    help="N_buf of the MultiBD rows (default: the --mbd model's trained G_max)")
    ap.add_argument("--plot", help="write the accuracy-vs-TPF plot here (PNG)")
    ap.add_argument("--plot-from", metavar="RUN.json",
                    help="no run: draw --plot from a run's saved JSON (this tool's stdout)")
    args = ap.parse_args()
    if args.plot_from and not args.plot:
        ap.error("--plot-from needs --plot (where to write the PNG)")
    if args.plot:  # say so before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install -e '.[bench]'")
    if args.plot_from:
        try:
            results = json.loads(pathlib.Path(args.plot_from).read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--plot-from {args.plot_from}: not a saved run of this tool ({e})")
        plot(results, args.plot)
        return
    thresholds = sorted({float(t) for t in args.thresholds.split(",")} | {args.main_threshold})
    try:
        names = task_names(args.tasks, args.limit, where="--tasks")
    except UserError as e:
        ap.error(str(e))

    models = {"bd": load_model(args.bd), "mbd": load_model(args.mbd)}
    multi = args.buffer_size or trained_g_max(models["mbd"]) or 2
    print(f"MultiBD rows: N_buf {multi}", file=sys.stderr)
    out = []
    for label, which, n_buf, extra, fmt in ROWS:
        n_buf = multi if n_buf == MULTI else n_buf
        model = models[which]
        engine = Engine(model.cfg, model.params, batch_size=args.batch_size, buffer_size=n_buf,
                        tokenizer=model.tokenizer)
        engine.warmup()
        sweep = thresholds if extra.get("policy", "threshold") == "threshold" and fmt == "chat" \
            else [args.main_threshold]
        for tau in sweep:
            decode = table1_decode(n_buf, accept_threshold=tau,
                                   add_block_threshold=args.add_block_threshold,
                                   semi_complete_threshold=args.semi_complete_threshold,
                                   max_new_tokens=args.max_new_tokens, **extra)
            reports = evaluate_tasks(model, decode, engine, limit=args.limit, fmt=fmt, names=names)
            row = {"row": label, "model": str(model.path.parent), "buffer_size": n_buf,
                   "accept_threshold": tau, "format": fmt, **extra, **pool(reports),
                   "tasks": {r.task: {"accuracy": r.accuracy, "tpf": r.tpf,
                                      "tokens_per_s": r.tokens_per_s} for r in reports}}
            out.append(row)
            print(f"{label:32s} tau={tau:.2f} acc={row['accuracy']:.3f} tpf={row['tpf']:.2f} "
                  f"tok/s={row['tokens_per_s']:.0f}", file=sys.stderr, flush=True)
    main_rows = [o for o in out if o["accept_threshold"] == args.main_threshold]
    base = main_rows[0]
    print(f"\naccept threshold {args.main_threshold}, {base['n']} prompts "
          f"({args.limit} per task)\n", file=sys.stderr)
    print("| row | N_buf | accuracy | TPF | tokens/s | TPF / SingleBD | tokens/s / SingleBD |\n"
          "|---|---|---|---|---|---|---|", file=sys.stderr)
    for o in main_rows:
        print(f"| {o['row']} | {o['buffer_size']} | {100 * o['accuracy']:.1f} | {o['tpf']:.2f} | "
              f"{o['tokens_per_s']:.0f} | {o['tpf'] / base['tpf']:.2f}x | "
              f"{o['tokens_per_s'] / base['tokens_per_s']:.2f}x |", file=sys.stderr)
    print("\nper task: accuracy % / TPF\n\n| row | " + " | ".join(names) + " |\n|---|"
          + "---|" * len(names), file=sys.stderr)
    for o in main_rows:
        cells = [f"{100 * o['tasks'][t]['accuracy']:.0f} / {o['tasks'][t]['tpf']:.2f}"
                 for t in names]
        print(f"| {o['row']} | " + " | ".join(cells) + " |", file=sys.stderr)
    print(json.dumps({"limit_per_task": args.limit, "add_block_threshold": decode.add_block_threshold,
                      "semi_complete_threshold": decode.semi_complete_threshold,
                      "max_new_tokens": decode.max_new_tokens, "results": out}))
    if args.plot:
        plot(out, args.plot)


def plot(results: list[dict], path: str) -> None:
    """The accuracy-vs-TPF plot: one line per row run at several accept thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, *_ in ROWS:
        pts = [o for o in results if o["row"] == label]
        if len(pts) > 1:
            ax.plot([p["tpf"] for p in pts], [100 * p["accuracy"] for p in pts], "o-",
                    label=label)
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("exact-match accuracy (%)")
    accs = [100 * o["accuracy"] for o in results]
    ax.set_ylim(max(0, min(accs) - 5), min(100, max(accs) + 5))
    ax.set_title("held-out tasks, one point per accept threshold", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
