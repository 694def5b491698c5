"""DiffusionGemma-family decoding on a model of the family (default: tiny-dgemma, random
weights) through the canvas engine (what the service runs): tokens per decoder pass, forwards,
tokens/s at each batch size and buffer size, its speed against the dense reference generator
(canvas_loop.generate, interleaved in the same run), and the self-conditioning share of a
denoising step.

    python tools/bench_canvas.py [--model tiny-dgemma] [--batch 1,16] [--buffer-size 1,2]
                                 [--canvases 4] [--steps 16] [--repeats 3]

Prompts of 24 random ids; `--canvases` canvases each (no EOS stop: the random model rarely writes
one early); each configuration runs once to compile, then `--repeats` timed runs (median).
Self-conditioning share: the soft embedding (softmax over the vocabulary times the embedding
table) and its gated MLP, timed alone at the step's shapes, over one whole step. JSON lines on
stdout, the table on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-dgemma")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--buffer-size", default="1,2")
    ap.add_argument("--canvases", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from mbd_jax import canvas_model
    from mbd_jax.decoding import canvas_loop
    from mbd_jax.engine.canvas_engine import CanvasEngine
    from mbd_jax.model import diffusion_gemma as dg

    m = canvas_model.load(args.model)
    cfg, params = m.cfg, m.params
    rows = []
    for batch in map(int, args.batch.split(",")):
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg.vocab_size, 24).tolist() for _ in range(batch)]
        engine = CanvasEngine(cfg, params, batch_size=batch, prefill_chunk=32,
                              max_len=32 + args.canvases * cfg.canvas_length)
        engine.warmup()
        for n_buf in map(int, args.buffer_size.split(",")):
            d = dataclasses.replace(m.decoding, steps=args.steps, confidence=0.0, buffer_size=n_buf,
                                    max_new_tokens=args.canvases * cfg.canvas_length)
            runs = {"engine": lambda: engine.generate(prompts, [d] * batch),  # noqa: B023
                    "reference": lambda: canvas_loop.generate(params, cfg, prompts, [d] * batch)}  # noqa: B023
            for run in runs.values():
                run()  # compile
            times = {name: [] for name in runs}
            for _ in range(args.repeats):  # interleaved: the machine's drift hits both
                for name, run in runs.items():
                    t0 = time.perf_counter()
                    res = run()
                    times[name].append(time.perf_counter() - t0)
                    if name == "engine":
                        served = res
            s = {name: statistics.median(ts) for name, ts in times.items()}
            tokens = sum(len(r.token_ids) for r in served)
            passes = sum(r.nfe for r in served)
            rows.append({"batch": batch, "buffer_size": n_buf, "seconds": round(s["engine"], 3),
                         "tokens_per_s": round(tokens / s["engine"], 1),
                         "engine_over_reference": round(s["reference"] / s["engine"], 3),
                         "tokens_per_decoder_pass": round(tokens / passes, 3),
                         "forwards_per_row": served[0].nfe + served[0].bubble_forwards,
                         "decoder_passes_per_row": served[0].nfe})
            print(json.dumps(rows[-1]))
    # the self-conditioning share of one step, at batch max
    b, c = max(map(int, args.batch.split(","))), cfg.canvas_length
    cache = dg.allocate_cache(cfg, b, 24 + args.canvases * c)
    canvas = jnp.zeros((b, c), jnp.int32)
    logits = jnp.zeros((b, c, cfg.vocab_size), jnp.float32)
    soft = jnp.zeros((b, c, cfg.hidden_size), jnp.dtype(cfg.dtype))
    step = jax.jit(lambda s: (dg.decode(params, cfg, canvas, jnp.full(b, 24), cache, s,
                                        jnp.ones(b, bool)), dg.soft_embedding(params, cfg, logits)))
    sc = jax.jit(lambda s: dg.self_conditioning(params, cfg, dg.embed(params, cfg, canvas), s,
                                                jnp.ones(b, bool)) + dg.soft_embedding(params, cfg, logits))

    def timed(fn):
        jax.block_until_ready(fn(soft))
        ts = []
        for _ in range(max(5, args.repeats)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(soft))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    share = {"batch": b, "step_ms": round(timed(step) * 1e3, 3),
             "self_conditioning_ms": round(timed(sc) * 1e3, 3)}
    share["self_conditioning_share"] = round(share["self_conditioning_ms"] / share["step_ms"], 3)
    print(json.dumps(share))
    print("| batch | N_buf | tokens/s | engine / dense reference | tokens per decoder pass | "
          "decode forwards per row |\n|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['batch']} | {r['buffer_size']} | {r['tokens_per_s']} | "
              f"{r['engine_over_reference']}x | {r['tokens_per_decoder_pass']} | "
              f"{r['forwards_per_row']} |", file=sys.stderr)
    print(f"self-conditioning: {share['self_conditioning_ms']} ms of a {share['step_ms']} ms step "
          f"({share['self_conditioning_share']:.1%}) at batch {b}", file=sys.stderr)


if __name__ == "__main__":
    main()
