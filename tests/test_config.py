"""Config loading and validation; every shipped preset is valid."""

import dataclasses

import pytest

from mbd_jax.config import (DecodeConfig, ModelConfig, available_presets, decode_config,
                            load_serve_config, serve_env_names,
                            from_dict, load_model_config, resolve_model_path, MODEL_PRESET_DIR)
from mbd_jax.errors import ConfigError
from mbd_jax.model import sizes


@pytest.mark.parametrize("name", available_presets())
def test_every_preset_and_shipped_model_config_loads(name):
    from mbd_jax import canvas_model

    if canvas_model.is_canvas_model(name):  # its own loader; the block-diffusion one refuses it
        assert canvas_model.load(name, with_weights=False).cfg.canvas_length > 0
        with pytest.raises(ConfigError, match="diffusion_gemma .* `mbd-jax generate` and `mbd-jax serve` run it"):
            load_model_config(resolve_model_path(name))
        return
    cfg = load_model_config(resolve_model_path(name))
    assert sizes.num_params(cfg) > 0 and sizes.active_params_per_token(cfg) <= sizes.num_params(cfg)


def test_real_shape_presets_have_the_published_sizes():
    llada = load_model_config(MODEL_PRESET_DIR / "llada2-mini.yaml")
    assert 15.5e9 < sizes.num_params(llada) < 16.8e9  # "16B total"
    assert 1.2e9 < sizes.active_params_per_token(llada) < 1.8e9  # "~1.4B active"
    sdar = load_model_config(MODEL_PRESET_DIR / "sdar-8b.yaml")
    assert 7.5e9 < sizes.num_params(sdar) < 8.8e9
    moe = load_model_config(MODEL_PRESET_DIR / "sdar-30b-a3b.yaml")
    assert 29e9 < sizes.num_params(moe) < 32e9 and 2.8e9 < sizes.active_params_per_token(moe) < 3.6e9
    import math

    import jax

    from mbd_jax import canvas_model

    dgemma = canvas_model.load("diffusion-gemma-26b-a4b", with_weights=False).cfg
    shapes = canvas_model.param_shapes(dgemma)  # "25.2B total, 3.8B active"
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    experts = sum(math.prod(x.shape) for layer in shapes["layers"]
                  for x in jax.tree.leaves(layer["experts"]))
    active = total - experts * (1 - dgemma.num_experts_per_tok / dgemma.num_experts)
    assert 25.0e9 < total < 25.4e9 and 3.7e9 < active < 3.9e9


def test_qwen3_5_35b_a3b_preset_is_the_transformers_model():
    """The hybrid preset is what convert makes of transformers' Qwen3.5-MoE text config
    (its docs: the 35B-A3B shape; it states no dense MLP width) and counts exactly the parameters
    of transformers' own model built from it (on the meta device: no memory)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from mbd_jax import convert

    preset = load_model_config(MODEL_PRESET_DIR / "qwen3.5-35b-a3b.yaml")
    hf = Qwen3_5MoeTextConfig().to_dict()
    assert "intermediate_size" not in hf
    made = convert.model_config(hf, "qwen3_next", preset.name, "bfloat16", preset.mask_token_id,
                                list(preset.eos_token_ids), 32, "bidirectional")
    assert dataclasses.replace(made, init="none") == preset
    assert (preset.count_layers("full_attention"), preset.count_layers("linear_attention")) == (10, 30)
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig())
    assert sizes.num_params(preset) == sum(p.numel() for p in model.parameters())
    assert abs(sizes.num_params(preset) / 35e9 - 1) < 0.01  # "35B total"
    assert 3.0e9 < sizes.active_params_per_token(preset) < 3.5e9  # "A3B": 3.45B with embedding and head


def test_cross_field_errors_name_the_fields(cfg):
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(d["eos_token_ids"])
    with pytest.raises(ConfigError, match="'num_heads' .* multiple of 'num_kv_heads'"):
        from_dict(ModelConfig, {**d, "num_kv_heads": 3}, "m")
    with pytest.raises(ConfigError, match="'max_seq_len' .* multiple of 'block_size'"):
        from_dict(ModelConfig, {**d, "max_seq_len": 1001}, "m")
    with pytest.raises(ConfigError, match="missing required field 'vocab_size'"):
        from_dict(ModelConfig, {k: v for k, v in d.items() if k != "vocab_size"}, "m")
    with pytest.raises(ConfigError, match="field 'num_layers' must be int, got '3'"):
        from_dict(ModelConfig, {**d, "num_layers": "3"}, "m")


def test_decode_config_validation():
    assert decode_config(buffer_size=2, temperature=None) == DecodeConfig(buffer_size=2)
    with pytest.raises(ConfigError, match="'top_p' must be in \\(0, 1\\]"):
        decode_config(top_p=0.0)
    with pytest.raises(ConfigError, match="'policy' must be one of 'threshold', 'fixed_steps'"):
        decode_config(policy="factor?")
    with pytest.raises(ConfigError, match="'edit_confirm' must be one of 'always', 'context'"):
        decode_config(edit_confirm="never")
    with pytest.raises(ConfigError, match="'block_activation' must be one of 'progress', 'eager'"):
        decode_config(block_activation="lazy")
    with pytest.raises(ConfigError, match="'max_new_tokens' must be in \\[1, "):
        decode_config(max_new_tokens=0)


@pytest.mark.parametrize("field,value,message", [
    # values that once reached the device and overflowed int32 / float32, or looped forever
    ("max_nfe", 2**31, "'max_nfe' must be in \\[1, 1073741824\\]"),
    ("max_post_edit_steps", 2**40, "'max_post_edit_steps' must be in \\[0, 65536\\]"),
    ("steps_per_block", 2**33, "'steps_per_block' must be in"),
    ("seed", -1, "'seed' must be in"),
    ("temperature", float("nan"), "'temperature' must be a finite number"),
    ("factor", float("inf"), "'factor' must be a finite number"),
    ("add_block_threshold", 10**400, "'add_block_threshold' must be a finite number, got a huge"),
    ("voting", {"alpha": 800.0}, "'alpha' must be in \\[0.0, 100.0\\]"),
    ("voting", {"extractor": "regex", "pattern": "(a)\\1"}, "'pattern': not a regex RE2"),
    ("voting", {"extractor": "regex", "pattern": "a{100000}"}, "'pattern': .*repetition"),
    ("voting", {"extractor": "regex", "pattern": "x" * 600}, "'pattern': the pattern has 600"),
])
def test_decode_fields_are_bounded_to_what_the_device_holds(field, value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(DecodeConfig, {field: value}, "decoding")


def test_serve_settings_from_the_environment_sit_between_the_file_and_the_command_line(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("server:\n  port: 8001\n  max_batch_size: 4\n")
    env = {"MBD_SERVER_PORT": "8002", "MBD_SERVER_MAX_BATCH_SIZE": "2", "MBD_MODEL": "tiny-bd",
           "MBD_MONITORING_ENABLED": "false", "UNRELATED": "x"}
    cfg = load_serve_config(path, env=env, **{"server.port": 8003, "server.max_batch_size": None})
    assert (cfg.server.port, cfg.server.max_batch_size, cfg.model) == (8003, 2, "tiny-bd")
    assert cfg.monitoring.enabled is False
    assert "MBD_GENERATION_MAX_NEW_TOKENS_LIMIT" in serve_env_names()
    with pytest.raises(ConfigError, match="field 'port' must be int.*MBD_SERVER_PORT"):
        load_serve_config(path, env={"MBD_SERVER_PORT": "eighty"})
    # a port the socket layer cannot take is named here, not an OverflowError at bind time
    with pytest.raises(ConfigError, match=r"field 'admin_port' must be in \[0, 65535\]"):
        load_serve_config(path, **{"server.admin_port": 70000})
    with pytest.raises(ConfigError, match=r"field 'port' must be in \[1, 65535\]"):
        load_serve_config(path, env={"MBD_SERVER_PORT": "0"})


def test_a_preset_states_only_what_differs_from_its_base(tmp_path):
    """`base:` puts a preset on top of another file beside it (mappings merged key by key); the
    hybrid presets use it, and a wrong or looping base is refused naming the field."""
    causal = load_model_config(MODEL_PRESET_DIR / "tiny-moe-hybrid-causal.yaml")
    bidi = load_model_config(MODEL_PRESET_DIR / "tiny-moe-hybrid-bidirectional.yaml")
    plain = load_model_config(MODEL_PRESET_DIR / "tiny-moe.yaml")
    assert bidi.sequence_module.block_mode == "bidirectional" != causal.sequence_module.block_mode
    assert dataclasses.replace(bidi, name=causal.name, sequence_module=dataclasses.replace(
        bidi.sequence_module, block_mode="causal")) == causal
    assert dataclasses.replace(causal, name=plain.name, sequence_module=None) == plain
    (tmp_path / "a.yaml").write_text((MODEL_PRESET_DIR / "tiny-moe.yaml").read_text().replace(
        "../tokenizers/", str(MODEL_PRESET_DIR.parent / "tokenizers") + "/"))
    (tmp_path / "b.yaml").write_text("base: a.yaml\nname: b\nhidden_size: 64\n")
    b = load_model_config(tmp_path / "b.yaml")
    assert (b.name, b.hidden_size, b.num_layers) == ("b", 64, plain.num_layers)
    (tmp_path / "c.yaml").write_text("base: nowhere.yaml\nname: c\n")
    with pytest.raises(ConfigError, match="c.yaml: field 'base' must name a YAML file beside it, "
                                          "got 'nowhere.yaml'"):
        load_model_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("base: e.yaml\n")
    (tmp_path / "e.yaml").write_text("base: d.yaml\n")
    with pytest.raises(ConfigError, match="field 'base' loops back to"):
        load_model_config(tmp_path / "d.yaml")
