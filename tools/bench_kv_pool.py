"""KV memory of the paged pool against the dense design (every row holding a full context).

    python tools/bench_kv_pool.py --model tiny-random --max-seq-len 32768

Builds two engines of --rows rows on the same model: one whose pool holds every row's full
context (the dense design's memory), one whose pool holds exactly the pages the request mix needs
(--lengths prompt tokens, --new-tokens each), and reports the bytes each engine allocated
(`Engine.stats().kv_bytes`), the pages the mix holds by the engine's own accounting, and how many
requests of one --shared-prompt-length system prompt (plus a 32-token question each) a fixed
budget (the dense engine's bytes for --rows rows) holds at once: one per row densely, by pages
without sharing, and by pages with the prompt's pages shared in the pool, the last measured by
admitting --shared-rows such requests into an engine of that many rows on that budget (the first
prefills the system prompt, the others map its pages) and counting the pages in use. Prints one
JSON object and a table.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import harness  # tools/harness.py, beside this file


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="tiny-random", help="a preset (random weights)")
    ap.add_argument("--max-seq-len", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--lengths", default="256,1024,2048,4096,8192,16384,24576,32000")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--shared-prompt-length", type=int, default=4096)
    ap.add_argument("--shared-rows", type=int, default=32)
    args = ap.parse_args()
    import numpy as np

    from mbd_jax.config import DecodeConfig, load_model_config, resolve_model_path
    from mbd_jax.engine import Engine
    from mbd_jax.model.transformer import init_params

    cfg = dataclasses.replace(load_model_config(resolve_model_path(args.model)), tokenizer=None,
                              max_seq_len=args.max_seq_len)
    cfg.validate("model")
    params = init_params(cfg)
    lengths = [int(x) for x in args.lengths.split(",")]
    decode = DecodeConfig(max_new_tokens=args.new_tokens)
    dense = Engine(cfg, params, batch_size=args.rows, prefill_chunk=256)
    prompts = [np.full(n, 5, np.int32) for n in lengths]
    need = sum(dense.pages_needed(p, decode) for p in prompts)
    page = dense.stats().page_size
    paged = Engine(cfg, params, batch_size=args.rows, prefill_chunk=256,
                   kv_pool_tokens=need * page)
    adm = paged.begin_admit({i: (p, decode) for i, p in enumerate(prompts)})  # pages taken
    taken = paged.stats()
    assert taken.pages_in_use == need and taken.pages_free == 0
    del adm
    rng = np.random.default_rng(0)
    system = rng.integers(5, cfg.vocab_size, args.shared_prompt_length).tolist()
    asks = [system + rng.integers(5, cfg.vocab_size, 32).tolist() for _ in range(args.shared_rows)]
    per_request = dense.pages_needed(asks[0], decode)
    budget = dense.stats().pages
    pool = Engine(cfg, params, batch_size=args.shared_rows, prefill_chunk=256,
                  kv_pool_tokens=budget * page)
    state = pool.admit(pool.empty_state(), {0: (asks[0], decode)})  # prefills the system prompt
    first = pool.stats().pages_in_use
    pool.admit(state, {i: (asks[i], decode) for i in range(1, args.shared_rows)})
    shared_in_use = pool.stats().pages_in_use
    per_extra = (shared_in_use - first) / (args.shared_rows - 1)
    report = {
        "model": args.model, "max_seq_len": args.max_seq_len, "rows": args.rows,
        "lengths": lengths, "new_tokens": args.new_tokens, "page": page,
        "dense_bytes": dense.stats().kv_bytes, "paged_bytes": paged.stats().kv_bytes,
        "dense_pages": budget, "paged_pages": need,
        "ratio": dense.stats().kv_bytes / paged.stats().kv_bytes,
        "shared_prompt": args.shared_prompt_length,
        "held_at_once_dense": args.rows,
        "held_at_once_paged": budget // per_request,
        "shared_rows_admitted": args.shared_rows, "shared_pages_in_use": shared_in_use,
        "pages_first_request": first, "pages_per_further_request": per_extra,
        "held_at_once_paged_shared": 1 + int((budget - first) // per_extra),
    }
    print(json.dumps(report))
    mib = 2 ** 20
    print(f"| design | pool pages | KV MiB | requests of a {args.shared_prompt_length}-token prompt "
          f"in the dense budget |\n|---|---|---|---|\n"
          f"| dense ({args.rows} rows x full context) | {report['dense_pages']} | "
          f"{report['dense_bytes'] / mib:.1f} | {args.rows} (one per row) |\n"
          f"| paged (the mix's pages) | {need} | {report['paged_bytes'] / mib:.1f} | "
          f"{report['held_at_once_paged']} (pages; rows permitting) |\n"
          f"| paged, prompt pages shared (dense budget) | {budget} | "
          f"{report['dense_bytes'] / mib:.1f} | {report['held_at_once_paged_shared']} "
          f"({args.shared_rows} admitted: {shared_in_use} pages in use) |\n"
          f"ratio dense / paged: {report['ratio']:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
