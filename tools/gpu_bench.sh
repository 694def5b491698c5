#!/usr/bin/env bash
# One short run on a machine with a GPU: the same tokens as the CPU (tools/gpu_check.py: the
# shipped models and random-weight MoE / hybrid presets, GPU against this machine's CPU and
# against REFERENCE if given), then the decode bench of LLaDA2-mini's shape (random weights) at
# batch 1 (the `mbd-jax plan` rows of docs/performance.md: measured beside modelled) on the
# chunked attention loop and on the Pallas kernel, and of moe-100m at batch 16. Everything lands
# in OUT_DIR (JSON and logs).
# Usage: tools/gpu_bench.sh OUT_DIR [REFERENCE.json]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:?usage: tools/gpu_bench.sh OUT_DIR [REFERENCE.json]}
REF=${2:-}
mkdir -p "$OUT"
"$PY" -c 'import jax; d = jax.devices(); print(f"{len(d)} x {d[0].device_kind} ({d[0].platform}), jax {jax.__version__}")'
# the CPU's tokens on this machine, beside the GPU runs
JAX_PLATFORMS=cpu "$PY" tools/gpu_check.py --out "$OUT/cpu.json" > "$OUT/cpu.log" 2>&1 &
cpu=$!
timeout 240 "$PY" tools/gpu_check.py ${REF:+--compare "$REF"} --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log"
timeout 240 "$PY" -m mbd_jax.cli bench decode --model llada2-mini --random-weights --batch 1 \
    --prompt-len 256 --new-tokens 128 --prefill-chunk 128 --buffer-size 1,2 --repeats 2 --json \
    > "$OUT/bench_llada2_mini_b1.json" 2> "$OUT/bench_llada2_mini_b1.log"; tail -4 "$OUT/bench_llada2_mini_b1.log"
timeout 240 "$PY" -m mbd_jax.cli bench decode --model llada2-mini --random-weights --batch 1 \
    --prompt-len 256 --new-tokens 128 --prefill-chunk 128 --buffer-size 1,2 --repeats 2 --json \
    --attention-impl pallas \
    > "$OUT/bench_llada2_mini_b1_pallas.json" 2> "$OUT/bench_llada2_mini_b1_pallas.log"
tail -4 "$OUT/bench_llada2_mini_b1_pallas.log"
# the Pallas attention kernel's tokens on the GPU against the chunked loop's on the CPU
timeout 120 "$PY" tools/gpu_check.py --cases "tiny-moe random N2" --runtime attention_impl=pallas \
    --out "$OUT/gpu_pallas.json" 2>&1 | tee "$OUT/gpu_pallas.log"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 120 "$PY" tools/gpu_check.py \
    --cases "tiny-moe random N2,tiny-moe-hybrid-causal random N2" --runtime moe_impl=auto \
    --out "$OUT/gpu_auto_highest.json" 2>&1 | tee "$OUT/gpu_auto_highest.log"
timeout 120 "$PY" -m mbd_jax.cli bench decode --model moe-100m --random-weights --batch 16 \
    --prompt-len 128 --new-tokens 64 --prefill-chunk 128 --buffer-size 1,2 --repeats 2 --json \
    > "$OUT/bench_moe100m_b16.json" 2> "$OUT/bench_moe100m_b16.log"; tail -4 "$OUT/bench_moe100m_b16.log"
wait $cpu
echo "GPU against this machine's CPU:"; "$PY" tools/gpu_check.py --diff "$OUT/cpu.json" "$OUT/gpu.json"
echo "the Pallas kernel on the GPU against the CPU's chunked loop:"
"$PY" tools/gpu_check.py --diff "$OUT/cpu.json" "$OUT/gpu_pallas.json"
if [ -n "$REF" ]; then
  echo "this machine's CPU against REFERENCE:"; "$PY" tools/gpu_check.py --diff "$REF" "$OUT/cpu.json"
fi
