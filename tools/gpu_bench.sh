#!/usr/bin/env bash
# The decode bench on whatever GPUs are present: one device, then every mesh shape over all of
# them (tools/bench_mesh.py), for a small and a LLaDA2-mini-shaped model with random weights.
# Usage: tools/gpu_bench.sh [extra bench_mesh.py flags]   (prints JSON lines and two tables)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import jax; d = jax.devices(); print(f"{len(d)} x {d[0].device_kind} ({jax.default_backend()})")'
"$PY" tools/bench_mesh.py --model moe-100m --random-weights --batch 16 --prompt-len 256 \
    --new-tokens 128 "$@"
"$PY" tools/bench_mesh.py --model llada2-mini --random-weights --batch 16 --prompt-len 512 \
    --new-tokens 256 "$@"
