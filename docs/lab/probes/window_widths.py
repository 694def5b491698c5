"""How wide MultiBD's decode forwards are: steps by `slots_in_use` (the most valid slots of any
live row, the blocks a step forwards: decoding/loop.py) on the held-out task prompts.

    python docs/lab/probes/window_widths.py [--model tiny-mbd] [--buffer-size 3] [--batch-size 1 16]
                                  [--limit 10]

The prompts go in batches of --batch-size rows admitted together, each batch stepped to its end
(no refill), one jitted decode step at a time, with Table 1's decoding (evaluate.table1_decode).
Prints JSON (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import jax

from mbd_jax.checkpoint import load_model
from mbd_jax.cli import int_at_least
from mbd_jax.decoding import loop
from mbd_jax.engine import Engine
from mbd_jax.evaluate import table1_decode
from mbd_jax.model.transformer import Transformer
from mbd_jax.train import tasks


def widths(model, n_buf: int, batch: int, prompts: list[list[int]]) -> dict[int, int]:
    """{width: steps} over the prompts decoded in batches of `batch` rows."""
    engine = Engine(model.cfg, model.params, batch_size=batch, buffer_size=n_buf,
                    tokenizer=model.tokenizer)
    apply_fn = Transformer(model.cfg, engine.mesh).apply
    step = jax.jit(lambda s, kv: loop.decode_step(engine.params, s, kv, apply_fn=apply_fn,
                                                  cfg=model.cfg, n_slots=n_buf))
    decode = table1_decode(n_buf)
    steps: collections.Counter[int] = collections.Counter()
    for i in range(0, len(prompts), batch):
        state = engine.admit(engine.empty_state(),
                             {r: (p, decode) for r, p in enumerate(prompts[i:i + batch])})
        kv = engine.kv
        while not bool(state.done.all()):
            steps[int(loop.slots_in_use(state))] += 1
            state, kv = step(state, kv)
    return dict(sorted(steps.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mbd")
    ap.add_argument("--buffer-size", type=int_at_least(2), default=3)
    ap.add_argument("--batch-size", type=int_at_least(1), nargs="+", default=[1, 16])
    ap.add_argument("--limit", type=int_at_least(1), default=10, help="held-out prompts per task")
    args = ap.parse_args()
    model = load_model(args.model)
    prompts = [model.tokenizer.encode(ex.prompt)
               for task in tasks.TASKS for ex in tasks.heldout(task, args.limit)]
    rows = []
    for batch in args.batch_size:
        counts = widths(model, args.buffer_size, batch, prompts)
        rows.append({"model": args.model, "buffer_size": args.buffer_size, "batch_size": batch,
                     "prompts": len(prompts), "steps_by_width": counts})
        print(json.dumps(rows[-1]), flush=True)
    print("| batch | " + " | ".join(f"{k} block(s)" for k in range(1, args.buffer_size + 1))
          + " |", file=sys.stderr)
    for r in rows:
        total = sum(r["steps_by_width"].values())
        cells = [f"{r['steps_by_width'].get(k, 0)} ({r['steps_by_width'].get(k, 0) / total:.0%})"
                 for k in range(1, args.buffer_size + 1)]
        print(f"| {r['batch_size']} | " + " | ".join(cells) + " |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
