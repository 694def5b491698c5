"""Model loading: a preset or YAML (random init from a seed) or a model directory.

A model directory holds `config.yaml` (a ModelConfig), `params/` (an orbax checkpoint of the
parameter tree) and, optionally, a tokenizer named by the config.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import yaml

from mbd_jax.config import ModelConfig, from_dict, load_yaml, resolve_model_path
from mbd_jax.errors import ConfigError
from mbd_jax.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Any
    tokenizer: Tokenizer | None
    path: pathlib.Path


def save_model(out_dir: str | pathlib.Path, cfg: ModelConfig, params: Any) -> pathlib.Path:
    """Writes config.yaml and params/ (orbax) into out_dir."""
    import orbax.checkpoint as ocp

    out = pathlib.Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    d = dataclasses.asdict(dataclasses.replace(cfg, init="checkpoint"))
    d["eos_token_ids"] = list(d["eos_token_ids"])
    (out / "config.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(out / "params", params, force=True)
    ckpt.wait_until_finished()
    return out


def _restore_params(path: pathlib.Path, cfg: ModelConfig) -> Any:
    import orbax.checkpoint as ocp

    from mbd_jax.model.transformer import init_params

    if not (path / "params").is_dir():
        raise ConfigError(f"model {path}: config.yaml says init: checkpoint but params/ is missing")
    target = jax.eval_shape(lambda: init_params(cfg))
    try:
        return ocp.StandardCheckpointer().restore(path / "params", target)
    except Exception as e:  # orbax/tensorstore raise many types for a damaged checkpoint
        raise ConfigError(f"model {path}: params/ cannot be restored against config.yaml "
                          f"({type(e).__name__}: {str(e)[:300]})") from None


def load_model(model: str, *, with_weights: bool = True) -> LoadedModel:
    from mbd_jax.model.transformer import init_params

    config_path = resolve_model_path(model)
    cfg = from_dict(ModelConfig, load_yaml(config_path), where=str(config_path))
    params = None
    if with_weights:
        if cfg.init == "random":
            params = init_params(cfg)
        elif cfg.init == "checkpoint":
            if (config_path.parent / "manifest.json").is_file():  # converted: check every file
                from mbd_jax.convert import verify_manifest

                verify_manifest(config_path.parent)
            params = _restore_params(config_path.parent, cfg)
        else:
            raise ConfigError(
                f"model {model}: {config_path.name} describes a shape only (init: none); convert a "
                "checkpoint into a model directory first, or bench it with --random-weights")
    tokenizer = None
    if cfg.tokenizer:
        tokenizer = load_tokenizer((config_path.parent / cfg.tokenizer).resolve())
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ConfigError(f"model {model}: tokenizer has {tokenizer.vocab_size} tokens but "
                              f"vocab_size is {cfg.vocab_size}")
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, path=config_path)
