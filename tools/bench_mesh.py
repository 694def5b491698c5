"""Decode step latency and tokens/s per mesh shape, all in one process (ratios within one run).

    python tools/bench_mesh.py --force-cpu-devices 8                 # the overhead view on a CPU
    python tools/bench_mesh.py --model llada2-mini --random-weights  # whatever GPUs are present

"one" is the engine on the first device alone; every other mesh spans all devices. Prints one
JSON object per line and a table (docs/performance.md).
"""

from __future__ import annotations

import json
import os
import sys
import harness  # tools/harness.py, beside this file


def default_meshes(n: int) -> list[str]:
    if n == 1:
        return ["one"]
    meshes = ["one", f"data={n}", f"expert={n}", f"tensor={n}"]
    if n >= 4:
        meshes.append(f"expert={n // 2},tensor=2")
    if n >= 8:
        meshes.append(f"data=2,expert={n // 4},tensor=2")
    return meshes


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="moe-100m")
    ap.add_argument("--random-weights", action="store_true", help="for shape-only presets")
    ap.add_argument("--meshes", help="';'-separated mesh specs ('one' = one device); "
                                     "default: one, each axis alone, and mixes")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--buffer-size", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=256,
                    help="longest prefill program (warm-up compiles every bucket up to it; "
                         "256: the service's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force-cpu-devices", type=int, help="split the CPU into N XLA devices")
    args = ap.parse_args()
    if args.force_cpu_devices:  # before JAX starts
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.force_cpu_devices}")
    import jax

    from mbd_jax.bench import bench_decode
    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import DecodeConfig
    from mbd_jax.parallel import mesh as meshlib

    specs = args.meshes.split(";") if args.meshes else default_meshes(jax.device_count())
    rows = []
    for spec in specs:
        mesh = (meshlib.single_device_mesh() if spec == "one"
                else meshlib.make_mesh(meshlib.parse_mesh(spec)))
        model = load_model(args.model, random_weights=args.random_weights, mesh=mesh)
        print(f"[bench_mesh] mesh {spec}: compiling and timing", file=sys.stderr, flush=True)
        report = bench_decode(model.cfg, model.params, batch=args.batch, prompt_len=args.prompt_len,
                              new_tokens=args.new_tokens, buffer_sizes=[args.buffer_size],
                              decode=DecodeConfig(), repeats=args.repeats, mesh=mesh,
                              prefill_chunk=args.prefill_chunk)
        r = report["rows"][0]
        row = {"mesh": spec, "devices": report["devices"], "step_ms": r["step_ms"],
               "tokens_per_s": r["tokens_per_s"], "tpf": r["tpf"],
               "compiles_after_warmup": r["compiles_after_warmup"], "model": report["model"],
               "backend": report["backend"], "device": report["device"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    print(f"\n{base['model']} on {jax.device_count()} x {base['device']} ({base['backend']}), "
          f"batch {args.batch}, prompt {args.prompt_len}, new {args.new_tokens}, "
          f"N_buf {args.buffer_size}; medians of {args.repeats}", file=sys.stderr)
    print(f"{'mesh':>28} {'devices':>8} {'step_ms':>9} {'tokens/s':>9} {'vs first':>9} "
          f"{'recompiles':>10}", file=sys.stderr)
    for r in rows:
        print(f"{r['mesh']:>28} {r['devices']:>8} {r['step_ms']:>9.2f} {r['tokens_per_s']:>9.1f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:>8.2f}x {r['compiles_after_warmup']:>10}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
