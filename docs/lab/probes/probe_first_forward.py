"""What a model predicts in the first denoising forward: the prompt, then masks.

    python docs/lab/probes/probe_first_forward.py [--model tiny-bd] [--tasks reverse,sort,arith]
                                        [--formats raw,chat] [--limit 5] [--positions 6]

For each of the first `limit` held-out questions of each task and format, one block-causal
forward over the prompt followed by masks (two blocks past the prompt's last block) gives, at each
of the first `positions` masked positions, the most likely token and its probability. A confident
first forward (probability near 1 at each position) means the model knows where its answer starts
and what it is; a spread one, with EOS among the top tokens, is what confidence-ordered unmasking
turns into early stops (docs/lab/training-history.md, the raw-text paragraph). Decoding plays no part.
Prints JSON (stdout) and one line per question (stderr).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def probe(model: str, task_names: list[str], formats: list[str], limit: int,
          positions: int) -> list[dict]:
    import jax
    import numpy as np

    from mbd_jax.checkpoint import load_model
    from mbd_jax.model.forward_meta import ForwardMeta
    from mbd_jax.model.transformer import Transformer, block_causal_mask
    from mbd_jax.train import tasks

    m = load_model(model)
    cfg, tok, block = m.cfg, m.tokenizer, m.cfg.block_size
    apply = jax.jit(Transformer(cfg).apply)
    rows = []
    for task in task_names:
        for fmt in formats:
            for ex in tasks.heldout(task, limit, fmt=fmt):
                prompt = tok.encode(ex.prompt)
                n = (len(prompt) // block + 2) * block
                ids = np.array([prompt + [cfg.mask_token_id] * (n - len(prompt))], np.int32)
                pos = np.arange(n, dtype=np.int32)[None]
                logits = apply({"params": m.params}, ids,
                               ForwardMeta.explicit(pos, block_causal_mask(pos, block)))[0]
                probs = np.asarray(jax.nn.softmax(logits[0, len(prompt):len(prompt) + positions]))
                top = probs.argmax(-1)
                shown = ["EOS" if int(t) in cfg.eos_token_ids else tok.decode([int(t)])
                         for t in top]
                rows.append({"task": task, "format": fmt, "prompt": ex.prompt,
                             "answer": ex.answer, "top": shown,
                             "p": [round(float(probs[j, t]), 3) for j, t in enumerate(top)]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-bd")
    ap.add_argument("--tasks", default="reverse,sort,arith")
    ap.add_argument("--formats", default="raw,chat")
    ap.add_argument("--limit", type=int, default=5, help="held-out questions per task and format")
    ap.add_argument("--positions", type=int, default=6, help="masked positions shown")
    args = ap.parse_args()
    rows = probe(args.model, args.tasks.split(","), args.formats.split(","), args.limit,
                 args.positions)
    for r in rows:
        pairs = " ".join(f"{t!r}:{p:.2f}" for t, p in zip(r["top"], r["p"]))
        print(f"{r['task']:8s} {r['format']:5s} {r['prompt'][-28:]!r:32s} -> {pairs}   "
              f"(answer {r['answer']!r})", file=sys.stderr)
    summary = {f"{t}/{f}": statistics.median(min(r["p"]) for r in rows
                                             if (r["task"], r["format"]) == (t, f))
               for t in args.tasks.split(",") for f in args.formats.split(",")}
    print("median over questions of the least confident shown position:", summary,
          file=sys.stderr)
    print(json.dumps({"model": args.model, "least_confident_median": summary, "rows": rows}))


if __name__ == "__main__":
    main()
