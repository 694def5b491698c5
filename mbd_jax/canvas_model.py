"""A uniform-noise (DiffusionGemma) model directory: what `mbd-jax convert` writes for the family
and `mbd-jax generate` reads.

    config.yaml     family: diffusion_gemma, then DiffusionGemmaConfig's fields
    params/         orbax checkpoint of the parameter tree (model/diffusion_gemma.py)
    generation.yaml `canvas`: CanvasDecoding defaults (from the source's generation_config.json)
    tokenizer.json  ... copied from the source
    manifest.json   how it was made and the sha256 of every file but generation.yaml

A preset YAML with the same fields and `init: random` (configs/models/tiny-dgemma.yaml) draws
random weights from its seed instead of params/.
"""

from __future__ import annotations

import dataclasses
import pathlib
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import yaml

from mbd_jax.config import (GENERATION_FILE, Quantization, config_dict, from_dict, load_yaml,
                            resolve_model_path)
from mbd_jax.config.diffusion_gemma import CanvasDecoding, DiffusionGemmaConfig
from mbd_jax.errors import ConfigError
from mbd_jax.model import quantize
from mbd_jax.tokenizer import Tokenizer, load_tokenizer

FAMILY = "diffusion_gemma"
FILE_KEYS = ("family", "init", "seed", "tokenizer")  # config.yaml keys beside the model's fields


@dataclasses.dataclass
class CanvasModel:
    cfg: DiffusionGemmaConfig
    params: Any
    tokenizer: Tokenizer | None
    decoding: CanvasDecoding  # the model's defaults
    path: pathlib.Path  # its config.yaml


def is_canvas_model(model: str) -> bool:
    """Whether `model` (a name, YAML or directory) names a model of this family."""
    try:
        data = load_yaml(resolve_model_path(model))
    except ConfigError:
        return False
    return isinstance(data, dict) and data.get("family") == FAMILY


def save(dst: pathlib.Path, cfg: DiffusionGemmaConfig, params: Any, decoding: CanvasDecoding,
         tokenizer: str | None) -> None:
    """config.yaml, params/ and generation.yaml into dst."""
    import orbax.checkpoint as ocp

    dst = dst.absolute()
    dst.mkdir(parents=True, exist_ok=True)
    data = {"family": FAMILY, "init": "checkpoint", "tokenizer": tokenizer, **config_dict(cfg)}
    (dst / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (dst / GENERATION_FILE).write_text(
        "# Denoising defaults from the source's generation_config.json (mbd-jax convert);\n"
        "# settings, outside manifest.json's checksums: tune them here.\n"
        + yaml.safe_dump({"canvas": config_dict(decoding)}, sort_keys=False))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(dst / "params", jax.tree.map(jnp.asarray, params), force=True)
    ckpt.wait_until_finished()


# The weight matrices an 8-bit model stores quantized (model/quantize.py: values in the scheme's
# dtype, a float32 `name_scale` per output channel); the embedding (also the LM head and
# self-conditioning's table), norms, router and scalars stay in `dtype`.
QUANTIZED = ("q", "k", "v", "o", "gate", "up", "down")


def param_shapes(cfg: DiffusionGemmaConfig, quantization: Quantization = "none") -> dict:
    """The parameter tree's shapes and dtypes (jax.ShapeDtypeStruct leaves); with an 8-bit
    `quantization`, each QUANTIZED weight in its dtype beside its scale (contracted axis 1)."""
    tree = _float_shapes(cfg)
    return tree if quantization == "none" else _quantized_shapes(tree, quantization)


def _quantized_shapes(tree: dict, scheme: str) -> dict:
    out = {}
    for name, leaf in tree.items():
        if isinstance(leaf, (dict, list)):
            out[name] = ([_quantized_shapes(x, scheme) for x in leaf] if isinstance(leaf, list)
                         else _quantized_shapes(leaf, scheme))
        elif name in QUANTIZED and len(leaf.shape) >= 2:
            contract = (len(leaf.shape) - 2,)  # the input axis: [in, out] or [E, in, out]
            out[name] = jax.ShapeDtypeStruct(leaf.shape, quantize.SCHEMES[scheme].dtype)
            out[name + quantize.SCALE_SUFFIX] = jax.ShapeDtypeStruct(
                quantize.scale_shape(leaf.shape, contract), jnp.float32)
        else:
            out[name] = leaf
    return out


def quantized(params: dict, cfg: DiffusionGemmaConfig, scheme: str) -> dict:
    """A float parameter tree with its QUANTIZED weights in 8 bits (absmax per output
    channel, model/quantize.py) beside their scales."""
    return _quantize_like(params, param_shapes(cfg, scheme), scheme)


def _quantize_like(params: Any, target: Any, scheme: str) -> Any:
    if isinstance(target, list):
        return [_quantize_like(p, t, scheme) for p, t in zip(params, target)]
    out = {}
    for name, leaf in params.items():
        if isinstance(leaf, (dict, list)):
            out[name] = _quantize_like(leaf, target[name], scheme)
        elif name + quantize.SCALE_SUFFIX in target and name in QUANTIZED:
            out[name], out[name + quantize.SCALE_SUFFIX] = quantize.quantize(
                leaf, scheme, (leaf.ndim - 2,))
        else:
            out[name] = leaf
    return out


def _float_shapes(cfg: DiffusionGemmaConfig) -> dict:
    dt = jnp.dtype(cfg.dtype)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    d, i, e, f = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.moe_intermediate_size
    layers = []
    for layer in range(cfg.num_layers):
        kh, dh = cfg.head(layer)
        attn = {"q": s(d, cfg.num_heads * dh), "k": s(d, kh * dh), "o": s(cfg.num_heads * dh, d),
                "q_norm": s(dh), "k_norm": s(dh)}
        if cfg.layer_types[layer] == "sliding_attention":
            attn["v"] = s(d, kh * dh)
        layers.append({
            **{n: s(d) for n in ("input_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm",
                                 "post_ffn_norm_1", "post_ffn_norm_2", "pre_ffn_norm_2")},
            "attn": attn, "mlp": {"gate": s(d, i), "up": s(d, i), "down": s(i, d)},
            "router": {"proj": s(d, e), "scale": s(d), "expert_scale": s(e)},
            "experts": {"gate": s(e, d, f), "up": s(e, d, f), "down": s(e, f, d)},
            "scalar": s(2)})
    return {"embed": s(cfg.vocab_size, d), "norm": s(d),
            "self_conditioning": {"pre_norm": s(d), "gate": s(d, i), "up": s(d, i),
                                  "down": s(i, d)},
            "layers": layers}


# Each parameter's logical axes (parallel/mesh.py RULES: experts on `expert`, heads, the MLP's
# hidden units and the vocabulary on `tensor`), by its name in param_shapes' tree.
LOGICAL_AXES = {
    "embed": ("vocab", "embed"), "q": ("embed", "heads"), "k": ("embed", "kv_heads"),
    "v": ("embed", "kv_heads"), "o": ("heads", "embed"), "proj": ("embed", None),
    "expert_scale": ("expert",), "gate": ("embed", "mlp"), "up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
}
EXPERT_AXES = {"gate": ("expert", "embed", "mlp"), "up": ("expert", "embed", "mlp"),
               "down": ("expert", "mlp", "embed")}
CACHE_AXES = ("pages", "page", "kv_heads", "head_dim")  # a layer's k, v pages


def logical_axes(params: dict) -> dict:
    """A parameter tree's (arrays or shapes) logical axis names per leaf (None: replicated); a
    quantization scale takes its weight's, None on the contracted axis."""
    def axes(path, leaf):
        names = [str(getattr(k, "key", k)) for k in path]
        table = EXPERT_AXES if "experts" in names else LOGICAL_AXES
        name = names[-1]
        if name not in table and name.endswith(quantize.SCALE_SUFFIX):
            weight = table[name.removesuffix(quantize.SCALE_SUFFIX)]
            return tuple(a if n > 1 else None for a, n in zip(weight, leaf.shape))
        return table.get(name, (None,) * len(leaf.shape))

    return jax.tree_util.tree_map_with_path(axes, params)


UNIT_LEAVES = ("norm", "scale", "scalar")  # leaf names ending so start at one in a random init


def init_params(cfg: DiffusionGemmaConfig, seed: int) -> dict:
    """Random weights of cfg's shapes for presets: normal with std 0.02, norms and scales one."""
    key = jax.random.PRNGKey(seed)

    def draw(path, shape):
        name = str(getattr(path[-1], "key", path[-1]))
        if name.endswith(UNIT_LEAVES):
            return jnp.ones(shape.shape, shape.dtype)
        leaf_key = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()) & 0x7FFFFFFF)
        return 0.02 * jax.random.normal(leaf_key, shape.shape, shape.dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(cfg))


def load(model: str, with_weights: bool = True, quantization: Quantization | None = None
         ) -> CanvasModel:
    """A model of this family by preset name, YAML or directory (its manifest checked);
    `with_weights=False`: its config, defaults and tokenizer only (params None);
    `quantization` int8 / fp8: its weight matrices quantized as they load (QUANTIZED)."""
    import orbax.checkpoint as ocp

    from mbd_jax.checkpoint import verify_manifest

    path = resolve_model_path(model)
    data = dict(load_yaml(path))
    if data.get("family") != FAMILY:
        raise ConfigError(f"model {model}: not a {FAMILY} model")
    extra = {k: data.pop(k, None) for k in FILE_KEYS}
    cfg = from_dict(DiffusionGemmaConfig, data, where=f"model {model}")
    cfg.validate(f"model {model}")
    if not with_weights:
        params = None
    elif extra["init"] == "random":
        params = init_params(cfg, extra["seed"] or 0)
    elif extra["init"] != "checkpoint":
        raise ConfigError(f"model {model}: a shape only (init: {extra['init']}); convert a "
                          "checkpoint first")
    else:
        if (path.parent / "manifest.json").is_file():
            verify_manifest(path.parent)
        target = param_shapes(cfg)
        params = ocp.StandardCheckpointer().restore((path.parent / "params").absolute(), target)
    decoding = CanvasDecoding()
    if (path.parent / GENERATION_FILE).is_file():
        section = (load_yaml(path.parent / GENERATION_FILE) or {}).get("canvas") or {}
        decoding = from_dict(CanvasDecoding, section, where=f"{path.parent / GENERATION_FILE}")
        decoding.validate(f"{path.parent / GENERATION_FILE}: canvas")
    tokenizer = load_tokenizer(path.parent / extra["tokenizer"]) if extra["tokenizer"] else None
    if params is not None and quantization not in (None, "none"):
        params = quantized(params, cfg, quantization)
    return CanvasModel(cfg, params, tokenizer, decoding, path)


def verify(model_dir: pathlib.Path) -> list[tuple[str, str | None]]:
    """`mbd-jax verify` for this family (checkpoint.verify_model_dir's checks): config.yaml,
    checksums, params/ against the config's shapes (orbax metadata, no weights read), the
    tokenizer, generation.yaml. Returns (check, problem or None) per check."""
    from mbd_jax.checkpoint import manifest_problems, params_problem

    d = pathlib.Path(model_dir).absolute()
    try:
        model = load(str(d), with_weights=False)
    except ConfigError as e:
        return [("config.yaml", str(e))]
    results: list[tuple[str, str | None]] = [("config.yaml", None)]
    if (d / "manifest.json").is_file():
        results += [("checksums", p) for p in manifest_problems(d)] or [("checksums", None)]
    else:
        results.append(("checksums", "no manifest.json: the files cannot be checked"))
    results.append(("parameters", params_problem(d / "params", param_shapes(model.cfg))))
    if model.tokenizer is not None:
        results.append(("tokenizer", None if model.tokenizer.vocab_size <= model.cfg.vocab_size
                        else f"tokenizer has {model.tokenizer.vocab_size} tokens, vocab_size is "
                             f"{model.cfg.vocab_size}"))
    return results
