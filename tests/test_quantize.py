"""8-bit weights (model/quantize.py): the formats against NumPy, a quantized model against the
float model holding its dequantized weights (token for token, through the engine), converted and
shipped models' quality cost, quantized model directories (convert, verify, load, a sharded
restore), and bad input."""

from __future__ import annotations

import json
import pathlib
import shutil
import textwrap
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mbd_jax.checkpoint import load_model, save_model
from mbd_jax.cli import main
from mbd_jax.config import ConfigError, DecodeConfig, load_serve_config
from mbd_jax.convert import convert
from mbd_jax.engine import Engine
from mbd_jax.evaluate import evaluate_tasks, table1_decode
from mbd_jax.model import quantize
from mbd_jax.model.transformer import param_shapes
from tests.conftest import run_on_8_cpu_devices
from tests.test_convert import BLOCK, MASK_ID, hf_model, ours_logits

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _weights(seed: int = 0) -> np.ndarray:
    """[E, D, F] with channels of very different ranges (and one all-zero channel)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((3, 24, 10)).astype(np.float32) * np.logspace(-3, 1, 10)
    w[1, :, 4] = 0.0
    return w


def test_int8_is_absmax_rounding_within_half_a_step():
    w = _weights()
    q, scale = quantize.quantize(w, "int8", (1,))
    assert q.dtype == jnp.int8 and q.shape == w.shape and scale.shape == (3, 1, 10)
    ref_scale = np.abs(w).max(axis=1, keepdims=True) / 127.0
    ref_scale[ref_scale == 0] = 1.0
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(w / ref_scale), -127, 127))
    back = np.asarray(quantize.dequantize(q, scale, jnp.float32))
    assert np.all(np.abs(back - w) <= 0.5 * ref_scale * (1 + 1e-6))  # half a step per channel
    assert np.abs(np.asarray(q)).max() == 127  # each channel's extreme maps to the format's
    assert np.all(back[1, :, 4] == 0.0)


def test_fp8_is_e4m3_rounding_within_half_an_ulp():
    w = _weights(1)
    q, scale = quantize.quantize(w, "fp8", (1,))
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (3, 1, 10)
    ref_scale = np.abs(w).max(axis=1, keepdims=True) / 448.0
    ref_scale[ref_scale == 0] = 1.0
    ref = (w / ref_scale).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), ref.astype(np.float32))
    x = w / ref_scale  # in the format's units: 3 mantissa bits, subnormal step 2^-9
    err = np.abs(np.asarray(q).astype(np.float32) - x)
    assert np.all(err <= np.maximum(np.abs(x) * 2.0 ** -4, 2.0 ** -10) * (1 + 1e-6))
    assert np.all(np.isfinite(np.asarray(q).astype(np.float32)))


class _Loaded(NamedTuple):  # what ours_logits reads of a loaded model
    cfg: Any
    params: Any


def _dequantized(params, cfg):
    """The float parameters a quantized tree stands for: each weight q * scale (float32)."""
    def walk(tree):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = walk(v)
            elif not k.endswith(quantize.SCALE_SUFFIX):
                s = tree.get(k + quantize.SCALE_SUFFIX)
                out[k] = v if s is None else quantize.dequantize(v, s, jnp.float32)
        return out
    return walk(params)


@pytest.mark.parametrize("name,scheme", [("tiny-moe", "int8"), ("tiny-moe-hybrid-causal", "fp8")])
def test_quantized_model_is_the_float_model_of_its_dequantized_weights(name, scheme):
    """A quantized model is the float model holding q * scale: the same logits (a rounding apart:
    projections scale the product, not the weight) and, through the engine (per-expert weights
    on one CPU device, their scales split with them) with MultiBD, the same tokens."""
    quant = load_model(name, runtime={"quantization": scheme})
    assert {k for k in quant.params["layer_1"]["moe"] if k.endswith("_scale")} == {
        "experts_gate_scale", "experts_up_scale", "experts_down_scale"}
    float_cfg = load_model(name, with_weights=False).cfg
    prompts = [[1, 20, 31, 42, 53, 64, 75], [1, 9, 8, 7]]
    decode = DecodeConfig(buffer_size=2, max_new_tokens=20, ignore_eos=True)

    def tokens(cfg, params):
        engine = Engine(cfg, params, batch_size=2, buffer_size=2)
        return [r.token_ids for r in engine.generate(prompts, decode)]

    dequantized = _dequantized(quant.params, quant.cfg)
    ids = list(range(3, 35))
    want = ours_logits(_Loaded(float_cfg, dequantized), ids)
    np.testing.assert_allclose(ours_logits(quant, ids), want, atol=1e-4 * np.abs(want).max())
    got = tokens(quant.cfg, quant.params)
    assert got == tokens(float_cfg, dequantized)
    assert len(got[0]) == 20


def _kl(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    lp, lq = jax.nn.log_softmax(ref), jax.nn.log_softmax(got)
    return np.asarray(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1))


# Per (source, scheme): (max KL, mean KL, share of positions whose greedy token is the float
# model's) over 4 x 32 teacher-forced positions. The models are tiny (hidden 32 and 64, so few
# terms average a weight's rounding out) with near-flat logits (top-1 probability 3-6%, the
# two best logits ~0.15 apart), harsher than a trained model. Measured: Qwen3-MoE 0.055 / 0.0017
# / 0.98 (int8) and 0.20 / 0.010 / 0.88 (fp8: 3 mantissa bits); the Qwen3-Next hybrid 0.27 /
# 0.015 / 0.72 (int8) and 0.39 / 0.073 / 0.45 (fp8): its linear layers' q and k projections
# carry most of it (the gated delta rule accumulates their error).
CONVERTED_BOUNDS = {("qwen3_moe", "int8"): (0.1, 0.004, 0.9),
                    ("qwen3_moe", "fp8"): (0.4, 0.02, 0.75),
                    ("qwen3_next", "int8"): (0.5, 0.03, 0.6),
                    ("qwen3_next", "fp8"): (0.8, 0.15, 0.35)}


def _converted(tmp_path, source: str, **quantized) -> tuple:
    """(float model, quantized model) converted from the same transformers checkpoint."""
    from tests import test_hybrid

    src = tmp_path / "hf"
    if source == "qwen3_moe":
        hf_model(source).save_pretrained(src)
        kwargs = dict(mask_token_id=MASK_ID, block_size=BLOCK)
    else:  # the hybrid at block size 1, in its family's mode
        test_hybrid.hf_hybrid(source).save_pretrained(src)
        kwargs = dict(mask_token_id=test_hybrid.MASK_ID, block_size=1,
                      block_mode=test_hybrid.MODES[source])
    convert(src, tmp_path / "float", dtype="float32", progress=False, **kwargs)
    manifest = convert(src, tmp_path / "q", dtype="float32", progress=False, **kwargs,
                       **quantized)
    assert manifest["quantization"] == quantized["quantization"]
    return load_model(str(tmp_path / "float")), load_model(str(tmp_path / "q"))


@pytest.mark.parametrize("source,scheme", sorted(CONVERTED_BOUNDS))
def test_converted_models_quantized_logits_stay_close(tmp_path, source, scheme):
    """`convert --quantize` of a transformers Qwen3-MoE and of a Qwen3-Next hybrid: logits against
    the float conversion over 4 prompts of 32 tokens, KL and greedy agreement under the bounds."""
    ref_model, q_model = _converted(tmp_path, source, quantization=scheme)
    assert q_model.cfg.quantization == scheme
    vocab = ref_model.cfg.vocab_size
    rng = np.random.default_rng(0)
    kls, agree = [], []
    for _ in range(4):
        ids = list(rng.integers(4, vocab, 32))
        ref, got = ours_logits(ref_model, ids), ours_logits(q_model, ids)
        kls.append(_kl(ref, got))
        agree.append(ref.argmax(-1) == got.argmax(-1))
    max_kl, mean_kl, share = CONVERTED_BOUNDS[source, scheme]
    kls, agree = np.concatenate(kls), np.concatenate(agree)
    assert kls.max() <= max_kl and kls.mean() <= mean_kl, (kls.max(), kls.mean())
    assert agree.mean() >= share, agree.mean()


def test_default_model_quantized_keeps_its_accuracy_and_tpf():
    """tiny-mbd (MBD, N_buf 2) with int8 and fp8 weights, and with an int8 KV pool: at most one
    prompt of 20 lost against float on any task and one of the 140 pooled, TPF within 3%
    (stage 11's tiny-mbd measured at 100 per task, pooled: float 98.7; int8 weights 99.0, fp8
    99.1, int8 KV 98.7, int8 both 98.7; TPF 4.83, 4.83, 4.82, 4.83, 4.83: `mbd-jax eval --limit
    100 --quantize S --kv-quantize S`; stage 12's int8 KV loses one longsort prompt of 20)."""
    decode = table1_decode(2)
    settings = {"float": {}, "int8": {"quantization": "int8"}, "fp8": {"quantization": "fp8"},
                "int8 KV": {"kv_quantization": "int8"}}
    reports = {}
    for name, runtime in settings.items():
        model = load_model("tiny-mbd", runtime=runtime)
        engine = Engine(model.cfg, model.params, batch_size=16, buffer_size=2,
                        tokenizer=model.tokenizer)
        reports[name] = evaluate_tasks(model, decode, engine, limit=20)
    for scheme in ("int8", "fp8", "int8 KV"):
        for ref, got in zip(reports["float"], reports[scheme]):
            assert got.correct >= ref.correct - 1, (scheme, got.task, got.accuracy)
            assert got.tpf >= 0.97 * ref.tpf, (scheme, got.task, got.tpf, ref.tpf)
        assert (sum(r.correct for r in reports[scheme])
                >= sum(r.correct for r in reports["float"]) - 1), scheme


def test_quantized_directory_converts_verifies_and_loads_like_load_time_quantization(tmp_path, capsys):
    """`convert --src MODEL_DIR --quantize int8` writes a checksummed directory that verifies,
    holds int8 weights and a third of the bytes, and decodes the tokens load-time quantization
    gives; quantizing it again, a tampered scale and an unknown scheme each fail clearly."""
    dst = tmp_path / "int8"
    assert main(["convert", "--src", str(ROOT / "models" / "tiny-mbd"), "--dst", str(dst),
                 "--quantize", "int8"]) == 0
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["quantization"] == "int8" and manifest["trained_by"] == "mbd-jax train"
    assert (dst / "tokenizer.model").is_file() and (dst / "generation.yaml").is_file()
    assert main(["verify", str(dst)]) == 0
    size = lambda d: sum(p.stat().st_size for p in (d / "params").rglob("*") if p.is_file())  # noqa: E731
    assert size(dst) < 0.45 * size(ROOT / "models" / "tiny-mbd")
    stored, at_load = load_model(str(dst)), load_model("tiny-mbd", runtime={"quantization": "int8"})
    assert stored.params["layer_1"]["moe"]["experts_up"].dtype == jnp.int8
    prompts = [[1, 20, 31, 42, 53], [1, 9, 8, 7]]
    decode = DecodeConfig(buffer_size=2, max_new_tokens=16, ignore_eos=True)
    run = lambda m: [r.token_ids for r in Engine(m.cfg, m.params, batch_size=2, buffer_size=2).generate(  # noqa: E731
        prompts, decode)]
    assert run(stored) == run(at_load)

    assert main(["convert", "--src", str(dst), "--dst", str(tmp_path / "again"),
                 "--quantize", "fp8"]) == 2
    assert "already quantized (int8)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="stored quantized"):
        load_model(str(dst), runtime={"quantization": "fp8"})
    with pytest.raises(SystemExit):  # argparse: invalid choice, exit 2
        main(["generate", "--model", "tiny-mbd", "--quantize", "int4", "--prompt", "x"])
    (tmp_path / "serve.yaml").write_text("runtime:\n  quantization: int4\n")
    with pytest.raises(ConfigError, match="quantization"):
        load_serve_config(tmp_path / "serve.yaml")

    # the scales rewritten (doubled) under the manifest: the checksum names the changed file
    tampered = tmp_path / "tampered"
    shutil.copytree(dst, tampered)
    params = dict(stored.params)
    layer = dict(params["layer_1"])
    layer["moe"] = {**layer["moe"], "experts_up_scale": layer["moe"]["experts_up_scale"] * 2}
    params["layer_1"] = layer
    save_model(tampered, stored.cfg, params)
    assert main(["verify", str(tampered)]) == 1
    with pytest.raises(ConfigError, match="does not match its checksum"):
        load_model(str(tampered))


SHARDED = textwrap.dedent("""
    import json, jax, numpy as np
    from mbd_jax.checkpoint import load_model
    from mbd_jax.config import DecodeConfig
    from mbd_jax.engine import Engine
    from mbd_jax.model import sharding
    from mbd_jax.parallel import mesh as meshlib
    prompts = [[1, 20, 31, 42, 53, 64, 75], [1, 9, 8, 7]]
    decode = DecodeConfig(buffer_size=2, max_new_tokens=16, ignore_eos=True)
    def run(model, mesh):
        engine = Engine(model.cfg, model.params, batch_size=2, buffer_size=2, mesh=mesh)
        return [r.token_ids for r in engine.generate(prompts, decode)], engine.kv.positional
    out = {}
    for spec in ("data=1", "expert=4,tensor=2"):
        n = 1 if spec == "data=1" else 8
        mesh = meshlib.make_mesh(meshlib.parse_mesh(spec, n), jax.devices()[:n])
        model = load_model(DIR, mesh=mesh, runtime={"kv_quantization": "int8"})
        want = sharding.param_shardings(model.cfg, mesh)
        moe = model.params["layer_1"]["moe"]
        tokens, kv = run(model, mesh)
        out[spec] = {"tokens": tokens,
                     "placed": all(a.sharding == w for a, w in zip(jax.tree.leaves(model.params),
                                                                     jax.tree.leaves(want))),
                     "q_local": list(moe["experts_up"].addressable_shards[0].data.shape),
                     "scale_local": list(moe["experts_up_scale"].addressable_shards[0].data.shape),
                     "dtype": str(moe["experts_up"].dtype),
                     "kv_scale_local": list(jax.tree.leaves(
                         kv.k_scale)[0].addressable_shards[0].data.shape)}
    print(json.dumps(out))
""")


def test_quantized_directory_restores_sharded_with_the_same_tokens(tmp_path):
    """An fp8 copy of tiny-mbd restored onto an (expert 4, tensor 2) mesh, each device reading
    its own shards of the weights and their scales, decodes with an int8 KV pool (its heads and
    their scales split on `tensor`) the tokens one device does."""
    dst = tmp_path / "fp8"
    assert main(["convert", "--src", str(ROOT / "models" / "tiny-mbd"), "--dst", str(dst),
                 "--quantize", "fp8"]) == 0
    out = run_on_8_cpu_devices(SHARDED.replace("DIR", repr(str(dst))))
    one, sharded = out["data=1"], out["expert=4,tensor=2"]
    assert sharded["tokens"] == one["tokens"] and len(one["tokens"][0]) == 16
    assert sharded["placed"] and sharded["dtype"] == "float8_e4m3fn"
    assert one["q_local"] == [8, 128, 128] and one["scale_local"] == [8, 1, 128]
    assert sharded["q_local"] == [2, 128, 64] and sharded["scale_local"] == [2, 1, 64]
    assert one["kv_scale_local"][-1] == 2 and sharded["kv_scale_local"][-1] == 1  # kv heads


def test_quantized_parameters_carry_their_scales_logical_axes():
    """The scales' shapes and the weights' dtypes come from the model definition (what verify and
    the sharded restore check against)."""
    cfg = load_model("tiny-moe", with_weights=False, runtime={"quantization": "fp8"}).cfg
    shapes = param_shapes(cfg)["layer_1"]
    assert shapes["attn"]["o_proj"].dtype == jnp.float8_e4m3fn
    assert shapes["attn"]["o_proj_scale"].shape == (1, 1, cfg.hidden_size)  # contracts heads x dim
    assert shapes["moe"]["router"].dtype == jnp.float32  # routers, norms, embeddings stay float
    assert "embed_scale" not in param_shapes(cfg)


def test_quantization_bench_tool_runs():
    """tools/bench_quantization.py on two settings: a row each, the weights' bytes down, the
    decoding's TPF the same order."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "tools/bench_quantization.py", "--settings",
                        "float,int8+kv-int8", "--limit", "2", "--batch", "2", "--new-tokens", "8",
                        "--repeats", "1"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["setting"] for row in rows] == ["float", "int8+kv-int8"]
    assert rows[1]["param_mb"] < 0.4 * rows[0]["param_mb"]
    assert rows[1]["block_entry_kb"] < 0.4 * rows[0]["block_entry_kb"]  # float32 -> 8-bit
    assert rows[1]["tpf"] > 0.9 * rows[0]["tpf"] and rows[1]["tokens_per_s"] > 0


@pytest.mark.parametrize("impl", sorted(["dense", "ragged", "tiled", "looped"]))
def test_every_expert_path_reads_quantized_experts(impl):
    """Each expert path on stacked 8-bit experts (ragged: the 8-bit values into ragged_dot, each
    row's product scaled by its expert's scales; the others dequantize) equals the reference path
    on the dequantized weights."""
    from mbd_jax.model import moe

    rng = np.random.default_rng(3)
    e, d, f, n, k = 8, 32, 16, 12, 2
    w = [rng.standard_normal(s).astype(np.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
    quantized = [quantize.Quantized(*quantize.quantize(a, "int8", (1,))) for a in w]
    floats = [quantize.dequantize(q.q, q.scale, jnp.float32) for q in quantized]
    x = jnp.asarray(rng.standard_normal((n, d)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, e + 1, (n, k)).astype(np.int32))  # id E: not routed here
    weights = jnp.asarray(rng.random((n, k)).astype(np.float32))
    want = moe.experts_dense(x, ids, weights, *floats)
    got = moe.EXPERT_IMPLS[impl](x, ids, weights, *quantized)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
