"""Long context: prefill of one long prompt and decoding after it, per context length and per
(engine rows, prefill chunk, attention chunk), all in one process.

    python tools/bench_long_context.py --contexts 4096,32768 --variants 1:256:256,8:256:256

The model is a preset (default tiny-random, random weights) with `max_seq_len` raised to fit the
longest context. For each context a prompt of that many tokens is admitted into row 0 of an
engine with ROWS rows (the others free); timed: the admission's prefill calls, then decoding
`--new-tokens` tokens after it (SingleBD, one token per forward: fixed_steps), with every program
compiled first; with 2 or more rows, then a 20-token request decoded in row 1 after the long
one finished, and with 3 or more rows the prompt again in two rows decoded together (its pages
shared; the other rows free). Prefill is set against the FLOPs it needs: the time those would
take at the float32 matmul rate measured in the same process (`x FLOP-bound`: prefill seconds
over that time).
With `--service CHUNK`, each context is then sent once through `mbd-jax serve` (the preset with
`max_seq_len` raised, attention chunk CHUNK, the shipped serve config otherwise) as a
`/v1/completions` request of that many token ids, timed by the client from send to the whole
answer. Prints one JSON object per row and a table (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import harness  # tools/harness.py, beside this file


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="tiny-random", help="a preset")
    ap.add_argument("--contexts", default="4096,32768", help="comma-separated prompt lengths")
    ap.add_argument("--variants", default="1:256:256,8:256:256",
                    help="comma-separated ROWS:PREFILL_CHUNK:ATTENTION_CHUNK")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens decoded after the prompt "
                                                               "(0: prefill only)")
    ap.add_argument("--service", type=int, metavar="CHUNK",
                    help="also time each context through mbd-jax serve at this attention chunk")
    args = ap.parse_args()
    import numpy as np

    from mbd_jax.bench import matmul_gflops, step_flops
    from mbd_jax.config import DecodeConfig, load_model_config, resolve_model_path
    from mbd_jax.engine import Engine
    from mbd_jax.model.transformer import init_params

    contexts = [int(x) for x in args.contexts.split(",")]
    base = load_model_config(resolve_model_path(args.model))
    blk = base.block_size
    longest = max(contexts) + args.new_tokens + 2 * blk
    base = dataclasses.replace(base, max_seq_len=-(-longest // blk) * blk, tokenizer=None)
    base.validate("model")
    params = init_params(base)
    decode = DecodeConfig(max_new_tokens=max(args.new_tokens, 1), policy="fixed_steps",
                          steps_per_block=blk)  # one token per forward
    matmul = matmul_gflops()  # this process's ceiling, GFLOP/s (again at the end: the mean)
    rows = []
    for spec in args.variants.split(","):
        n_rows, chunk, att = (int(x) for x in spec.split(":"))
        cfg = dataclasses.replace(base, attention_chunk=att)
        engine = Engine(cfg, params, batch_size=n_rows, buffer_size=1, prefill_chunk=chunk)
        prompts = {p: np.random.default_rng(p).integers(10, cfg.vocab_size - 1, p).tolist()
                   for p in contexts}
        engine.warmup(buckets=engine.prefill_buckets_for(list(prompts.values())))
        for p, prompt in prompts.items():
            t = time.perf_counter()
            adm = engine.begin_admit({0: (prompt, decode)})
            calls = 1
            while not engine.prefill_step(adm):
                calls += 1
            engine.sync()
            prefill_s = time.perf_counter() - t
            # Block-causal attention over the prompt: each query sees about half of it; QK^T and
            # PV are 2 FLOPs per multiply-add each, per attention layer and query head.
            attention_layers = cfg.count_layers("full_attention")
            attn_flop = attention_layers * cfg.num_heads * cfg.head_dim * 4 * p * p / 2
            prefill_flop = step_flops(cfg, 1, p, p / 2)  # the weights' FLOPs and attention's
            row = {"context": p, "rows": n_rows, "prefill_chunk": chunk, "attention_chunk": att,
                   "prefill_s": round(prefill_s, 3), "prefill_calls": calls,
                   "prompt_tokens_per_s": round(p / prefill_s),
                   "attention_gflops_achieved": round(attn_flop / prefill_s / 1e9, 2),
                   "prefill_gflop": round(prefill_flop / 1e9, 1)}
            state = engine.finish_admit(engine.empty_state(), adm)
            if args.new_tokens:
                t = time.perf_counter()
                state = engine.run_decode(state)
                decode_s = time.perf_counter() - t
                (result,) = engine.results(state, 1, decode_s, [decode])
                row.update(decode_s=round(decode_s, 3), new_tokens=result.output_tokens,
                           forwards=result.nfe,
                           decode_tokens_per_s=round(result.output_tokens / decode_s, 1),
                           ms_per_forward=round(1000 * decode_s / max(result.nfe, 1), 2))
                if n_rows > 1:  # a short request decoded in row 1 after the long one finished
                    state = engine.admit(state, {1: (prompt[:20], decode)})
                    t = time.perf_counter()
                    state = engine.run_decode(state)
                    seconds = time.perf_counter() - t
                    after = engine.results(state, 2, seconds, [decode, decode])[1]
                    row["short_after_ms_per_forward"] = round(1000 * seconds / max(after.nfe, 1), 2)
                if n_rows > 2:  # the prompt again in rows 0 and 1 (its pages shared), the
                    engine.release(range(n_rows))  # other rows free, decoded together
                    state = engine.admit(engine.empty_state(), {0: (prompt, decode),
                                                                1: (prompt, decode)})
                    t = time.perf_counter()
                    state = engine.run_decode(state)
                    seconds = time.perf_counter() - t
                    two = engine.results(state, 2, seconds, [decode, decode])[0]
                    row["two_rows_ms_per_forward"] = round(1000 * seconds / max(two.nfe, 1), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    served = [serve_once(args.model, base.max_seq_len, args.service, p, args.new_tokens)
              for p in contexts] if args.service else []
    matmul = statistics.median([matmul, matmul_gflops()])
    for r in rows:
        r["matmul_gflops"] = round(matmul, 1)
        r["x_flop_bound"] = round(r["prefill_s"] / (r["prefill_gflop"] / matmul), 2)
    print(json.dumps({"matmul_gflops": round(matmul, 1)}))
    for r in served:
        r["x_flop_bound"] = round(r["seconds"] / (step_flops(base, 1, r["context"],
                                                             r["context"] / 2) / 1e9 / matmul), 2)
        print(json.dumps(r))
    print(f"\nmatmul {matmul:.0f} GFLOP/s (float32, mean of two runs, at the start and the end)\n"
          "\n| context | rows | prefill chunk | attention chunk | prefill s | x FLOP-bound | "
          "prompt tok/s | attention GFLOP/s | decode tok/s | ms / forward | "
          "short request after it, ms / forward | two long rows, ms / forward |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|",
          file=sys.stderr)
    for r in rows:
        print(f"| {r['context']} | {r['rows']} | {r['prefill_chunk']} | {r['attention_chunk']} | "
              f"{r['prefill_s']} | {r['x_flop_bound']} | {r['prompt_tokens_per_s']} | "
              f"{r['attention_gflops_achieved']} | "
              f"{r.get('decode_tokens_per_s', '-')} | {r.get('ms_per_forward', '-')} | "
              f"{r.get('short_after_ms_per_forward', '-')} | "
              f"{r.get('two_rows_ms_per_forward', '-')} |",
              file=sys.stderr)
    if served:
        print("\n| through mbd-jax serve: context | attention chunk | seconds to the answer | "
              "x FLOP-bound |\n|---|---|---|---|", file=sys.stderr)
        for r in served:
            print(f"| {r['context']} | {r['attention_chunk']} | {r['seconds']} | "
                  f"{r['x_flop_bound']} |", file=sys.stderr)
    return 0


def serve_once(model: str, max_seq_len: int, attention_chunk: int, context: int,
               max_tokens: int) -> dict:
    """Starts `mbd-jax serve` on the preset with `max_seq_len` raised, sends one completion of
    `context` random token ids and times it (send to the whole answer); stops the server."""
    import socket
    import subprocess
    import tempfile

    import httpx
    import numpy as np
    import yaml

    from mbd_jax.config import load_yaml, resolve_model_path

    path = resolve_model_path(model)
    raw = load_yaml(path)
    raw["max_seq_len"] = max_seq_len
    if raw.get("tokenizer"):  # relative to the preset's directory
        raw["tokenizer"] = str((path.parent / raw["tokenizer"]).resolve())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = os.path.join(tmp, "model.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(raw, f)
        server = subprocess.Popen(
            [sys.executable, "-m", "mbd_jax", "serve", "--model", cfg_path, "--host", "127.0.0.1",
             "--port", str(port), "--attention-chunk", str(attention_chunk)],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "serve.log"), "w"))
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 600
            while True:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"mbd-jax serve did not start: {tmp}/serve.log")
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            ids = np.random.default_rng(context).integers(10, raw["vocab_size"] - 1, context)
            t = time.perf_counter()
            r = httpx.post(url + "/v1/completions", timeout=3600, json={
                "prompt": ids.tolist(), "max_tokens": max(max_tokens, 1)})
            seconds = time.perf_counter() - t
            r.raise_for_status()
            usage = r.json()["usage"]
        finally:
            server.terminate()
            server.wait(60)
    return {"service": True, "context": context, "attention_chunk": attention_chunk,
            "seconds": round(seconds, 1), "completion_tokens": usage["completion_tokens"]}


if __name__ == "__main__":
    raise SystemExit(main())
