"""Where the shipped data lives and how a model name resolves to its config file."""

from __future__ import annotations

import pathlib

from mbd_jax.errors import ConfigError

# configs/ and models/ live in the checkout (editable install, tests, `make`); an installed wheel
# carries them as mbd_jax/configs and mbd_jax/models.
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent  # mbd_jax/
IN_CHECKOUT = (_PACKAGE.parent / "pyproject.toml").is_file() and (_PACKAGE.parent / "configs").is_dir()
DATA_ROOT = _PACKAGE.parent if IN_CHECKOUT else _PACKAGE
# Relative paths in configs (training outputs, checkpoints) resolve against the checkout, or the
# working directory for an installed package (never into site-packages).
REPO_ROOT = _PACKAGE.parent if IN_CHECKOUT else pathlib.Path.cwd()
MODEL_PRESET_DIR = DATA_ROOT / "configs" / "models"  # architectures (random init or shape only)
SHIPPED_MODEL_DIR = DATA_ROOT / "models"  # trained models shipped with mbd-jax (tiny-bd, tiny-mbd)
# The service's settings when `mbd-jax serve` is given no --config (what `make run` serves with)
DEFAULT_SERVE_CONFIG = DATA_ROOT / "configs" / "serve.yaml"


def shipped(path: str | pathlib.Path) -> pathlib.Path:
    """`path` when something is there; else, for a relative path, the shipped data's file or
    directory at it (configs/train/tiny-mbd.yaml from an installed wheel or another working
    directory), or the shipped model of that name (tiny-mbd); else `path` as given (its own
    error follows)."""
    p = pathlib.Path(path)
    if p.exists() or p.is_absolute():
        return p
    return next((c for c in (DATA_ROOT / p, SHIPPED_MODEL_DIR / p) if c.exists()), p)


def available_presets() -> list[str]:
    shipped = [p.parent.name for p in SHIPPED_MODEL_DIR.glob("*/config.yaml")]
    return sorted(shipped + [p.stem for p in MODEL_PRESET_DIR.glob("*.yaml")])


def model_version(model_dir: pathlib.Path) -> str:
    """A model directory's version: its name when that is v<N> (models/<name>/v<N>/), else ''."""
    return model_dir.name if model_dir.name[:1] == "v" and model_dir.name[1:].isdigit() else ""


def latest_version(root: pathlib.Path) -> pathlib.Path | None:
    """The highest `v<N>` subdirectory of `root` that holds a config.yaml (models/<name>/v<N>/,
    docs/deploy.md), None when there is none. N compares as a number: v10 is newer than v9."""
    versions = [(int(d.name[1:]), d) for d in root.glob("v*")
                if model_version(d) and (d / "config.yaml").is_file()]
    return max(versions)[1] if versions else None


def resolve_model_path(model: str) -> pathlib.Path:
    """A shipped model or preset name, a YAML file, a directory holding config.yaml (a converted
    or trained model), or a directory of versions `v1/`, `v2/`, ... (its newest version)."""
    p = pathlib.Path(model)
    if p.is_dir():
        if (p / "config.yaml").is_file():
            return p / "config.yaml"
        newest = latest_version(p)
        if newest is None and (p / "config.json").is_file():
            raise ConfigError(f"--model {model}: a Hugging Face checkpoint (config.json, no "
                              f"config.yaml): convert it first, e.g. mbd-jax convert --src {model} "
                              f"--dst models/{p.resolve().name}")
        if newest is None:
            raise ConfigError(f"--model {model}: the directory has no config.yaml and no version "
                              "subdirectory (v1/, v2/, ...) holding one")
        return newest / "config.yaml"
    if p.is_file():
        return p
    shipped = SHIPPED_MODEL_DIR / model / "config.yaml"
    if "/" not in model and shipped.is_file():
        return shipped
    preset = MODEL_PRESET_DIR / f"{model}.yaml"
    if preset.is_file():
        return preset
    raise ConfigError(
        f"--model {model!r}: not a preset, a YAML file or a model directory; "
        f"presets: {', '.join(available_presets())}"
    )
