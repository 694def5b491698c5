"""Engine compile time against depth, layers unrolled or scanned.

Each (depth, layer loop) runs `mbd-jax bench decode` in a fresh process on a random-weight copy of
a preset with `num_layers` changed, so every compile is cold; the engine's compile seconds
(every program warm-up builds) and its decode step are read from the bench's JSON.

    python docs/lab/probes/bench_compile.py --model moe-100m --layers 8,48 --loops unrolled,scan

Prints one JSON object (stdout) and a table (stderr).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from mbd_jax.config import resolve_model_path  # noqa: E402


def run(model_yaml: pathlib.Path, loop: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "mbd_jax.cli", "bench", "decode", "--model", str(model_yaml),
           "--random-weights", "--batch", str(args.batch), "--prompt-len", "32", "--new-tokens",
           "32", "--buffer-size", "1", "--repeats", str(args.repeats), "--layer-loop", loop,
           "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])["rows"][0]
    return {k: row[k] for k in ("compile_s", "warmup_s", "compiles_warmup", "step_ms",
                                "tokens_per_s", "layer_loop")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="moe-100m")
    ap.add_argument("--layers", default="8,48")
    ap.add_argument("--loops", default="unrolled,scan")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    base = yaml.safe_load(resolve_model_path(args.model).read_text())
    depths = [int(n) for n in args.layers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in depths:
            path = pathlib.Path(tmp) / f"{args.model}-{n}.yaml"
            path.write_text(yaml.safe_dump({**base, "name": f"{args.model}-{n}l", "num_layers": n,
                                            "init": "random", "tokenizer": None}))
            for loop in args.loops.split(","):
                print(f"{n} layers, {loop} ...", file=sys.stderr, flush=True)
                rows.append({"layers": n, "loop": loop, **run(path, loop, args)})
    by = {(r["layers"], r["loop"]): r for r in rows}
    ratios = {loop: by[(depths[-1], loop)]["compile_s"] / by[(depths[0], loop)]["compile_s"]
              for loop in args.loops.split(",")}
    report = {"model": args.model, "batch": args.batch, "rows": rows,
              f"compile_ratio_{depths[-1]}_over_{depths[0]}": ratios}
    print(f"{'layers':>7} {'loop':>9} {'compile s':>10} {'programs':>9} {'step ms':>9} "
          f"{'tok/s':>8}", file=sys.stderr)
    for r in rows:
        print(f"{r['layers']:>7} {r['loop']:>9} {r['compile_s']:>10.2f} {r['compiles_warmup']:>9} "
              f"{r['step_ms']:>9.2f} {r['tokens_per_s']:>8.1f}", file=sys.stderr)
    for loop, x in ratios.items():
        print(f"compile {depths[-1]} / {depths[0]} layers, {loop}: {x:.2f}x", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
