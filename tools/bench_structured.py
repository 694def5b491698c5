"""Structured output against free decoding on the same prompts: validity, accuracy, TPF, decode
tokens/s (interleaved repeats, medians) and the host cost of the grammar steps.

    python tools/bench_structured.py [--model tiny-mbd] [--task jsonsort] [--buffer-size 1,3]
                                     [--limit 40] [--batch 8] [--repeats 3]

The task's held-out chat prompts (jsonsort: `Sort as JSON: ...`, answered as {"sorted": [...]};
toolsort: a call of the offered sort tool; sort: the plain task, under a regex of its answers)
decode free and under the task's grammar (jsonsort: its JSON Schema; toolsort: the forced
call's; sort: SORT_REGEX), per N_buf (N_buf > 1 with eager activation,
Table 1's thresholds otherwise). A model without the task trained (--model tiny-test: random
weights) shows what the grammar alone does. Validity: the reply parses and validates (the JSON
Schema with jsonschema; a call by tool_calls.parse). Grammar cost: host seconds of the grammar
steps per decode call that had one (engine stats). JSON lines on stdout, the table on stderr.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time

import harness  # tools/harness.py, beside this file


SORT_REGEX = "[0-9]( [0-9])*"  # a plain sort answer


def structure_for(task: str):
    from mbd_jax.config import Structure
    from mbd_jax.serving.tool_use import ToolUse
    from mbd_jax.train import tasks

    if task == "jsonsort":
        return Structure.json_schema(tasks.JSONSORT_SCHEMA)
    if task == "sort":
        return Structure("regex", SORT_REGEX)
    return ToolUse((tasks.SORT_TOOL,), "required", False).structure()


def valid(task: str, text: str) -> bool:
    import jsonschema

    from mbd_jax import tool_calls
    from mbd_jax.train import tasks

    if task == "toolsort":
        content, calls = tool_calls.parse(text, [tasks.SORT_TOOL])
        return content is None and len(calls) == 1
    if task == "sort":
        return re.fullmatch(SORT_REGEX, text) is not None
    try:
        jsonschema.validate(json.loads(text), tasks.JSONSORT_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> int:
    from mbd_jax.checkpoint import load_model
    from mbd_jax.engine import Engine
    from mbd_jax.evaluate import table1_decode
    from mbd_jax.train import tasks

    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="tiny-mbd")
    ap.add_argument("--task", choices=[*sorted(tasks.STRUCTURED_TASKS), "sort"],
                    default="jsonsort")
    ap.add_argument("--buffer-size", type=harness.int_list(1), default=[1, 3])
    ap.add_argument("--limit", type=harness.int_at_least(1), default=40)
    ap.add_argument("--batch", type=harness.int_at_least(1), default=8)
    ap.add_argument("--repeats", type=harness.int_at_least(1), default=3)
    args = ap.parse_args()

    model = load_model(args.model)
    examples = tasks.heldout(args.task, args.limit)
    prompts = [model.tokenizer.encode(ex.prompt) for ex in examples]
    engine = Engine(model.cfg, model.params, batch_size=args.batch,
                    buffer_size=max(args.buffer_size), tokenizer=model.tokenizer)
    engine.warmup(buckets=engine.prefill_buckets_for(prompts))
    structure = structure_for(args.task)
    settings = [(n, constrained) for n in args.buffer_size for constrained in (False, True)]

    def decode(n: int, constrained: bool):
        return table1_decode(n, max_new_tokens=120,
                             block_activation="eager" if n > 1 else "progress",
                             structure=structure if constrained else None)

    runs: dict = {s: {"seconds": [], "grammar": []} for s in settings}
    for rep in range(args.repeats + 1):  # the first round warms the host paths
        for s in settings:
            before = engine.stats()
            t0 = time.perf_counter()
            results = engine.generate(prompts, decode(*s))
            seconds = time.perf_counter() - t0
            after = engine.stats()
            if rep == 0:
                runs[s]["results"] = results
                continue
            runs[s]["seconds"].append(seconds)
            calls = after.grammar_calls - before.grammar_calls
            runs[s]["grammar"].append(((after.grammar_seconds - before.grammar_seconds),
                                       calls, after.decode_calls - before.decode_calls))
        print(f"[bench_structured] round {rep} done", file=sys.stderr, flush=True)
    rows = []
    for (n, constrained), run in runs.items():
        results = run["results"]
        tokens = sum(r.output_tokens for r in results)
        nfe = sum(r.nfe for r in results)
        g_seconds, g_calls, calls = run["grammar"][-1]
        rows.append({
            "model": args.model, "task": args.task, "buffer_size": n,
            "constrained": constrained,
            "valid": sum(valid(args.task, r.text) for r in results) / len(results),
            "accuracy": sum(ex.is_correct(r.text) for ex, r in zip(examples, results))
            / len(results),
            "tpf": tokens / max(nfe, 1),
            "tokens_per_s": tokens / statistics.median(run["seconds"]),
            "decode_calls": calls,
            "grammar_ms_per_call": 1000 * g_seconds / g_calls if g_calls else 0.0})
    base = {r["buffer_size"]: r for r in rows if not r["constrained"]}
    for r in rows:
        b = base[r["buffer_size"]]
        r["tpf_vs_free"] = r["tpf"] / b["tpf"]
        r["speed_vs_free"] = r["tokens_per_s"] / b["tokens_per_s"]
    harness.report(rows, {
        "buffer_size": "N_buf", "constrained": "grammar", "valid": "valid", "accuracy": "acc",
        "tpf": "TPF", "tpf_vs_free": "TPF vs free", "tokens_per_s": "tokens/s",
        "speed_vs_free": "tokens/s vs free", "decode_calls": "calls",
        "grammar_ms_per_call": "grammar ms/call"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
