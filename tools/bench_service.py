"""The service at one client against offline `generate`: same engine settings, same requests.

    python tools/bench_service.py [--config configs/serve.yaml] [--requests 8] [--max-tokens 64]
                                  [--set section.field=YAML ...]

The offline side builds the engine exactly as `mbd-jax serve` does (mbd_jax.serving.server.build_engine,
in this process) and times `Engine.generate` on one request at a time. The service side starts
`mbd-jax serve --config CONFIG` on loopback and sends the same requests one after another as
streaming `/v1/completions` (latency: request sent to `[DONE]`). Requests alternate between the
two sides. The prefix cache is off on both by default (`--set cache.enabled=false`): the same
prompts would otherwise be served from the cache on the side that runs second. Prints JSON
(stdout) and a table (stderr); texts are compared request by request.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import sys
import time

import httpx
import harness  # tools/harness.py, beside this file

ROOT = pathlib.Path(__file__).resolve().parent.parent

PROMPTS = ["Sort: 41 7 93 12 5", "Write a short story about a lighthouse keeper.",
           "List three prime numbers and explain why they are prime.", "Sort: 3 88 21",
           "What is the capital of France? Answer in one sentence.", "Count from 1 to 20.",
           "Explain block diffusion in two sentences.", "Sort: 99 1 50 25 75 60 10"]


def stream_one(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """(seconds to [DONE], completion tokens, text) of one streaming completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    tokens, text = 0, []
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"service answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise SystemExit(f"in-band error: {obj['error']}")
            if obj.get("choices"):
                text.append(obj["choices"][0].get("text") or "")
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    return time.perf_counter() - t0, tokens, "".join(text)


def main() -> int:
    from load_test import start_server, with_overrides

    from mbd_jax.config import load_serve_config
    from mbd_jax.serving.server import build_engine

    ap = harness.parser(__doc__)
    ap.add_argument("--config", type=pathlib.Path, default=ROOT / "configs" / "serve.yaml")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="passes over the requests")
    ap.add_argument("--set", action="append", default=["cache.enabled=false"],
                    metavar="SECTION.FIELD=YAML")
    args = ap.parse_args()

    cfg_path = with_overrides(args.config, args.set)  # both sides read this file
    cfg = load_serve_config(cfg_path)

    engine = build_engine(cfg)
    engine.warmup()
    decode = dataclasses.replace(cfg.decoding, max_new_tokens=args.max_tokens)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    proc, url, _ = start_server(cfg_path, [])
    offline, service, same = [], [], 0
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            stream_one(client, prompts[0], args.max_tokens)  # first request: lazy set-up paths
            for _ in range(args.repeats):
                for prompt in prompts:
                    ids = engine.tokenizer.encode(prompt)
                    t0 = time.perf_counter()
                    (res,) = engine.generate([ids], decode)
                    offline.append((time.perf_counter() - t0, len(res.token_ids)))
                    seconds, tokens, text = stream_one(client, prompt, args.max_tokens)
                    service.append((seconds, tokens))
                    same += text == res.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rate = lambda runs: sum(n for _, n in runs) / sum(s for s, _ in runs)  # noqa: E731
    report = {"config": str(args.config), "overrides": args.set, "requests": len(offline),
              "max_tokens": args.max_tokens, "rows": engine.batch_size,
              "buffer_size": decode.buffer_size,
              "offline_tok_s": rate(offline), "service_tok_s": rate(service),
              "offline_median_ms": 1e3 * statistics.median(s for s, _ in offline),
              "service_median_ms": 1e3 * statistics.median(s for s, _ in service),
              "identical_texts": same / len(offline)}
    report["service_over_offline"] = report["service_tok_s"] / report["offline_tok_s"]
    print(f"{'side':>10} {'tok/s':>10} {'median ms':>10}", file=sys.stderr)
    for side in ("offline", "service"):
        print(f"{side:>10} {report[side + '_tok_s']:>10.1f} {report[side + '_median_ms']:>10.1f}",
              file=sys.stderr)
    print(f"service / offline {report['service_over_offline']:.2f}x, identical texts "
          f"{report['identical_texts']:.0%}", file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
