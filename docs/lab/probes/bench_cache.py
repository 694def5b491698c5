"""Prefix-cache benchmark: time to first block with a shared long prefix (hit vs miss), and decode
tokens/s with KV persistence on vs off, in one process on the same prompts.

    python docs/lab/probes/bench_cache.py [--model moe-100m] [--prefix-len 1024] [--repeats 5]
                                [--batch 8] [--new-tokens 96]

Time to first block: admit the request (prefill, or copy the cached blocks then prefill the rest)
and run single decode steps until its first generated block is committed. A miss uses a fresh
random prefix each repeat; a hit reuses a prefix an earlier request stored, with a new question.
Persistence: the same batch decoded by an engine without a store and one with a RAM store
(offload after every decode call), alternating, medians of `repeats`. Prints JSON (stdout) and a
table (stderr).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from mbd_jax.cache.prefix_store import PrefixStore, model_identity
    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import DecodeConfig
    from mbd_jax.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moe-100m")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    args = ap.parse_args()

    m = load_model(args.model)
    cfg, blk = m.cfg, m.cfg.block_size
    rng = np.random.default_rng(0)
    banned = {cfg.mask_token_id, *cfg.eos_token_ids}
    vocab = np.array([i for i in range(cfg.vocab_size) if i not in banned], np.int32)
    draw = lambda n: rng.choice(vocab, size=n).tolist()  # noqa: E731
    decode = DecodeConfig(buffer_size=2, max_new_tokens=args.new_tokens)
    store = PrefixStore(model_identity(cfg), blk, ram_bytes=4 << 30,
                        storage_path=tempfile.mkdtemp(prefix="mbd-cache-"), disk_bytes=16 << 30)

    # ---- time to first block, batch of one
    engine = Engine(cfg, m.params, batch_size=1, buffer_size=2, prefill_chunk=args.prefill_chunk,
                    steps_per_call=1, prefix_store=store)
    engine.warmup()

    def first_block(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        state = engine.admit(engine.empty_state(), {0: (prompt, decode)})
        full = len(prompt) // blk * blk
        while True:
            state = engine.decode_call(state, 1)
            cached, to_cache, done = jax.device_get((state.cached_len[0], state.n_to_cache[0],
                                                     state.done[0]))
            if int(cached) + int(to_cache) * blk > full or bool(done):
                return time.perf_counter() - t0

    miss, hit, hit_tokens = [], [], []
    for _ in range(args.repeats):
        prefix = draw(args.prefix_len)
        miss.append(first_block(prefix + draw(args.question_len)))
        engine.flush()
        before = engine.stats().prefix_hit_tokens
        hit.append(first_block(prefix + draw(args.question_len)))
        hit_tokens.append(engine.stats().prefix_hit_tokens - before)
        engine.flush()
    states = engine.stats().offload.staged_states  # a hybrid's snapshots
    engine.close()

    # ---- decode tokens/s, persistence off vs on (alternating; fresh prompts per repeat, the same
    # for both, so every committed block is new to the store and really gets offloaded)
    engines = {
        "off": Engine(cfg, m.params, batch_size=args.batch, buffer_size=2,
                      prefill_chunk=args.prefill_chunk),
        "on": Engine(cfg, m.params, batch_size=args.batch, buffer_size=2,
                     prefill_chunk=args.prefill_chunk,
                     prefix_store=PrefixStore("bench-" + model_identity(cfg), blk,
                                              ram_bytes=4 << 30)),
    }
    for e in engines.values():
        e.warmup()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        prompts = [draw(int(n)) for n in rng.integers(args.prefix_len // 4, args.prefix_len // 2,
                                                      size=args.batch)]
        for name, e in engines.items():
            state = e.admit(e.empty_state(), dict(enumerate((p, decode) for p in prompts)))
            e.sync()
            t0 = time.perf_counter()
            state = e.run_decode(state)
            dt = time.perf_counter() - t0
            tokens = sum(len(r.token_ids) for r in e.results(state, len(prompts), dt))
            rates[name].append(tokens / dt)
    off_stats = engines["on"].stats().offload
    engines["on"].close()

    med = statistics.median
    report = {
        "model": cfg.name, "prefix_len": args.prefix_len, "repeats": args.repeats,
        "first_block_s": {"miss": med(miss), "hit": med(hit), "speedup": med(miss) / med(hit)},
        "hit_tokens": hit_tokens, "staged_states": states,
        "decode_tokens_per_s": {"off": med(rates["off"]), "on": med(rates["on"]),
                                "ratio_on_off": med(rates["on"]) / med(rates["off"])},
        "offload": {"staged_blocks": off_stats.staged_blocks,
                    "blocking_waits": off_stats.blocking_waits,
                    "drains_not_ready": off_stats.drains_not_ready},
        "raw": {"miss": miss, "hit": hit, "off": rates["off"], "on": rates["on"]},
    }
    print(json.dumps(report))
    fb, dr = report["first_block_s"], report["decode_tokens_per_s"]
    print(f"\n{cfg.name}: {args.prefix_len}-token shared prefix, medians of {args.repeats}\n"
          f"| measure | off / miss | on / hit | ratio |\n|---|---|---|---|\n"
          f"| time to first block (s) | {fb['miss']:.3f} | {fb['hit']:.3f} | "
          f"{fb['speedup']:.2f}x faster |\n"
          f"| prompt tokens a hit loaded (median) | - | {med(hit_tokens):.0f} | |\n"
          f"| decode tokens/s (batch {args.batch}) | {dr['off']:.1f} | {dr['on']:.1f} | "
          f"{dr['ratio_on_off']:.3f} |\n"
          f"offload: {off_stats.staged_blocks} blocks staged, {off_stats.blocking_waits} blocking "
          f"waits", file=sys.stderr)


if __name__ == "__main__":
    main()
