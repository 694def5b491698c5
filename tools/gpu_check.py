"""Same tokens on a GPU as on the CPU: decodes fixed prompts with the shipped models and with
random-weight presets (MoE, hybrid) on this process's default device, and writes each case's
token ids, accuracy, TPF and timings as JSON, or compares them with a saved run.

    python tools/gpu_check.py --out cpu.json                  # on the CPU: the reference
    python tools/gpu_check.py --compare cpu.json --out gpu.json   # on a GPU: same tokens?
    python tools/gpu_check.py --diff cpu.json gpu.json            # compare two saved runs

A shipped model's case decodes 10 held-out prompts of each task (chat format, Table 1's
thresholds); a random-weight case decodes random prompt ids with EOS ignored (its near-tied
logits make it the stricter check of the numerics). On the GPU the float32 matmuls run at
XLA's default precision (TF32 on Hopper) unless JAX_DEFAULT_MATMUL_PRECISION=highest.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np

from mbd_jax.checkpoint import load_model
from mbd_jax.engine import Engine
from mbd_jax.evaluate import table1_decode
from mbd_jax.train import tasks
import harness  # tools/harness.py, beside this file

# (name, model, random weights, N_buf, block activation)
CASES = [
    ("tiny-mbd N2", "tiny-mbd", False, 2, "progress"),
    ("tiny-mbd N3 eager", "tiny-mbd", False, 3, "eager"),
    ("tiny-bd N1", "tiny-bd", False, 1, "progress"),
    ("tiny-moe random N2", "tiny-moe", True, 2, "progress"),
    ("tiny-moe-hybrid-causal random N2", "tiny-moe-hybrid-causal", True, 2, "progress"),
]


def run_case(model_name: str, random_weights: bool, n_buf: int, activation: str,
             runtime: dict[str, str]) -> dict:
    model = load_model(model_name, random_weights=random_weights, runtime=runtime)
    decode = table1_decode(n_buf, block_activation=activation)
    examples = []
    if random_weights:
        rng = np.random.default_rng(0)
        banned = {model.cfg.mask_token_id, *model.cfg.eos_token_ids}
        allowed = np.array([i for i in range(model.cfg.vocab_size) if i not in banned])
        prompts = [rng.choice(allowed, int(n)).tolist() for n in rng.integers(5, 40, 16)]
        decode = table1_decode(n_buf, block_activation=activation, ignore_eos=True,
                               max_new_tokens=32)
    else:
        examples = [ex for name in tasks.TASKS for ex in tasks.heldout(name, 10, 1234, "chat")]
        prompts = [model.tokenizer.encode(ex.prompt) for ex in examples]
    engine = Engine(model.cfg, model.params, batch_size=16, buffer_size=n_buf,
                    tokenizer=model.tokenizer)
    t0 = time.perf_counter()
    engine.warmup(buckets=engine.prefill_buckets_for(prompts))
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = engine.generate(prompts, decode)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(prompts, decode)  # warm: the steady-state time
    gen2_s = time.perf_counter() - t0
    tokens = sum(r.output_tokens for r in results)
    nfe = sum(r.nfe for r in results)
    out = {"ids": [list(map(int, r.token_ids)) for r in results], "tpf": tokens / max(nfe, 1),
           "nfe": nfe, "warmup_s": warm_s, "generate_s": gen_s, "generate_warm_s": gen2_s,
           "tokens_per_s_warm": tokens / gen2_s, "moe_paths": engine.moe_paths}
    if examples:
        out["correct"] = sum(ex.is_correct(r.text) for ex, r in zip(examples, results))
        out["n"] = len(examples)
    return out


def compare(ref: dict, got: dict) -> dict:
    """Rows with the same token ids, and each differing row's first differing position."""
    same, first = 0, []
    for a, b in zip(ref["ids"], got["ids"]):
        if a == b:
            same += 1
        else:
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first.append(k)
    return {"rows": len(ref["ids"]), "same_rows": same, "first_diff_at": first}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--out", help="write the run's JSON here")
    ap.add_argument("--compare", help="a saved run to compare token ids with")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--runtime", action="append", default=[], metavar="FIELD=VALUE",
                    help="a model runtime setting for every case, e.g. moe_impl=auto")
    ap.add_argument("--diff", nargs=2, metavar=("REFERENCE", "RUN"),
                    help="compare two saved runs case by case and exit")
    args = ap.parse_args()
    if args.diff:
        ref, got = (json.load(open(p)) for p in args.diff)
        for name, case in got["cases"].items():
            r = ref["cases"].get(name, {})
            same = compare(r, case) if "ids" in r and "ids" in case else "no ids in both"
            print(name, json.dumps(same))
        return 0
    runtime = dict(item.split("=", 1) for item in args.runtime)
    ref = json.load(open(args.compare)) if args.compare else None
    wanted = set(args.cases.split(",")) if args.cases else None
    dev = jax.devices()[0]
    report = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
              "matmul_precision": str(jax.config.jax_default_matmul_precision), "runtime": runtime,
              "cases": {}}
    for name, model, rand, n_buf, act in CASES:
        if wanted is not None and name not in wanted:
            continue
        try:
            case = run_case(model, rand, n_buf, act, runtime)
        except Exception as e:  # one broken case must not hide the others' results
            case = {"error": f"{type(e).__name__}: {e}"[:2000]}
        if ref is not None and "ids" in case and "ids" in ref["cases"].get(name, {}):
            case["vs_reference"] = compare(ref["cases"][name], case)
        report["cases"][name] = case
        brief = {k: v for k, v in case.items() if k != "ids"}
        print(name, json.dumps(brief), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
