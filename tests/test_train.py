"""The trainer: the loss really drops, a resumed run continues exactly, the data-parallel step on
8 forced CPU devices equals the single-device step, and the `train` command writes a loadable
model directory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from mbd_jax.config import ConfigError, SequenceModule
from mbd_jax.errors import UserError
from mbd_jax.checkpoint import load_model
from mbd_jax.model.transformer import init_params
from mbd_jax.train.config import TrainConfig
from mbd_jax.train.trainer import Trainer, balance_experts, batch_for_step
from tests.conftest import run_on_8_cpu_devices

ROOT = pathlib.Path(__file__).resolve().parent.parent


def small_model():
    """tiny-moe's tokenizer and routing, shrunk so a step takes milliseconds."""
    base = load_model("tiny-moe", with_weights=False)
    cfg = dataclasses.replace(base.cfg, hidden_size=32, num_layers=2, intermediate_size=64,
                              moe_intermediate_size=32, head_dim=8)
    return cfg, init_params(cfg), base.tokenizer


def tcfg(**kw) -> TrainConfig:
    args = dict(name="t", model="tiny-moe", output="unused", batch_size=8, seq_len=32, steps=40,
                learning_rate=1e-2, warmup_steps=4, log_every=1, data_parallel=1)
    args.update(kw)
    return TrainConfig(**args)


def test_batches_are_a_function_of_seed_and_step():
    cfg, _, tok = small_model()
    t = tcfg(objective="multitf", g_max=2)
    a, b = batch_for_step(t, cfg, tok, 7), batch_for_step(t, cfg, tok, 7)
    for k, v in a.as_dict().items():
        np.testing.assert_array_equal(v, b.as_dict()[k])
    assert not np.array_equal(a.noisy, batch_for_step(t, cfg, tok, 8).noisy)
    assert a.noisy.shape[0] == 8 * 3  # two systematic layouts + one random per example


@pytest.mark.parametrize("objective,g_max,hybrid", [("bd", 1, False), ("multitf", 2, False),
                                                    ("multitf", 2, True)])
def test_short_run_lowers_the_loss(objective, g_max, hybrid):
    """Both objectives train; the Gated DeltaNet hybrid (layer 0 linear, bidirectional) too."""
    cfg, params, tok = small_model()
    if hybrid:
        cfg = dataclasses.replace(cfg, sequence_module=SequenceModule(
            type="gated_deltanet", block_mode="bidirectional",
            layer_types=("linear_attention", "full_attention"), num_key_heads=2,
            num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4,
            chunk_size=cfg.block_size))
        params = init_params(cfg)
    trainer = Trainer(tcfg(objective=objective, g_max=g_max), cfg, params, tok)
    history = trainer.fit(progress="none")
    first, last = history[0]["loss"], np.mean([h["loss"] for h in history[-5:]])
    assert last < 0.5 * first, (first, last)
    assert history[-1]["token_acc"] > history[0]["token_acc"] + 0.3


def test_bfloat16_compute_trains_like_float32():
    cfg, params, tok = small_model()
    f32 = Trainer(tcfg(), cfg, params, tok)
    bf16 = Trainer(tcfg(compute_dtype="bfloat16"), cfg, params, tok)
    assert bf16.cfg.compute_dtype == "bfloat16"
    a = [f32.train_step()["loss"] for _ in range(3)]
    b = [bf16.train_step()["loss"] for _ in range(3)]
    np.testing.assert_allclose(b, a, rtol=3e-2)  # bf16 activations: ~3 significant digits
    assert b != a  # it really ran in bfloat16
    leaf = jax.tree.leaves(bf16.state["params"])[0]
    assert leaf.dtype == np.float32  # parameters and optimizer state stay float32


def test_resume_gives_the_same_next_step_loss(tmp_path):
    cfg, params, tok = small_model()
    straight = Trainer(tcfg(steps=6), cfg, params, tok)
    losses = [straight.train_step()["loss"] for _ in range(6)]

    first = Trainer(tcfg(steps=3, checkpoint_dir=str(tmp_path)), cfg, params, tok)
    first.fit(progress="none")  # saves step 3
    resumed = Trainer(tcfg(steps=6, checkpoint_dir=str(tmp_path)), cfg, params, tok)
    assert resumed.restore() and resumed.step == 3
    # a checkpoint of another run is refused, naming what differs (steps may grow: above)
    other = Trainer(tcfg(steps=6, seed=99, checkpoint_dir=str(tmp_path)), cfg, params, tok)
    with pytest.raises(UserError, match=r"another config \(seed: 0 there, 99 here\).*--checkpoint-dir"):
        other.restore()
    assert other.step == 0  # nothing restored
    again = [resumed.train_step()["loss"] for _ in range(3)]
    np.testing.assert_allclose(again, losses[3:], rtol=1e-6)
    fresh = Trainer(tcfg(steps=6), cfg, params, tok)  # without restoring: a different loss
    assert abs(fresh.train_step()["loss"] - losses[3]) > 1e-3
    # stop_at ends a run early on the longer run's schedule; a shorter `steps` decays sooner
    def run(**kw):
        t = Trainer(tcfg(warmup_steps=1, **kw), cfg, params, tok)
        return t, [m["loss"] for m in t.fit(progress="none")]
    _, full_losses = run(steps=8)
    stopped, stopped_losses = run(steps=8, stop_at=4)
    shorter, _ = run(steps=4)
    assert stopped.step == 4 and stopped_losses == pytest.approx(full_losses[:4], rel=1e-6)
    gap = lambda a, b: max(jax.tree.leaves(jax.tree.map(  # noqa: E731
        lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a.state["params"],
        b.state["params"])))
    assert gap(stopped, shorter) > 1e-5  # step 3's learning rate differs
    with pytest.raises(ConfigError, match="field 'stop_at' must be in"):
        tcfg(steps=6, stop_at=7).validate()


SHARDED_SCRIPT = textwrap.dedent("""
    import dataclasses, json, jax, numpy as np
    from tests.conftest import layer_1
    from tests.test_train import small_model, tcfg
    from mbd_jax.parallel import mesh as meshlib
    from mbd_jax.train.trainer import Trainer, data_mesh
    assert jax.device_count() == 8
    cfg, params, tok = small_model()
    out = {}
    for name in ("data=1", "data=8", "data=2,expert=2,tensor=2"):
        mesh = (data_mesh(1) if name == "data=1" else
                meshlib.make_mesh(meshlib.parse_mesh(name)))
        t = Trainer(tcfg(objective="multitf", g_max=2), cfg, params, tok, mesh=mesh)
        losses = [t.train_step()["loss"] for _ in range(3)]
        leaf = layer_1(t.state["params"])["moe"]["experts_up"]
        mu = layer_1(t.state["opt_state"][1][0].mu)["moe"]["experts_up"]
        out[name] = {"losses": losses, "params": [np.asarray(x).ravel().tolist()
                                                  for x in jax.tree.leaves(t.state["params"])],
                     "batch_shards": len(t.batch_sharding.addressable_devices),
                     "param_devices": len(leaf.sharding.device_set),
                     "experts_local": list(leaf.addressable_shards[0].data.shape)[-3:],
                     "moment_local": list(mu.addressable_shards[0].data.shape)[-3:]}
    print(json.dumps(out))
""")


def test_sharded_train_step_on_8_cpu_devices_equals_single_device():
    """Data parallel over 8 devices, and data x expert x tensor (2, 2, 2) with the experts in
    shard_map and split moments: the same losses and parameters as one device."""
    out = run_on_8_cpu_devices(SHARDED_SCRIPT)
    one = out.pop("data=1")
    assert out["data=8"]["batch_shards"] == 8 and out["data=8"]["param_devices"] == 8
    mixed = out["data=2,expert=2,tensor=2"]
    e, d, f = one["experts_local"]
    assert mixed["experts_local"] == [e // 2, d, f // 2] == mixed["moment_local"]
    for name, got in out.items():
        # float32; the gradient is summed in a different order across shards
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5, err_msg=name)
        for a, b in zip(one["params"], got["params"]):
            np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-4, err_msg=name)


def test_train_command_writes_a_loadable_model_under_runs_and_spares_shipped_models(tmp_path):
    """Without an output the model goes to runs/<name>-model; models/ stays git-clean; replacing
    a shipped model needs --force (refused before any training); --set overrides a field."""
    name = f"cli-test-{os.getpid()}"
    out = ROOT / "runs" / f"{name}-model"
    cfg_path = tmp_path / "t.yaml"
    cfg_path.write_text(textwrap.dedent(f"""
        name: {name}
        model: tiny-moe
        steps: 3
        batch_size: 4
        checkpoint_dir: {tmp_path / 'ckpt'}
        checkpoint_every: 2
        log_every: 1000
    """))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    shipped = ["git", "status", "--porcelain", "--", "models"]
    clean = subprocess.run(shipped, capture_output=True, text=True, cwd=ROOT).stdout
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "train", "--config", str(cfg_path),
                        "--output", "models/tiny-bd"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    assert r.returncode == 2 and "--force" in r.stderr and "Traceback" not in r.stderr, r.stderr
    try:
        r = subprocess.run([sys.executable, "-m", "mbd_jax", "train", "--config", str(cfg_path),
                            "--no-progress", "--set", "log_every=2"], capture_output=True,
                           text=True, cwd=ROOT, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout.splitlines()[-1])["model_dir"] == str(out)
        logged = [json.loads(line) for line in r.stderr.splitlines() if line.startswith('{"')]
        # the first step, then every log_every, and the last; a line while the first compiles
        assert [m["step"] for m in logged] == [1, 2, 3] and all(m["loss"] > 0 for m in logged)
        assert "compiling the train step" in r.stderr
        assert subprocess.run(shipped, capture_output=True, text=True, cwd=ROOT).stdout == clean
        model = load_model(str(out))
        manifest = json.loads((out / "manifest.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert model.cfg.name == name and model.tokenizer is not None
    assert manifest["steps"] == 3 and "tokenizer.model" in manifest["files"]
    # the two kept steps, and the config that wrote them (a resume under another is refused)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "3", "train_config.json"]
    recorded = json.loads((tmp_path / "ckpt" / "train_config.json").read_text())
    assert recorded["seed"] == 0 and "checkpoint_dir" not in recorded and "steps" not in recorded
    start = load_model("tiny-moe")
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                         model.params, start.params)
    assert max(jax.tree.leaves(moved)) > 0  # trained, not a copy of the init
    # a bad field is named, with exit 2 and no traceback
    cfg_path.write_text("name: x\nmodel: tiny-moe\noutput: y\nlearning_rat: 1\n")
    r = subprocess.run([sys.executable, "-m", "mbd_jax", "train", "--config", str(cfg_path)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2 and "learning_rat" in r.stderr and "Traceback" not in r.stderr
    # so is a bad --set: an unknown field, an ill-typed value, a pair without '='
    cfg_path.write_text("name: x\nmodel: tiny-moe\noutput: y\n")
    for flag, named in (("g_maks=3", "g_maks"), ("g_max=three", "g_max"),
                        ("g_max", "FIELD=VALUE")):
        r = subprocess.run([sys.executable, "-m", "mbd_jax", "train", "--config", str(cfg_path),
                            "--set", flag], capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=120)
        assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_weight_decay_reaches_the_same_parameters_scanned_or_unrolled():
    """AdamW decays matrices only: norms and the router's expert_bias stay out under the scan too,
    where every layer leaf has a leading layer axis (a [L, D] norm is not a matrix)."""
    import jax

    from mbd_jax.model import layout
    from mbd_jax.train.trainer import decay_mask
    from tests.conftest import tiny_cfg

    def decayed(cfg) -> dict[str, bool]:  # per-layer leaf name (layer index dropped) -> decayed
        params = jax.eval_shape(lambda: init_params(cfg))
        flat = jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]
        names = {}
        for path, flag in flat:
            keys = [str(getattr(k, "key", k)) for k in path]
            name = "/".join(k for k in keys if not k.startswith("layer"))
            assert names.setdefault(name, flag) == flag, name  # the same for every layer
        return names

    unrolled, scanned = decayed(tiny_cfg(layer_loop="unrolled")), decayed(tiny_cfg(layer_loop="scan"))
    assert layout.scanned(tiny_cfg(layer_loop="scan")) and unrolled == scanned
    assert not scanned["moe/expert_bias"] and not scanned["attn/q_norm"]
    assert scanned["moe/experts_up"] and scanned["attn/q_proj"] and scanned["embed"]


@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_expert_bias_balances_a_router_skewed_to_one_expert(loop):
    """The auxiliary-loss-free update: with expert 0's routing bias far above the rest (every
    token picks it), the first step's busiest expert has every token (load E/k times the mean),
    each bias moves by exactly the rate against its expert's load (down for expert 0; the
    optimizer leaves the bias alone), and a few steps bring the busiest load toward the mean.
    With rate 0 the bias stays where it was."""
    cfg, _, tok = small_model()
    cfg = dataclasses.replace(cfg, layer_loop=loop)
    skew = jax.tree_util.tree_map_with_path(
        lambda path, p: p.at[..., 0].set(2.0) if getattr(path[-1], "key", "") == "expert_bias"
        else p, init_params(cfg))

    def biases(params):
        return [np.asarray(p) for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
                if getattr(path[-1], "key", "") == "expert_bias"]

    rate = 0.25
    trainer = Trainer(tcfg(learning_rate=1e-6, expert_bias_rate=rate), cfg, skew, tok)
    before = biases(trainer.state["params"])
    assert before and all(b[..., 0].min() == 2.0 for b in before)
    first = trainer.train_step()
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    assert first["max_load"] == pytest.approx(e / k)  # expert 0 took every token
    for b0, b1 in zip(before, biases(trainer.state["params"])):
        step = b1 - b0
        np.testing.assert_allclose(step[..., 0], -rate)  # the busiest expert's bias goes down
        assert np.all(np.isclose(np.abs(step), rate) | (step == 0)), step
        assert (step > 0).any()  # experts below the mean go up
    history = [trainer.train_step()["max_load"] for _ in range(8)]
    # expert 0's lead is gone after 2.0 / (2 x 0.25) = 4 steps; from there the loads are the
    # (untrained) router's own, about 0.6 x E/k on this data, where a frozen bias stays at E/k
    # (a step of 0.25 dwarfs the untrained router's logits, so a step may overshoot: the median)
    assert history[:3] == [e / k] * 3 and np.median(history[4:]) < 0.65 * first["max_load"], history

    # Rate 0 (balance_experts is train_step's last move, after the optimizer's): the biases stay
    # where they were under uneven loads (a second compiled step would only repeat the above).
    def uneven_loads(tree):  # an `expert_load` beside every `expert_bias`, as the layers sow
        out = {k: uneven_loads(v) for k, v in tree.items() if isinstance(v, dict)}
        if "expert_bias" in tree:
            bias = tree["expert_bias"]
            out["expert_load"] = np.broadcast_to(np.arange(bias.shape[-1], dtype=np.float32),
                                                 bias.shape)
        return out

    # the same loads at the rate move the biases (the busiest, last expert's down): they are read
    moved = biases(balance_experts(skew, uneven_loads(skew), rate))
    assert all(np.allclose(m[..., -1] - b[..., -1], -rate) for m, b in zip(moved, before))
    frozen = balance_experts(skew, uneven_loads(skew), 0.0)
    for b0, b1 in zip(before, biases(frozen)):
        np.testing.assert_array_equal(b1, b0)


def test_the_shipped_training_configs_load_and_chain():
    """Every configs/train/*.yaml is valid, and each starts from a preset, a shipped model or the
    output of another config there (the make-models stages), with no two writing one place."""
    from mbd_jax.config import available_presets
    from mbd_jax.train.config import load_train_config

    configs = {p.name: load_train_config(p) for p in sorted((ROOT / "configs/train").glob("*.yaml"))}
    assert {"recall-lookup.yaml", "tiny-bd.yaml", "tiny-mbd.yaml"} <= set(configs)
    outputs = {c.output_dir() for c in configs.values()} | {ROOT / "models" / "tiny-bd"}
    assert len({c.output_dir() for c in configs.values()}) == len(configs)
    assert len({c.checkpoint_dir for c in configs.values()}) == len(configs)
    for name, c in configs.items():
        c.validate(name)
        assert c.model in available_presets() or c.path(c.model) in outputs, (name, c.model)
    assert configs["tiny-mbd.yaml"].model == "tiny-bd"  # post-trains the shipped tiny-bd
    make = (ROOT / "Makefile").read_text()
    stages = [line.split("--config configs/train/")[1].split()[0]
              for line in make.splitlines() if "train --config configs/train/" in line]
    assert stages == ["recall-lookup.yaml", "recall-then-mix.yaml", "recall-then-mix-arith.yaml",
                      "mix-low-lr.yaml", "mix-arith.yaml", "long-lists.yaml", "raw-marked.yaml",
                      "arith-recall.yaml", "recall-two-keys.yaml", "tiny-bd.yaml", "tiny-mbd.yaml",
                      "tiny-mbd-structured.yaml"]
    for i, stage in enumerate(stages[1:-2], 1):  # each trains on from the stage before it
        assert configs[stage].path(configs[stage].model) == configs[stages[i - 1]].output_dir()
    # the last stage trains on from stage 11's output and writes the shipped default model
    last = configs["tiny-mbd-structured.yaml"]
    assert last.path(last.model) == configs["tiny-mbd.yaml"].output_dir()
    assert last.output_dir() == ROOT / "models" / "tiny-mbd"


def test_a_rare_row_length_still_fills_its_batch():
    """The longest rows of the raw-marked stage are 1.3% of its examples: step 324's batch
    of them takes 3273 draws (it stopped that run when the give-up point was a fixed 100 x
    batch_size = 3200); the give-up point scales with the length's share. A length no example
    needs is still refused, naming the token range."""
    from mbd_jax.train.config import load_train_config
    from mbd_jax.train.trainer import length_shares

    model = load_model("tiny-bd", with_weights=False)
    t = load_train_config(ROOT / "configs" / "train" / "raw-marked.yaml")
    shares = length_shares(t, model.cfg, model.tokenizer)
    assert t.lengths()[-1] == 160 and shares[-1] < 0.02
    batch = batch_for_step(t, model.cfg, model.tokenizer, 324, shares)
    assert batch.clean.shape == (t.batch_size, 160)
    eos = model.cfg.eos_token_ids[0]
    for row in np.asarray(batch.clean):  # every example needs more than 128 tokens
        assert len(row) - (np.cumprod((row == eos)[::-1]).sum() - 1) > 128
    short = dataclasses.replace(t, tasks=("sort",), length_buckets=(128,))
    with pytest.raises(UserError, match=r"seq_len 160: too few sort examples need 129-160 tokens"):
        batch_for_step(short, model.cfg, model.tokenizer, 0, np.array([0.0, 1.0]))
