"""A Hugging Face checkpoint directory as a source of tensors (`TensorSource`: *.safetensors,
single or sharded, or PyTorch *.bin files, read one tensor at a time) and of the files copied
beside a converted model (`TOKENIZER_FILES`). Every family's converter reads through it."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from mbd_jax.errors import UserError

CONVERTER_VERSION = "1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json")


class TensorSource:
    """Reads named tensors from *.safetensors (single or sharded) or PyTorch *.bin files."""

    def __init__(self, src: pathlib.Path):
        self.src = src
        st = sorted(src.glob("*.safetensors"))
        bins = sorted(p for p in src.glob("*.bin") if p.name != "training_args.bin")
        index = next((src / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                      if (src / n).is_file()), None)
        if index is not None:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (src / f).is_file()]
            if missing:
                raise UserError(f"{index.name} names shard {missing[0]}, which is not in {src}")
            self.files = [src / f for f in files]
        elif st:
            self.files = st
        elif bins:
            self.files = bins
        else:
            raise UserError(f"{src}: no *.safetensors or *.bin weights found")
        self.names: dict[str, pathlib.Path] = {}
        for f in self.files:
            for n in self._keys(f):
                self.names[n] = f
        self._bin_cache: tuple[pathlib.Path, dict] | None = None

    @staticmethod
    def _keys(f: pathlib.Path) -> list[str]:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(f), framework="numpy") as h:
                    return list(h.keys())
            except Exception as e:  # safetensors raises its own error types
                raise UserError(f"{f.name}: not a readable safetensors file ({e})") from None
        return list(_torch_load(f).keys())

    def get(self, name: str) -> np.ndarray:
        f = self.names.get(name)
        if f is None:
            raise UserError(f"checkpoint is missing tensor '{name}'")
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:  # pt: bfloat16 tensors load too
                return _to_numpy(h.get_tensor(name))
        if self._bin_cache is None or self._bin_cache[0] != f:  # one .bin shard in memory at a time
            self._bin_cache = (f, _torch_load(f))
        return _to_numpy(self._bin_cache[1][name])

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def _torch_load(f: pathlib.Path) -> dict:
    try:
        import torch
    except ImportError:
        raise UserError(f"{f.name}: reading PyTorch .bin files needs torch (pip install "
                        "'mbd-jax[convert]')") from None
    return torch.load(str(f), map_location="cpu", weights_only=True)


def _to_numpy(t) -> np.ndarray:
    """A torch tensor as numpy without a copy (bfloat16 as ml_dtypes.bfloat16, not upcast)."""
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
