"""A quantized copy of an mbd-jax model directory (`mbd-jax convert --src MODEL_DIR --quantize
SCHEME`): the same model with its weight matrices in 8 bits (model/quantize.py), written as a
model directory of its own, so a model converted once need not be read from its source again."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

from mbd_jax.checkpoint import load_model, save_model, write_manifest
from mbd_jax.config import load_model_config
from mbd_jax.errors import UserError
from mbd_jax.model.sizes import num_params

# What a model directory holds that the copy writes anew; everything else is copied as it is.
WRITTEN = ("config.yaml", "params", "manifest.json")


def is_model_dir(path: pathlib.Path) -> bool:
    return (path / "config.yaml").is_file() and not (path / "config.json").is_file()


def quantized_copy(src: str | pathlib.Path, dst: str | pathlib.Path, scheme: str) -> dict[str, Any]:
    """Loads `src` (checksums verified) with its weights quantized to `scheme`, writes `dst`;
    returns the manifest."""
    src, dst = pathlib.Path(src).absolute(), pathlib.Path(dst).absolute()
    if dst == src:
        raise UserError(f"--dst {dst}: is the source directory; write the quantized copy beside it")
    stored = load_model_config(src / "config.yaml")
    if stored.quantization != "none":
        raise UserError(f"--src {src}: its weights are already quantized ({stored.quantization}); "
                        "quantize the float model it was made from")
    if stored.init != "checkpoint":
        raise UserError(f"--src {src}: its config.yaml holds no weights (init: {stored.init})")
    model = load_model(str(src), runtime={"quantization": scheme})
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.name in WRITTEN:
            continue
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, dst / p.name)
    save_model(dst, model.cfg, model.params)
    source = json.loads((src / "manifest.json").read_text()) if (src / "manifest.json").is_file() \
        else {}
    info = {k: v for k, v in source.items() if k not in ("files", "quantization", "source_model")}
    return write_manifest(dst, {
        **info, "source_model": str(src), "quantization": scheme,
        "parameters": num_params(model.cfg)})
