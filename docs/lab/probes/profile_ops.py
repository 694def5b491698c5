"""Where a decode run's time goes, per XLA operation, and how fast XLA:CPU's matmuls run.

    python docs/lab/probes/profile_ops.py [--model DIR | --vs-torch] [--batch 1] [--moe-impl looped]
                                [--split-experts auto|off] [--top 15]
    python docs/lab/probes/profile_ops.py --matmuls [--repeats 100]

The first form warms an engine up, runs one `Engine.generate` (SingleBD, one token per step, EOS
ignored), then traces a second with `jax.profiler` and sums each operation's self time (its own
time minus the operations nested in it) over the trace, operations of one kind together (`.N`
suffixes dropped). `--vs-torch` builds tools/bench_vs_torch.py's Qwen3-MoE (34M, 16 experts
top-4) and converts it first. The second form times the decode-sized float32 matmuls one call at
a time (a jitted XLA matmul, and `torch.matmul` if torch is installed, alternating; medians) and
inside one jitted loop of 100 (no dispatch per call). JSON on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

MATMULS = [((16, 384), (384, 256)), ((64, 384), (384, 256)), ((64, 4096), (4096, 384)),
           ((16, 64, 384), (16, 384, 256))]


def self_times(trace_dir: pathlib.Path) -> dict[str, float]:
    """{operation kind: summed self time in s} over every thread of the trace."""
    (path,) = trace_dir.glob("**/*.trace.json.gz")
    events = json.load(gzip.open(path))["traceEvents"]
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    total: collections.Counter = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[tuple[float, float, str]] = []  # (start, duration, kind) of open events
        for e in evs:
            start, dur = e["ts"], e.get("dur", 0)
            while stack and stack[-1][0] + stack[-1][1] <= start:
                stack.pop()
            if stack:
                total[stack[-1][2]] -= dur
            kind = re.sub(r"\.\d+$", "", e["name"])
            total[kind] += dur
            stack.append((start, dur, kind))
    return {k: v / 1e6 for k, v in total.items()}


def profile(args) -> dict:
    import jax

    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import DecodeConfig
    from mbd_jax.engine import Engine

    m = load_model(args.model, runtime={"moe_impl": args.moe_impl} if args.moe_impl else None)
    engine = Engine(m.cfg, m.params, batch_size=args.batch, buffer_size=1,
                    prefill_chunk=args.prompt_len,
                    split_experts=args.split_experts == "auto")
    engine.warmup()
    rng = np.random.default_rng(1)
    prompts = rng.integers(5, m.cfg.vocab_size - 8, size=(args.batch, args.prompt_len)).tolist()
    blk = m.cfg.block_size
    decode = DecodeConfig(buffer_size=1, policy="fixed_steps", steps_per_block=blk,
                          max_new_tokens=args.new_tokens, max_nfe=blk * args.new_tokens,
                          ignore_eos=True)
    engine.generate(prompts, decode)
    with tempfile.TemporaryDirectory(prefix="mbd-profile-") as out:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            t = time.perf_counter()
            engine.generate(prompts, decode)
            seconds = time.perf_counter() - t
        ops = self_times(pathlib.Path(out))
    xla = {k: v for k, v in ops.items() if not k.startswith(("$", "ThunkExecutor::Execute (wait"))}
    return {"model": m.cfg.name, "batch": args.batch, "new_tokens": args.new_tokens,
            "moe_paths": engine.moe_paths, "experts_split": engine.experts_split,
            "generate_s": seconds, "ops_s": sum(xla.values()),
            "top": sorted(xla.items(), key=lambda kv: -kv[1])[:args.top]}


def matmuls(repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    try:
        import torch
        torch.set_num_threads(2)
    except ImportError:
        torch = None
    one = jax.jit(lambda a, b: a @ b)
    loop = jax.jit(lambda a, b: jax.lax.fori_loop(
        0, 100, lambda i, acc: acc + (a * (1 + i * 1e-9)) @ b,
        jnp.zeros(a.shape[:-1] + b.shape[-1:], jnp.float32)))

    def median_s(fn, sync, n):
        sync(fn())
        times = []
        for _ in range(n):
            t = time.perf_counter()
            sync(fn())
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    rows = []
    for sa, sb in MATMULS:
        a = np.random.default_rng(0).standard_normal(sa).astype(np.float32)
        b = np.random.default_rng(1).standard_normal(sb).astype(np.float32)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        flop = 2 * a.size * b.shape[-1]
        ready = lambda x: x.block_until_ready()  # noqa: E731
        row = {"shape": f"{list(sa)} x {list(sb)}",
               "xla_call_gflops": flop / median_s(lambda: one(ja, jb), ready, repeats) / 1e9,
               "xla_loop_gflops": 100 * flop / median_s(lambda: loop(ja, jb), ready, 5) / 1e9}
        if torch is not None:
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            row["torch_call_gflops"] = flop / median_s(lambda: torch.matmul(ta, tb),
                                                       lambda x: x, repeats) / 1e9
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mbd")
    ap.add_argument("--vs-torch", action="store_true",
                    help="profile tools/bench_vs_torch.py's converted Qwen3-MoE")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--moe-impl", default=None, help="expert path (default: the model's)")
    ap.add_argument("--split-experts", choices=["auto", "off"], default="auto",
                    help="per-expert weights where the engine would keep them, or never")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--matmuls", action="store_true", help="time the matmuls instead")
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    if args.matmuls:
        rows = matmuls(args.repeats)
        for r in rows:
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else v for k, v in r.items()),
                  file=sys.stderr)
        print(json.dumps({"matmuls": rows}))
        return
    with tempfile.TemporaryDirectory(prefix="mbd-profile-model-") as tmp:
        if args.vs_torch:
            import bench_vs_torch as vs

            from mbd_jax.convert import convert

            src = vs.build_hf("moe", pathlib.Path(tmp) / "hf", 6, 384)
            convert(src, pathlib.Path(tmp) / "mbd", dtype="float32", mask_token_id=vs.MASK_ID,
                    block_size=vs.BLOCK, progress=False)
            args.model = str(pathlib.Path(tmp) / "mbd")
        report = profile(args)
    print(f"generate {report['generate_s']:.2f} s traced, XLA operations {report['ops_s']:.2f} s "
          f"(self time over all threads); expert paths {report['moe_paths']}, per-expert "
          f"weights {report['experts_split']}", file=sys.stderr)
    for kind, s in report["top"]:
        print(f"{s * 1e3:10.1f} ms  {kind}", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
