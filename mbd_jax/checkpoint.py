"""Model loading: a preset or YAML (random init from a seed) or a model directory.

A model directory holds `config.yaml` (a ModelConfig), `params/` (an orbax checkpoint of the
parameter tree), optionally a tokenizer named by the config, and `manifest.json` (how it was made
and the sha256 of every file, checked on load).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(model_dir: pathlib.Path, info: dict[str, Any]) -> dict[str, Any]:
    """Writes manifest.json: `info` plus the sha256 of every file in the directory."""
    manifest = dict(info)
    manifest["files"] = {str(p.relative_to(model_dir)): _sha256(p)
                         for p in sorted(model_dir.rglob("*"))
                         if p.is_file() and p.name != "manifest.json"}
    (model_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def verify_manifest(model_dir: pathlib.Path) -> None:
    """Every file the manifest lists exists with its sha256; raises naming the first bad file."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    for rel, digest in manifest["files"].items():
        p = model_dir / rel
        if not p.is_file():
            raise ConfigError(f"model {model_dir}: file {rel} listed in manifest.json is missing")
        if _sha256(p) != digest:
            raise ConfigError(f"model {model_dir}: file {rel} does not match its checksum in "
                              "manifest.json (corrupt or truncated)")


def _restore_params(path: pathlib.Path, cfg: ModelConfig) -> Any:
    import orbax.checkpoint as ocp

    from mbd_jax.model.transformer import init_params

    if not (path / "params").is_dir():
        raise ConfigError(f"model {path}: config.yaml says init: checkpoint but params/ is missing")
    target = jax.eval_shape(lambda: init_params(cfg))
    try:
        return ocp.StandardCheckpointer().restore((path / "params").absolute(), target)
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
            if (config_path.parent / "manifest.json").is_file():  # check every file
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
