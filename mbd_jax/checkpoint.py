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
from jax.sharding import Mesh

from mbd_jax.config import (GENERATION_FILE, ModelConfig, config_dict, latest_version,
                             load_model_config, model_generation_settings, resolve_model_path,
                             with_runtime)
from mbd_jax.errors import ConfigError
from mbd_jax.parallel import mesh as meshlib
from mbd_jax.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Any
    tokenizer: Tokenizer | None
    path: pathlib.Path


def save_model(out_dir: str | pathlib.Path, cfg: ModelConfig, params: Any, *,
               canonical: bool = False) -> pathlib.Path:
    """Writes config.yaml and params/ (orbax, canonical layout: model/layout.py) into out_dir;
    `params` is in `cfg`'s runtime layout, or canonical already with `canonical`. Sharded parameters are written shard by shard, each
    process its own (call it on every process of a multi-process job)."""
    import orbax.checkpoint as ocp

    from mbd_jax.model import layout

    out = pathlib.Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        d = config_dict(dataclasses.replace(cfg, init="checkpoint"))
        (out / "config.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    ckpt = ocp.StandardCheckpointer()
    if not canonical:
        params = layout.convert(params, cfg, layout.to_canonical)
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
    """Writes manifest.json: `info` plus the sha256 of every file in the directory but the
    settings file beside the weights (config.GENERATION_FILE), which may be tuned in place."""
    manifest = dict(info)
    manifest["files"] = {str(p.relative_to(model_dir)): _sha256(p)
                         for p in sorted(model_dir.rglob("*"))
                         if p.is_file() and p.name != "manifest.json"
                         and p.relative_to(model_dir) != pathlib.Path(GENERATION_FILE)}
    (model_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def manifest_problems(model_dir: pathlib.Path) -> list[str]:
    """Every file manifest.json lists that is missing or differs from its sha256, one line each
    (empty: all match)."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    problems = []
    for rel, digest in manifest["files"].items():
        p = model_dir / rel
        if not p.is_file():
            problems.append(f"file {rel} listed in manifest.json is missing")
        elif _sha256(p) != digest:
            problems.append(f"file {rel} does not match its checksum in manifest.json (corrupt or "
                            "truncated)")
    return problems


def verify_manifest(model_dir: pathlib.Path) -> None:
    """Every file the manifest lists exists with its sha256; raises naming the first bad file."""
    problems = manifest_problems(model_dir)
    if problems:
        raise ConfigError(f"model {model_dir}: {problems[0]}")


def verify_model_dir(model_dir: str | pathlib.Path) -> list[tuple[str, str | None]]:
    """Checks a model directory without loading its weights: config.yaml is a valid model
    config, every file matches manifest.json, params/ holds exactly the parameters the config
    describes (names, shapes, dtypes, from orbax's metadata), the tokenizer loads and fits the
    vocabulary, generation.yaml (when present) holds valid settings. Returns (check, problem or
    None) per check; a check that cannot run after an earlier failure is skipped."""
    from mbd_jax.model import layout
    from mbd_jax.model.transformer import param_shapes

    d = pathlib.Path(model_dir).absolute()
    results: list[tuple[str, str | None]] = []
    if not (d / "config.yaml").is_file() and latest_version(d) is not None:
        d = latest_version(d)  # a directory of versions: the one the service would load
        results.append((f"newest version {d.name}", None))
    if not (d / "config.yaml").is_file():
        return [("config.yaml", f"{d} has no config.yaml (not a model directory)")]
    try:
        cfg = load_model_config(d / "config.yaml")
        results.append(("config.yaml", None))
    except ConfigError as e:
        return [("config.yaml", str(e))]
    if (d / "manifest.json").is_file():
        try:
            problems = manifest_problems(d)
        except (ValueError, KeyError, AttributeError) as e:
            problems = [f"manifest.json is not a valid manifest ({type(e).__name__})"]
        results += [("checksums", p) for p in problems] or [("checksums", None)]
    else:
        results.append(("checksums", "no manifest.json: the files cannot be checked"))
    if cfg.init == "checkpoint":
        results.append(("parameters", params_problem(d / "params",
                                                     param_shapes(layout.canonical(cfg)))))
    if cfg.tokenizer:
        try:
            tok = load_tokenizer((d / cfg.tokenizer).resolve())
            results.append(("tokenizer", None if tok.vocab_size <= cfg.vocab_size else
                            f"tokenizer has {tok.vocab_size} tokens, vocab_size is "
                            f"{cfg.vocab_size}"))
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            results.append(("tokenizer", f"{cfg.tokenizer} does not load ({e})"))
    if (d / GENERATION_FILE).is_file():
        try:
            model_generation_settings(str(d))
            results.append((GENERATION_FILE, None))
        except ConfigError as e:
            results.append((GENERATION_FILE, str(e)))
    return results


def params_problem(params_dir: pathlib.Path, want: Any) -> str | None:
    """The first way the orbax checkpoint at params_dir differs from `want` (a tree of shapes
    and dtypes): a missing or extra parameter, a shape, a dtype; None when it matches. Reads
    orbax's metadata only."""
    import orbax.checkpoint as ocp

    try:
        got = ocp.StandardCheckpointer().metadata(params_dir).item_metadata
    except Exception as e:  # orbax raises many types for a damaged checkpoint
        return f"params/ is unreadable ({type(e).__name__}: {str(e)[:200]})"
    want_flat = {"/".join(k): v for k, v in _flat(want)}
    got_flat = {"/".join(k): v for k, v in _flat(dict(got))}
    for name in sorted(want_flat.keys() | got_flat.keys()):
        w, g = want_flat.get(name), got_flat.get(name)
        if w is None or g is None:
            return (f"parameter {name} is in params/ but not in the config's model" if w is None
                    else f"parameter {name} is missing from params/")
        if tuple(g.shape) != tuple(w.shape) or str(g.dtype) != str(w.dtype):
            return (f"parameter {name} is {g.dtype}{list(g.shape)} in params/, the config needs "
                    f"{w.dtype}{list(w.shape)}")
    return None


def _flat(tree: Any, prefix: tuple = ()):
    if isinstance(tree, (dict, list)):
        for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            yield from _flat(v, prefix + (str(k),))
    else:
        yield prefix, tree


def _restore_params(path: pathlib.Path, cfg: ModelConfig, mesh: Mesh) -> Any:
    """Each device reads its own shards of params/ straight into place (the target carries the
    mesh's shardings): no process holds a full host copy, and any mesh shape can read a
    checkpoint written under any other. The canonical tree on disk is then stacked into `cfg`'s
    runtime layout when it scans its layers (both copies are alive while that runs)."""
    import orbax.checkpoint as ocp

    from mbd_jax.model import layout, sharding

    if not (path / "params").is_dir():
        raise ConfigError(f"model {path}: config.yaml says init: checkpoint but params/ is missing")
    target = sharding.abstract_params(layout.canonical(cfg), mesh)
    try:
        params = ocp.StandardCheckpointer().restore((path / "params").absolute(), target)
    except Exception as e:  # orbax/tensorstore raise many types for a damaged checkpoint
        raise ConfigError(f"model {path}: params/ cannot be restored against config.yaml "
                          f"({type(e).__name__}: {str(e)[:300]})") from None
    return layout.convert(params, cfg, layout.to_runtime, sharding.param_shardings(cfg, mesh))


def load_model(model: str, *, with_weights: bool = True, random_weights: bool = False,
               mesh: Mesh | None = None, runtime: dict[str, Any] | None = None) -> LoadedModel:
    """A model by preset name, YAML or directory, its parameters sharded over `mesh` (default:
    the first device). `random_weights`: initialise from the seed whatever the config says (benches
    of shape-only presets); `with_weights=False`: the config and tokenizer only. `runtime`:
    overrides of config.RUNTIME_FIELDS (moe_impl, attention_impl, ...), applied after the model
    directory's files passed their checksums; `runtime` quantization of a float model quantizes its
    weights as they load (each device its own shards)."""
    from mbd_jax.model import sharding
    from mbd_jax.model.quantize import quantize_tree
    from mbd_jax.model.transformer import init_params, param_shapes

    config_path = resolve_model_path(model)
    stored = load_model_config(config_path)
    cfg = with_runtime(stored, runtime, where=f"model {model} runtime settings")
    mesh = mesh if mesh is not None else meshlib.single_device_mesh()
    params = None
    if with_weights:
        if cfg.init == "random" or random_weights:
            params = init_params(cfg, mesh=mesh)
        elif cfg.init == "checkpoint":
            if (config_path.parent / "manifest.json").is_file():  # check every file
                verify_manifest(config_path.parent)
            as_stored = dataclasses.replace(cfg, quantization=stored.quantization)
            params = _restore_params(config_path.parent, as_stored, mesh)
            if cfg.quantization != stored.quantization:  # a float model quantized as it loads
                params = quantize_tree(params, param_shapes(cfg),
                                       sharding.param_shardings(cfg, mesh))
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
