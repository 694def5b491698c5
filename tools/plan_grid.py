"""`mbd-jax plan` over a grid: models x device counts x batch x N_buf, each compiled for the target.

    python tools/plan_grid.py [--models llada2-mini,llada2-flash,sdar-30b-a3b,qwen3.5-35b-a3b]
                              [--devices 1,2,8,16] [--batch 1,16] [--buffer-size 1,2]
                              [--quantize none,int8,fp8] [--kv-quantize none,int8]
                              [--target h200] [--context 8192]

Every configuration puts all its devices on the `expert` axis (8 per host: 16 devices are two
hosts) and is compiled by the planner (mbd_jax/plan.py: deviceless XLA:GPU, memory read back,
the decode step modelled, not measured). Beside each row, the HBM floor of reading the active
weights once per step (the whole model's active parameters, in its param_dtype or a byte each
when quantized, over the devices' summed bandwidth: what no engine can beat at batch 1).
`--quantize` / `--kv-quantize` add the weights' and the KV pool's 8-bit schemes as grid axes;
each row then says how many rows fit at its context and how long a context fits at its batch.
Needs the gpu-compile extra (PYTHONPATH=.venv/gpu-compile after `make test`). A JSON line per
configuration on stdout, the table on stderr.
"""

from __future__ import annotations

import sys

import harness

from mbd_jax import plan

plan.jax_for_planning()  # before any backend starts: the devices are compile-only

import numpy as np  # noqa: E402

from mbd_jax.checkpoint import load_model  # noqa: E402
from mbd_jax.config import ServerConfig  # noqa: E402
from mbd_jax.engine import deviceless  # noqa: E402
from mbd_jax.errors import UserError  # noqa: E402
from mbd_jax.model import sizes  # noqa: E402

PER_HOST = 8


def row(model: str, target: str, devices: int, batch: int, n_buf: int, context: int | None,
        weights: str = "none", kv: str = "none") -> dict:
    cfg = load_model(model, with_weights=False,
                     runtime={"quantization": weights, "kv_quantization": kv}).cfg
    hosts, per_host = max(1, devices // PER_HOST), min(devices, PER_HOST)
    shape = deviceless.EngineShape(batch, n_buf, ServerConfig.prefill_chunk)  # the service's
    out = {"model": model, "devices": devices, "batch": batch, "buffer_size": n_buf,
           "weights": weights, "kv": kv}
    facts = plan.target_facts(deviceless.target_text(target))
    width = 1 if weights != "none" else np.dtype(cfg.param_dtype).itemsize
    active_bytes = sizes.active_params_per_token(cfg) * width
    out["floor_ms"] = active_bytes / (devices * facts.hbm_bytes_per_s) * 1e3
    try:
        report = plan.plan(cfg, target, hosts, per_host, f"expert={devices}", shape,
                           context=context)
    except UserError as e:
        return {**out, "error": str(e)}
    decode, step = report["programs"]["decode"], report["decode_step"]
    return {**out, "fits": report["fits"],
            "params_gib": report["param_bytes_per_device"] / 2**30,
            "kv_gib": report["kv_bytes_per_device"] / 2**30,
            "decode_gib": decode["total_bytes"] / 2**30, "hbm_share": decode["hbm_share"],
            "step_ms": step["step_ms"], "bound": step["bound"],
            "rows_that_fit": report["rows_that_fit"],
            "context_that_fits": report["context_that_fits"],
            "tokens_per_step": batch * n_buf * cfg.block_size}


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--models", default="llada2-mini,llada2-flash,sdar-30b-a3b,qwen3.5-35b-a3b")
    ap.add_argument("--devices", type=harness.int_list(1), default=[1, 2, 8, 16])
    ap.add_argument("--batch", type=harness.int_list(1), default=[1, 16])
    ap.add_argument("--buffer-size", type=harness.int_list(1), default=[1, 2])
    ap.add_argument("--quantize", default="none", help="weight schemes, comma-separated")
    ap.add_argument("--kv-quantize", default="none", help="KV pool schemes, comma-separated")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--context", type=harness.int_at_least(1),
                    help="visible positions a step reads (default: each model's max_seq_len)")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for devices in args.devices:
            for batch in args.batch:
                for n_buf in args.buffer_size:
                    for weights in args.quantize.split(","):
                        for kv in args.kv_quantize.split(","):
                            print(f"[plan_grid] {model} on {devices}, batch {batch}, N_buf "
                                  f"{n_buf}, weights {weights}, KV {kv}", file=sys.stderr,
                                  flush=True)
                            rows.append(row(model, args.target, devices, batch, n_buf,
                                            args.context, weights, kv))
    harness.report(rows, {"model": "model", "devices": "devices", "batch": "batch",
                          "buffer_size": "N_buf", "weights": "weights", "kv": "KV",
                          "params_gib": "params GiB/dev",
                          "kv_gib": "KV GiB/dev", "decode_gib": "decode GiB/dev",
                          "fits": "fits", "step_ms": "modelled step ms", "bound": "bound",
                          "floor_ms": "active-weight floor ms",
                          "rows_that_fit": "rows that fit",
                          "context_that_fits": "context that fits", "error": "error"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
