"""Versioned model directories (models/<name>/v<N>/) and the generation settings kept beside the
weights (generation.yaml): which version a name loads, which setting wins, and the checks."""

from __future__ import annotations

import shutil

import pytest
import yaml

from mbd_jax import cli
from mbd_jax.checkpoint import verify_model_dir, write_manifest
from mbd_jax.config import (GENERATION_FILE, SHIPPED_MODEL_DIR, ServeConfig, load_serve_config,
                            model_generation_settings, model_version, resolve_model_path)
from mbd_jax.errors import ConfigError


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """models/tiny/{v1, v2, v10}: copies of the shipped tiny-mbd; only v2 carries a
    generation.yaml (its own)."""
    root = tmp_path_factory.mktemp("models") / "tiny"
    for v in ("v1", "v2", "v10"):
        shutil.copytree(SHIPPED_MODEL_DIR / "tiny-mbd", root / v)
        (root / v / GENERATION_FILE).unlink()
    (root / "v2" / GENERATION_FILE).write_text(yaml.safe_dump({
        "generation": {"max_new_tokens": 32, "thinking_mode": True},
        "decoding": {"accept_threshold": 0.8, "buffer_size": 1, "temperature": 0.5}}))
    (root / "notes").mkdir()  # neither a version nor a model: ignored
    return root


def test_a_directory_of_versions_loads_its_newest_and_a_named_version_rolls_back(versions):
    assert resolve_model_path(str(versions)) == versions / "v10" / "config.yaml"  # 10 > 2, not "v2"
    assert resolve_model_path(str(versions / "v1")) == versions / "v1" / "config.yaml"
    assert [model_version(versions / n) for n in ("v10", "v1x", "notes")] == ["v10", "", ""]
    assert load_serve_config(None, model=str(versions)).model == str(versions)
    with pytest.raises(ConfigError, match="no version subdirectory"):
        resolve_model_path(str(versions / "notes"))


def test_the_models_generation_settings_fill_what_the_serve_config_leaves_out(versions, tmp_path):
    v2 = str(versions / "v2")
    # No serve config: the model's values over ServeConfig's defaults (buffer_size 2 -> 1 here)
    cfg = load_serve_config(None, model=v2)
    assert (cfg.decoding.accept_threshold, cfg.decoding.buffer_size, cfg.decoding.temperature) \
        == (0.8, 1, 0.5)
    assert cfg.generation.max_new_tokens == 32 and cfg.generation.thinking_mode is True
    assert cfg.decoding.add_block_threshold == ServeConfig().decoding.add_block_threshold
    # The serve config's own fields win, the environment over those, the command line over all
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump({"model": v2, "decoding": {"accept_threshold": 0.9}}))
    cfg = load_serve_config(serve_yaml)
    assert (cfg.decoding.accept_threshold, cfg.decoding.temperature) == (0.9, 0.5)
    cfg = load_serve_config(serve_yaml, env={"MBD_DECODING_TEMPERATURE": "0"})
    assert cfg.decoding.temperature == 0.0
    # Another version without the file: only the serve config's values
    cfg = load_serve_config(serve_yaml, env={"MBD_MODEL": str(versions / "v1")})
    assert (cfg.decoding.temperature, cfg.generation.max_new_tokens) == (0.0, 128)


def test_offline_commands_take_the_models_decoding_defaults_under_their_flags(versions):
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--model", str(versions / "v2"), "--prompt", "x"])
    assert cli._decode_config(args).accept_threshold == 0.8
    args = parser.parse_args(["generate", "--model", str(versions / "v2"), "--prompt", "x",
                              "--accept-threshold", "0.7"])
    decode = cli._decode_config(args)
    assert (decode.accept_threshold, decode.temperature) == (0.7, 0.5)


def test_generate_starts_from_what_the_service_gives_a_request_for_the_same_model(versions):
    """One set of defaults: `generate` without flags decodes with the settings `mbd-jax serve`
    (the shipped configs/serve.yaml) gives a request that sets nothing, and that config leaves a
    model's generation.yaml in force (v2's N_buf 1, tau_accept 0.8, 32 tokens, temperature
    0.5), where the shipped tiny-mbd gets MultiBD N_buf 2 and its 64-token default."""
    from mbd_jax.config import decode_config

    parser = cli.build_parser()
    got = {}
    for name, model in (("v2", str(versions / "v2")), ("tiny-mbd", "tiny-mbd")):
        service = cli.serve_config(parser.parse_args(["serve", "--model", model]))
        got[name] = cli._decode_config(parser.parse_args(["generate", "--model", model,
                                                          "--prompt", "x"]))
        assert got[name] == decode_config(**service.decode_defaults())
    v2, tiny = got["v2"], got["tiny-mbd"]
    assert (v2.buffer_size, v2.accept_threshold, v2.max_new_tokens, v2.temperature) == (
        1, 0.8, 32, 0.5)
    assert (tiny.buffer_size, tiny.accept_threshold, tiny.max_new_tokens, tiny.temperature) == (
        2, 0.95, 64, 0.0)


@pytest.mark.parametrize("text,named", [
    ("decoding:\n  acept_threshold: 0.8\n", "acept_threshold"),
    ("decoding:\n  accept_threshold: 1.5\n", "accept_threshold"),
    ("sampling:\n  top_k: 3\n", "sampling"),
    ("decoding: [1, 2]\n", "decoding"),
])
def test_a_bad_generation_file_is_named_by_loading_and_by_verify(versions, tmp_path, text, named):
    d = tmp_path / "m"
    shutil.copytree(versions / "v1", d)
    (d / GENERATION_FILE).write_text(text)
    with pytest.raises(ConfigError, match=named) as e:
        load_serve_config(None, model=str(d))
    assert GENERATION_FILE in str(e.value)
    problems = {check: p for check, p in verify_model_dir(d) if p}
    assert list(problems) == [GENERATION_FILE] and named in problems[GENERATION_FILE]


def test_generation_settings_stay_outside_the_checksums(versions, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(versions / "v2", d)
    manifest = write_manifest(d, {"written_by": "test"})
    assert GENERATION_FILE not in manifest["files"] and "config.yaml" in manifest["files"]
    (d / GENERATION_FILE).write_text("decoding:\n  accept_threshold: 0.6\n")  # tuned in place
    assert all(p is None for _, p in verify_model_dir(d))
    assert model_generation_settings(str(d)) == {"decoding": {"accept_threshold": 0.6}}
    (d / "config.yaml").write_text((d / "config.yaml").read_text() + "\n")  # not a setting
    assert any(p and "config.yaml" in p for _, p in verify_model_dir(d))


def test_verify_on_a_directory_of_versions_checks_the_newest(versions):
    results = verify_model_dir(versions)
    assert results[0] == ("newest version v10", None)
    assert all(p is None for _, p in results)
