"""A model directory (config.yaml + orbax params) round-trips to identical generations."""

import dataclasses

import jax
import numpy as np
import pytest

from mbd_jax.checkpoint import load_model, save_model
from mbd_jax.config import DecodeConfig
from mbd_jax.engine import Engine
from mbd_jax.errors import ConfigError


def test_save_and_load_model_dir(tmp_path, cfg, params):
    params = jax.tree.map(lambda x: x * 1.5, params)  # not what the random init would give
    out = save_model(tmp_path / "m", dataclasses.replace(cfg, tokenizer=None), params)
    loaded = load_model(str(out))
    assert loaded.cfg.init == "checkpoint"
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    d = DecodeConfig(max_new_tokens=10)
    want = Engine(cfg, params, batch_size=1).generate([[11, 12, 13]], d)[0].token_ids
    got = Engine(loaded.cfg, loaded.params, batch_size=1).generate([[11, 12, 13]], d)[0].token_ids
    assert got == want


def test_model_dir_given_as_a_relative_path(tmp_path, cfg, params, monkeypatch):
    save_model(tmp_path / "m", dataclasses.replace(cfg, tokenizer=None), params)
    monkeypatch.chdir(tmp_path)
    loaded = load_model("m")  # orbax wants absolute paths; the loader makes them so
    assert loaded.cfg.name == cfg.name and len(jax.tree.leaves(loaded.params)) > 0


def test_model_dir_without_params_is_a_clear_error(tmp_path, cfg, params):
    out = save_model(tmp_path / "m", dataclasses.replace(cfg, tokenizer=None), params)
    import shutil
    shutil.rmtree(out / "params")
    with pytest.raises(ConfigError, match="params/ is missing"):
        load_model(str(out))


def test_shape_only_preset_needs_weights():
    with pytest.raises(ConfigError, match="describes a shape only"):
        load_model("llada2-mini")


def test_runtime_overrides_apply_after_the_checksum_and_nothing_else_changes():
    m = load_model("tiny-mbd", runtime={"moe_impl": "dense", "attention_chunk": 64,
                                        "compute_dtype": None})
    base = load_model("tiny-mbd", with_weights=False)
    assert m.cfg.moe_impl == "dense" and m.cfg.attention_chunk == 64
    assert m.cfg.compute_dtype == base.cfg.compute_dtype  # None keeps the model's value
    with pytest.raises(ConfigError, match="num_layers cannot be overridden at load time"):
        load_model("tiny-mbd", runtime={"num_layers": 3})
    with pytest.raises(ConfigError, match="'moe_impl' must be one of"):
        load_model("tiny-mbd", runtime={"moe_impl": "fast"})


def test_verify_names_a_flipped_and_a_missing_file_and_a_wrong_shape(tmp_path):
    """`mbd-jax verify` (no weights loaded): the shipped model passes; a byte flipped in a
    parameter file, a deleted file, or a config whose shapes disagree with params/ are each named,
    and the command exits 1."""
    import pathlib
    import shutil
    import subprocess
    import sys

    from mbd_jax.checkpoint import verify_model_dir

    shipped = pathlib.Path(__file__).resolve().parent.parent / "models" / "tiny-mbd"
    assert all(problem is None for _, problem in verify_model_dir(shipped))
    bad = tmp_path / "m"
    shutil.copytree(shipped, bad)
    data = max((p for p in (bad / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    (bad / "tokenizer.model").unlink()
    problems = [p for _, p in verify_model_dir(bad) if p]
    rel = data.relative_to(bad).as_posix()
    assert f"file {rel} does not match its checksum" in " ".join(problems)
    assert "file tokenizer.model listed in manifest.json is missing" in " ".join(problems)

    wrong = tmp_path / "w"
    shutil.copytree(shipped, wrong)
    cfg = (wrong / "config.yaml").read_text()
    (wrong / "config.yaml").write_text(cfg.replace("num_layers: 4", "num_layers: 5"))
    problems = " ".join(p for _, p in verify_model_dir(wrong) if p)
    assert "file config.yaml does not match its checksum" in problems
    assert "parameter layer_4/" in problems and "missing from params/" in problems

    r = subprocess.run([sys.executable, "-m", "mbd_jax", "verify", str(bad)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and rel in r.stdout and "3 problem(s)" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr
