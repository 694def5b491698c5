"""Configs as validated dataclasses, loaded from YAML.

Every config is a frozen dataclass. `from_dict` rejects unknown fields and ill-typed values with a
`ConfigError` that names the field and what is allowed; `validate` checks cross-field constraints.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import yaml

from mbd_jax import user_regex
from mbd_jax.errors import ConfigError

INT32_MAX = 2**31 - 1


# configs/ and models/ live in the checkout (editable install, tests, `make`); an installed wheel
# carries them as mbd_jax/configs and mbd_jax/models.
_PACKAGE = pathlib.Path(__file__).resolve().parent
IN_CHECKOUT = (_PACKAGE.parent / "pyproject.toml").is_file() and (_PACKAGE.parent / "configs").is_dir()
DATA_ROOT = _PACKAGE.parent if IN_CHECKOUT else _PACKAGE
# Relative paths in configs (training outputs, checkpoints) resolve against the checkout, or the
# working directory for an installed package (never into site-packages).
REPO_ROOT = _PACKAGE.parent if IN_CHECKOUT else pathlib.Path.cwd()
MODEL_PRESET_DIR = DATA_ROOT / "configs" / "models"  # architectures (random init or shape only)
SHIPPED_MODEL_DIR = DATA_ROOT / "models"  # trained models shipped with mbd-jax (tiny-bd, tiny-mbd)

RouterType = Literal["softmax_topk", "sigmoid_grouped"]
# auto: chosen per backend (AUTO below); measure: an engine's warm-up times the backend's candidates
# (MEASURED below) on each of its decode programs and keeps the faster (engine/core.py)
MoeImpl = Literal["auto", "measure", "dense", "ragged", "tiled", "looped"]
AttentionImpl = Literal["chunked", "dense"]
# How the layers run: one lax.scan per run of identical layers (compile time and program size
# flat in depth) or unrolled; auto: per backend (AUTO below).
LayerLoop = Literal["auto", "scan", "unrolled"]

# What `auto` stands for, per JAX backend ("*": every other one): the one table of such defaults.
# moe_impl: on CPU the looped path reads only the hit experts' weights (dense computes all E,
# tiled gathers a weight matrix per tile, ragged_dot expands densely); accelerators have a
# grouped-matmul kernel behind ragged_dot. layer_loop: XLA:CPU copies a scanned layer's whole
# weight slice before use, which undoes the looped expert path's reading only the hit experts
# (0.2x PyTorch at batch 16 scanned against 1.1x unrolled, docs/lab/performance-history.md), so CPU stays
# unrolled; elsewhere the scan keeps compile time flat in depth.
AUTO: dict[str, dict[str, str]] = {
    "moe_impl": {"cpu": "looped", "*": "ragged"},
    "layer_loop": {"cpu": "unrolled", "*": "scan"},
}


# The expert paths `moe_impl: measure` times, per backend: at a few copies per expert computing
# every expert for every token can beat the loop over the hit ones on CPU (docs/lab/performance-history.md),
# and which one wins depends on the model, the batch and the host.
MEASURED: dict[str, dict[str, tuple[str, ...]]] = {
    "moe_impl": {"cpu": ("looped", "dense"), "*": ("ragged", "dense")},
}


def _backend(backend: str | None) -> str:
    if backend is None:
        import jax

        backend = jax.default_backend()
    return backend


def resolve_auto(field: str, value: str, backend: str | None = None) -> str:
    """What `value` of setting `field` stands for on `backend` (default: JAX's default one).
    `measure` is `auto` wherever no engine warm-up has measured (training, a lone forward, an
    engine before its warm-up)."""
    if value not in ("auto", "measure"):
        return value
    table = AUTO[field]
    backend = _backend(backend)
    return table.get(backend, table["*"])


def measured_candidates(field: str, backend: str | None = None) -> tuple[str, ...]:
    """The values `measure` times for setting `field` on `backend` (MEASURED)."""
    table = MEASURED[field]
    return table.get(_backend(backend), table["*"])


DType = Literal["float32", "bfloat16", "float16"]
# What mixes tokens in a layer: softmax attention over the KV cache, or a gated delta rule over a
# recurrent state (SequenceModule below).
LayerType = Literal["full_attention", "linear_attention"]
# How a linear-attention layer reads inside a block (model/delta_rule.py, docs/architecture.md).
BlockMode = Literal["causal", "bidirectional"]
RopeType = Literal["linear", "yarn", "llama3"]  # static rope scalings (model/rope.py)
UnmaskPolicy = Literal["threshold", "fixed_steps", "factor"]  # decoding/policy.py
SamplingMode = Literal["naive", "edit"]
BlockActivation = Literal["progress", "eager"]  # when MultiBD's next block joins (decoding/block_buffer.py)
# edit mode: which blocks wait for a forward that changes nothing in them (decoding/block_buffer.py)
EditConfirm = Literal["always", "context"]
VoteWeighting = Literal["fixed", "linear", "exp"]  # decoding/voting.py
VoteExtractor = Literal["last_number", "boxed", "regex"]


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (tuple, list):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, args[0]) for v in value)
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return isinstance(value, dict) and all(_type_ok(k, kt) and _type_ok(v, vt)
                                               for k, v in value.items())
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return isinstance(value, tp)
    if tp is type(None):
        return value is None
    if tp is float:  # finite: NaN and infinities reach no device
        return isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is bool:
        return isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _show(value: Any, limit: int = 48) -> str:
    """repr(value), cut short (a hostile value can be megabytes long)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "a huge integer"
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp))
    if tp is type(None):
        return "null"
    if tp is float:
        return "a finite number"
    return getattr(tp, "__name__", str(tp))


def _nested_dataclass(tp: Any):
    """The dataclass type inside `tp` (`X` or `X | None`), else None."""
    for t in typing.get_args(tp) or (tp,):
        if dataclasses.is_dataclass(t):
            return t
    return None


def from_dict(cls, data: Any, where: str):
    """Builds dataclass `cls` from a mapping, naming any unknown, missing or ill-typed field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(_show(k, 64).strip("'") if isinstance(k, str) else _show(k)
                     for k in set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(unknown[:8])}; allowed fields: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing required field '{name}' ({_describe(hints[name])})")
            continue
        value = data[name]
        nested = _nested_dataclass(hints[name])
        if nested is not None and isinstance(value, dict):
            kwargs[name] = from_dict(nested, value, f"{where}.{name}")
            continue
        if not _type_ok(value, hints[name]):
            raise ConfigError(
                f"{where}: field '{name}' must be {_describe(hints[name])}, got {_show(value)}"
            )
        if typing.get_origin(hints[name]) in (tuple, list) and value is not None:
            value = tuple(value)
        kwargs[name] = value
    obj = cls(**kwargs)
    obj.validate(where)
    return obj


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def _check_range(obj: Any, where: str, field: str, lo: float, hi: float) -> None:
    """Field `field` of `obj` lies in [lo, hi] (bounds chosen so the device types hold it)."""
    v = getattr(obj, field)
    _check(lo <= v <= hi, where, f"field '{field}' must be in [{lo}, {hi}], got {_show(v)}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding scaling for contexts past the pretraining length: a checkpoint's
    `rope_scaling` / `rope_parameters` (model/rope.py computes the frequencies from it)."""

    type: RopeType
    factor: float  # the context extension (frequencies interpolated by 1/factor)
    original_max_len: int = 0  # the pretraining context (yarn, llama3)
    beta_fast: float = 32.0  # yarn: rotations at which interpolation stops ...
    beta_slow: float = 1.0  # ... and at which it is complete
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float | None = None  # yarn: cos/sin scale (None: 0.1 ln(factor) + 1)
    low_freq_factor: float = 1.0  # llama3: wavelengths past original_max_len / this are scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_len / this are kept

    def validate(self, where: str = "rope_scaling") -> None:
        _check(self.factor > 0, where, f"field 'factor' must be > 0, got {self.factor}")
        if self.type in ("yarn", "llama3"):
            _check(self.original_max_len > 0, where,
                   f"rope type {self.type} needs field 'original_max_len' > 0 (the pretraining "
                   "context, original_max_position_embeddings)")
        if self.type == "yarn":
            _check(self.beta_fast > self.beta_slow > 0, where,
                   f"fields 'beta_fast' > 'beta_slow' > 0, got {self.beta_fast}, {self.beta_slow}")
            _check(self.attention_factor is None or self.attention_factor > 0, where,
                   f"field 'attention_factor' must be > 0 or null, got {self.attention_factor}")
        if self.type == "llama3":
            _check(self.high_freq_factor > self.low_freq_factor > 0, where,
                   "fields 'high_freq_factor' > 'low_freq_factor' > 0, got "
                   f"{self.high_freq_factor}, {self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class SequenceModule:
    """The linear-attention layers of a hybrid model (Gated DeltaNet between gated attention
    layers, the Qwen3-Next / Qwen3.5 layout): which layers they are, their shape, and how they
    read inside a block. Every field is stated: a model directory that leaves one out is refused
    at load, by name (a wrong sequence module decodes garbage, it does not fail)."""

    type: Literal["gated_deltanet"]
    block_mode: BlockMode
    layer_types: tuple[LayerType, ...]  # one per layer
    num_key_heads: int  # query/key heads (each serves num_value_heads / num_key_heads value heads)
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # the short causal depthwise convolution's width
    chunk_size: int  # tokens per chunk of the chunked delta rule (a multiple of block_size)

    def validate(self, where: str = "sequence_module") -> None:
        for f in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                  "conv_kernel", "chunk_size"):
            _check(getattr(self, f) > 0, where, f"field '{f}' must be > 0, got {getattr(self, f)}")
        _check(self.num_value_heads % self.num_key_heads == 0, where,
               f"field 'num_value_heads' ({self.num_value_heads}) must be a multiple of "
               f"'num_key_heads' ({self.num_key_heads})")
        _check("linear_attention" in self.layer_types, where,
               "field 'layer_types' lists no 'linear_attention' layer (an attention-only model has "
               "no sequence_module)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of one block-diffusion transformer (LLaDA2 / SDAR / Qwen3-MoE families)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Dense SwiGLU MLP (used by the first `first_k_dense` layers, or all layers if num_experts == 0).
    intermediate_size: int
    first_k_dense: int = 0
    # Mixture of experts (layers >= first_k_dense when num_experts > 0).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    router: RouterType = "softmax_topk"
    norm_topk_prob: bool = True
    n_group: int = 1  # sigmoid_grouped: experts are split into n_group groups ...
    topk_group: int = 1  # ... and only the best topk_group groups may be chosen
    routed_scaling_factor: float = 1.0
    moe_impl: MoeImpl = "auto"
    # Attention.
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # long-context scaling (None: plain rope)
    rotary_fraction: float = 1.0  # share of head_dim that is rotated (LLaDA2: 0.5)
    qk_norm: bool = True
    rms_norm_eps: float = 1e-6
    attention_impl: AttentionImpl = "chunked"
    attention_chunk: int = 256  # keys per online-softmax chunk in the chunked path
    layer_loop: LayerLoop = "auto"
    tie_word_embeddings: bool = False
    # Gated attention (Qwen3-Next): a sigmoid gate on each head's output, from its own projection.
    attention_output_gate: bool = False
    # RMSNorm weights stored as an offset from one, y * (1 + w) (Qwen3-Next's norms; init 0).
    norm_weight_offset: bool = False
    # A sigmoid gate (one weight vector) on the shared experts' output (Qwen3-Next).
    shared_expert_gate: bool = False
    # Linear-attention layers beside the attention ones (None: every layer is attention).
    sequence_module: SequenceModule | None = None
    # Block diffusion.
    max_seq_len: int = 4096
    block_size: int = 32
    mask_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    # Numerics.
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    # Weights: a random init from `seed` (tiny presets, benches) or a checkpoint directory.
    init: Literal["random", "checkpoint", "none"] = "none"
    seed: int = 0
    init_std: float = 0.02
    tokenizer: str | None = None  # path, relative to the YAML file's folder, or null
    chat_template: Literal["plain", "qwen", "llada2"] = "plain"  # see mbd_jax/chat.py

    def validate(self, where: str = "model") -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "max_seq_len", "block_size", "attention_chunk"):
            _check(getattr(self, f) > 0, where, f"field '{f}' must be > 0, got {getattr(self, f)}")
        _check(self.num_heads % self.num_kv_heads == 0, where,
               f"field 'num_heads' ({self.num_heads}) must be a multiple of 'num_kv_heads' "
               f"({self.num_kv_heads})")
        _check(0 <= self.first_k_dense <= self.num_layers, where,
               f"field 'first_k_dense' must be in [0, num_layers={self.num_layers}]")
        _check(0.0 < self.rotary_fraction <= 1.0, where, "field 'rotary_fraction' must be in (0, 1]")
        rot = self.rotary_dim
        _check(rot % 2 == 0, where, f"rotary_fraction * head_dim = {rot} must be even")
        if self.rope_scaling is not None:
            self.rope_scaling.validate(f"{where}.rope_scaling")
        _check(self.max_seq_len % self.block_size == 0, where,
               f"field 'max_seq_len' ({self.max_seq_len}) must be a multiple of 'block_size' "
               f"({self.block_size})")
        for f in ("mask_token_id", "pad_token_id"):
            v = getattr(self, f)
            _check(0 <= v < self.vocab_size, where, f"field '{f}' must be in [0, vocab_size), got {v}")
        _check(len(self.eos_token_ids) > 0, where, "field 'eos_token_ids' must list at least one id")
        for e in self.eos_token_ids:
            _check(0 <= e < self.vocab_size and e != self.mask_token_id, where,
                   f"field 'eos_token_ids' has {e}: ids must be in [0, vocab_size) and differ "
                   "from mask_token_id")
        if self.sequence_module is not None:
            sm = self.sequence_module
            _check(len(sm.layer_types) == self.num_layers, where,
                   f"field 'sequence_module.layer_types' lists {len(sm.layer_types)} layers, the "
                   f"model has num_layers={self.num_layers}")
            _check(sm.chunk_size % self.block_size == 0, where,
                   f"field 'sequence_module.chunk_size' ({sm.chunk_size}) must be a multiple of "
                   f"'block_size' ({self.block_size})")
        if self.num_experts > 0:
            _check(self.first_k_dense < self.num_layers, where,
                   "num_experts > 0 but first_k_dense == num_layers leaves no MoE layer")
            _check(0 < self.num_experts_per_tok <= self.num_experts, where,
                   f"field 'num_experts_per_tok' must be in [1, num_experts={self.num_experts}]")
            _check(self.moe_intermediate_size > 0, where, "field 'moe_intermediate_size' must be > 0")
            _check(self.num_experts % self.n_group == 0, where,
                   f"field 'n_group' ({self.n_group}) must divide num_experts ({self.num_experts})")
            _check(1 <= self.topk_group <= self.n_group, where,
                   f"field 'topk_group' must be in [1, n_group={self.n_group}]")
            if self.router == "sigmoid_grouped":
                per_group = self.num_experts // self.n_group
                _check(per_group >= 2 or self.n_group == 1, where,
                       "sigmoid_grouped needs >= 2 experts per group (group score = top-2 sum)")
                _check(self.num_experts_per_tok <= self.topk_group * per_group, where,
                       "num_experts_per_tok exceeds the experts in the kept groups "
                       f"(topk_group * num_experts / n_group = {self.topk_group * per_group})")

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.rotary_fraction))

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense

    def layer_type(self, layer: int) -> str:
        """What mixes tokens in `layer` (LayerType)."""
        return "full_attention" if self.sequence_module is None else self.sequence_module.layer_types[layer]

    def count_layers(self, layer_type: LayerType) -> int:
        """How many layers mix tokens with `layer_type`."""
        return sum(self.layer_type(i) == layer_type for i in range(self.num_layers))

    def layer_kind(self, layer: int) -> tuple[str, bool]:
        """What makes two layers identical (one scanned run): the token mixer and the MLP kind."""
        return self.layer_type(layer), self.is_moe_layer(layer)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """ModelConfig fields that change how the model runs, not its weights: they may be overridden
    at load time (--moe-impl and friends, the serve config's `runtime:` section) without touching
    a model directory's checksummed files. None keeps the model's own value."""

    moe_impl: MoeImpl | None = None
    attention_impl: AttentionImpl | None = None
    attention_chunk: int | None = None
    layer_loop: LayerLoop | None = None
    compute_dtype: DType | None = None
    max_seq_len: int | None = None  # serve a shorter context than the model's (a smaller KV buffer)

    def validate(self, where: str = "runtime") -> None:
        _check(self.attention_chunk is None or self.attention_chunk > 0, where,
               "field 'attention_chunk' must be > 0 or null")
        _check(self.max_seq_len is None or self.max_seq_len > 0, where,
               "field 'max_seq_len' must be > 0 or null")


RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(RuntimeConfig))


def config_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as plain YAML/JSON data (nested configs as mappings, tuples as lists):
    what from_dict reads back."""
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x
    return plain(dataclasses.asdict(cfg))


def with_runtime(cfg: ModelConfig, overrides: dict[str, Any] | None, where: str) -> ModelConfig:
    """`cfg` with runtime settings replaced (None values ignored); anything else is refused."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    bad = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if bad:
        raise ConfigError(f"{where}: {', '.join(bad)} cannot be overridden at load time; runtime "
                          f"settings: {', '.join(RUNTIME_FIELDS)}")
    if not overrides:
        return cfg
    if overrides.get("max_seq_len", 0) > cfg.max_seq_len:
        raise ConfigError(f"{where}: max_seq_len {overrides['max_seq_len']} exceeds the model's "
                          f"{cfg.max_seq_len}")
    return from_dict(ModelConfig, {**config_dict(cfg), **overrides}, where=where)


def load_yaml(path: pathlib.Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML: {e}") from None


def _merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`; a mapping in both is merged key by key (sequence_module, ...)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_model_yaml(path: pathlib.Path, _seen: tuple[pathlib.Path, ...] = ()) -> Any:
    """A model config file's mapping, with its `base:` (a YAML file beside it, itself possibly
    based on another) underneath: a preset states only what differs from the one it names."""
    data = load_yaml(path)
    if not isinstance(data, dict) or "base" not in data:
        return data
    name = data.pop("base")
    base = path.parent / str(name)
    if not isinstance(name, str) or not name.endswith(".yaml") or not base.is_file():
        raise ConfigError(f"{path}: field 'base' must name a YAML file beside it, got {name!r}")
    if base.resolve() in _seen:
        raise ConfigError(f"{path}: field 'base' loops back to {base.name}")
    parent = load_model_yaml(base, (*_seen, path.resolve(), base.resolve()))
    if not isinstance(parent, dict):
        raise ConfigError(f"{base}: must be a mapping of config fields (the base of {path.name})")
    return _merged(parent, data)


def load_model_config(path: str | pathlib.Path) -> ModelConfig:
    path = pathlib.Path(path)
    return from_dict(ModelConfig, load_model_yaml(path), where=str(path))


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


@dataclasses.dataclass(frozen=True)
class VotingConfig:
    """Temporal self-consistency voting (arXiv 2508.09138): parse an answer from the full prediction
    at every decode step and return the weighted majority beside the final text."""

    weighting: VoteWeighting = "exp"  # f(t): 1, (t+1)/T, exp(alpha*t/T)
    alpha: float = 5.0
    extractor: VoteExtractor = "last_number"
    pattern: str | None = None  # regex extractor: the answer is group 1 (or the whole match)

    def validate(self, where: str = "voting") -> None:
        # exp(alpha * t / T) stays far inside float64 for alpha <= 100
        _check_range(self, where, "alpha", 0.0, 100.0)
        if self.extractor == "regex":
            _check(bool(self.pattern), where, "extractor 'regex' needs field 'pattern'")
            try:
                user_regex.compile_pattern(self.pattern)
            except ValueError as e:
                raise ConfigError(f"{where}: field 'pattern': {e}") from None


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How one request is decoded. SingleBD is buffer_size 1; MultiBD is the same loop with more."""

    buffer_size: int = 1  # N_buf: blocks decoded at once
    accept_threshold: float = 0.95  # tau_accept: accept masked positions more confident than this
    add_block_threshold: float = 0.1  # tau_add: activate the next block once the last is this full
    # "progress": the next block joins when the last is tau_add full (and tau_stable stable), one
    # per forward (the paper's rule); "eager": every free slot whose block starts before the limit
    # is active at once, from the first forward on (the thresholds above unused)
    block_activation: BlockActivation = "progress"
    semi_complete_threshold: float = 0.9  # tau_semi: a block's top-1 fallback needs this much of its predecessor
    token_stability_threshold: float = 0.0  # tau_stable: share of the last block the model keeps
    policy: UnmaskPolicy = "threshold"
    steps_per_block: int = 8  # fixed_steps: block_size / steps_per_block tokens per step
    factor: float = 1.0  # factor (Fast-dLLM): accept the n most confident with (m+1)(1-c_m) <= factor
    sampling_mode: SamplingMode = "naive"
    edit_threshold: float = 0.5  # edit: rewrite a filled token when another is this confident
    max_post_edit_steps: int = 16  # edit: a block is final after block_size + this many steps
    # edit: "always": every block waits for a forward that changes nothing in it; "context": only
    # a block last written while an earlier block still had a MASK, or edited, waits for one
    edit_confirm: EditConfirm = "always"
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # sample among the k most likely tokens; 0 = no limit
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    ignore_eos: bool = False  # decode all max_new_tokens past EOS (benchmarks: fixed work per row)
    max_nfe: int = 1024  # decode forwards per request
    voting: VotingConfig | None = None

    def validate(self, where: str = "decoding") -> None:
        # Integer fields become int32 device values; their bounds leave room for the sums the
        # loop computes (block_size + max_post_edit_steps, prompt_len + max_new_tokens).
        _check_range(self, where, "buffer_size", 1, 1024)
        _check_range(self, where, "steps_per_block", 1, 1 << 16)
        _check_range(self, where, "max_post_edit_steps", 0, 1 << 16)
        _check_range(self, where, "max_new_tokens", 1, 1 << 30)
        _check_range(self, where, "max_nfe", 1, 1 << 30)
        _check_range(self, where, "add_block_threshold", 0.0, 1e6)
        _check_range(self, where, "factor", 1e-6, 1e6)
        _check_range(self, where, "temperature", 0.0, 100.0)
        _check_range(self, where, "top_k", 0, 1 << 30)
        for f in ("accept_threshold", "semi_complete_threshold", "token_stability_threshold"):
            v = getattr(self, f)
            _check(0.0 <= v <= 1.0, where, f"field '{f}' must be in [0, 1], got {v}")
        _check(0.0 <= self.edit_threshold <= 1.0, where,
               f"field 'edit_threshold' must be in [0, 1], got {self.edit_threshold}")
        _check(0.0 < self.top_p <= 1.0, where, f"field 'top_p' must be in (0, 1], got {self.top_p}")
        _check(0 <= self.seed < 2**31, where, f"field 'seed' must be in [0, 2^31), got {self.seed}")

    def tokens_per_step(self, block_size: int) -> int:
        return max(1, -(-block_size // self.steps_per_block))


def decode_config(**overrides: Any) -> DecodeConfig:
    """A DecodeConfig from keyword overrides (None values keep the default), validated."""
    return from_dict(DecodeConfig, {k: v for k, v in overrides.items() if v is not None},
                     where="decoding")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Serving defaults and limits for generation (the seeds' `generation` section)."""

    block_size: int | None = None  # if set, must equal the model's block size
    thinking_mode: bool = False  # default for requests that do not say `thinking`
    max_new_tokens: int = 128  # default when a request does not say
    max_new_tokens_limit: int = 1024  # the most a request may ask for
    max_nfe_limit: int = 2048  # the most decode forwards a request may ask for (decoding.max_nfe)
    diffusion_steps: int | None = None  # if set: fixed_steps policy with this many steps per block
    thinking_max_new_tokens: int = 512  # thinking requests: their own token budget ...
    thinking_timeout_ms: int = 120000  # ... and time budget
    thinking_max_rows: int = 2  # ... and at most this many rows at once

    def validate(self, where: str = "generation") -> None:
        for f in ("max_new_tokens", "max_new_tokens_limit", "max_nfe_limit",
                  "thinking_max_new_tokens", "thinking_timeout_ms", "thinking_max_rows"):
            _check(getattr(self, f) >= 1, where, f"field '{f}' must be >= 1, got {getattr(self, f)}")
        _check(self.max_new_tokens <= self.max_new_tokens_limit, where,
               "field 'max_new_tokens' must be <= 'max_new_tokens_limit'")
        _check(self.diffusion_steps is None or self.diffusion_steps >= 1, where,
               "field 'diffusion_steps' must be >= 1 or null")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int = 9100  # metrics and profiling; 0: no admin port (/metrics on `port`)
    served_model_name: str | None = None  # the model id clients send (default: the model's name)
    max_batch_size: int = 8  # rows decoded together
    buffer_size: int = 2  # compiled N_buf: the largest MultiBD buffer a request may use
    prefill_chunk: int = 256
    # Positions the paged KV pool holds over all rows (whole pages of attention_chunk); null: every
    # row can hold a full context at once. Smaller pools hold what requests need: a request waits
    # in the queue until its pages are free, and one that needs more than the pool gets 400.
    kv_pool_tokens: int | None = None
    steps_per_call: int = 16  # decode steps between host visits (streaming granularity)
    queue_size: int = 256  # waiting requests; beyond -> 429
    queue_timeout_ms: int = 30000  # waiting longer than this -> 504
    generation_timeout_ms: int = 120000  # running longer than this -> 504
    max_body_bytes: int = 1 << 20  # larger bodies -> 413
    max_segments: int = 64  # /generate segments per request
    rate_limit_per_s: float = 0.0  # per API key token bucket; 0 = unlimited
    rate_limit_burst: int = 20
    drain_timeout_s: float = 30.0  # SIGTERM: finish in-flight requests within this ...
    drain_min_s: float = 2.0  # ... while answering 503 (/ready included) for at least this long
    auth_failures_per_min: int = 30  # wrong API keys per client address before 429
    # Connections (per port): beyond max_connections a new connection gets 503 and is closed; a
    # connection must send its request headers within header_timeout_s and its body within
    # body_timeout_s; an idle keep-alive connection is closed after keep_alive_s.
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    max_engine_failures: int = 3  # engine failures in a row (no call succeeding) before it exits
    # HTTPS on the data port (both files, PEM); the admin port stays plain HTTP on admin_host.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Compiled programs kept on disk across restarts (mbd_jax/compile_cache.py): a directory, off
    # for none; null: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/mbd-jax/xla.
    compile_cache: str | None = None

    def validate(self, where: str = "server") -> None:
        _check(1 <= self.port <= 65535, where, f"field 'port' must be in [1, 65535], got {self.port}")
        _check(0 <= self.admin_port <= 65535, where,
               f"field 'admin_port' must be in [0, 65535] (0: none), got {self.admin_port}")
        _check(self.served_model_name is None or 0 < len(self.served_model_name) <= 256, where,
               "field 'served_model_name' must be 1 to 256 characters")
        _check((self.ssl_certfile is None) == (self.ssl_keyfile is None), where,
               "fields 'ssl_certfile' and 'ssl_keyfile' go together (HTTPS needs both)")
        for f in ("max_batch_size", "buffer_size", "prefill_chunk",
                  "steps_per_call", "queue_size", "queue_timeout_ms", "generation_timeout_ms",
                  "max_body_bytes", "max_segments", "rate_limit_burst", "auth_failures_per_min",
                  "max_connections", "keep_alive_s", "max_engine_failures"):
            _check(getattr(self, f) >= 1, where, f"field '{f}' must be >= 1, got {getattr(self, f)}")
        _check(self.kv_pool_tokens is None or self.kv_pool_tokens >= 1, where,
               f"field 'kv_pool_tokens' must be >= 1 or null, got {self.kv_pool_tokens}")
        for f in ("rate_limit_per_s", "drain_timeout_s", "drain_min_s"):
            _check(getattr(self, f) >= 0, where, f"field '{f}' must be >= 0, got {getattr(self, f)}")
        for f in ("header_timeout_s", "body_timeout_s"):
            _check(getattr(self, f) > 0, where, f"field '{f}' must be > 0, got {getattr(self, f)}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Prefix KV cache: committed blocks are persisted (double-buffered device-to-host copies) to
    a RAM tier and, with storage_path, a disk tier; prompts reuse their stored leading blocks."""

    enabled: bool = False
    storage_path: str | None = None  # disk tier directory (relative: to the working directory)
    ram_capacity_mb: int = 1024
    disk_capacity_mb: int = 10240
    ttl_s: int = 86400

    def validate(self, where: str = "cache") -> None:
        _check(self.ram_capacity_mb >= 0 and self.disk_capacity_mb >= 0 and self.ttl_s >= 0, where,
               "fields 'ram_capacity_mb', 'disk_capacity_mb', 'ttl_s' must be >= 0")


@dataclasses.dataclass(frozen=True)
class MonitoringConfig:
    enabled: bool = True  # /metrics on the admin port
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # The service's log (never request or reply text): stderr, or this file rotated at
    # log_max_bytes keeping log_backups old files (file.1, file.2, ...).
    log_file: str | None = None
    log_max_bytes: int = 100 << 20
    log_backups: int = 5

    def validate(self, where: str = "monitoring") -> None:
        _check(self.log_max_bytes >= 1024, where,
               f"field 'log_max_bytes' must be >= 1024, got {self.log_max_bytes}")
        _check(self.log_backups >= 0, where,
               f"field 'log_backups' must be >= 0, got {self.log_backups}")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """configs/serve.yaml: the service's settings (unknown or ill-typed fields are rejected)."""

    model: str = "tiny-mbd"
    runtime: RuntimeConfig = RuntimeConfig()  # overrides of the model's runtime settings
    generation: GenerationConfig = GenerationConfig()
    decoding: DecodeConfig = DecodeConfig(buffer_size=2)  # request defaults
    server: ServerConfig = ServerConfig()
    cache: CacheConfig = CacheConfig()
    monitoring: MonitoringConfig = MonitoringConfig()

    def validate(self, where: str = "serve") -> None:
        _check(self.decoding.buffer_size <= self.server.buffer_size, where,
               "decoding.buffer_size must be <= server.buffer_size (the compiled N_buf)")
        _check(self.decoding.max_nfe <= self.generation.max_nfe_limit, where,
               "decoding.max_nfe must be <= generation.max_nfe_limit")


# A model directory's generation settings, beside its weights: sections of ServeConfig, any subset
# of their fields. Settings, not weights: outside manifest.json's checksums, so they can be tuned
# in place (checkpoint.write_manifest skips the file).
GENERATION_FILE = "generation.yaml"
GENERATION_SECTIONS = ("generation", "decoding")


def model_generation_settings(model: Any) -> dict[str, dict[str, Any]]:
    """The validated sections of `model`'s generation.yaml, {} when it has none (a preset, a YAML
    file, a directory without the file, or a name that does not resolve: loading the model names
    that problem)."""
    try:
        config_path = resolve_model_path(model) if isinstance(model, str) else None
    except ConfigError:
        return {}
    if config_path is None or config_path.name != "config.yaml":
        return {}
    path = config_path.parent / GENERATION_FILE
    if not path.is_file():
        return {}
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with sections {', '.join(GENERATION_SECTIONS)}")
    unknown = sorted(set(data) - set(GENERATION_SECTIONS))
    if unknown:
        raise ConfigError(f"{path}: unknown section '{unknown[0]}'; allowed: "
                          f"{', '.join(GENERATION_SECTIONS)}")
    hints = typing.get_type_hints(ServeConfig)
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping of fields")
        from_dict(hints[section], values, where=f"{path}: {section}")  # names a bad field
    return data


def serve_env_names() -> dict[str, str]:
    """Environment variable -> serve config field: MBD_MODEL, MBD_SERVER_PORT,
    MBD_GENERATION_MAX_NEW_TOKENS_LIMIT, ... (one per field of every section)."""
    names = {}
    for section, cls in typing.get_type_hints(ServeConfig).items():
        if not dataclasses.is_dataclass(cls):
            names[f"MBD_{section}".upper()] = section
            continue
        for f in dataclasses.fields(cls):
            if f.name != "voting":  # a nested section: the YAML file's job
                names[f"MBD_{section}_{f.name}".upper()] = f"{section}.{f.name}"
    return names


def _scalar(text: str) -> Any:
    """An environment value as YAML reads it ("8" -> 8, "true" -> True), else the string."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (str, int, float, bool)) or value is None else text


def load_serve_config(path: str | pathlib.Path | None, env: Mapping[str, str] | None = None,
                      **overrides: Any) -> ServeConfig:
    """The YAML at `path`, then MBD_* variables from `env` (values parsed as YAML scalars), then
    `overrides` (the command line; None values skipped); the model directory's generation.yaml
    fills the generation and decoding fields none of these set."""
    data = load_yaml(pathlib.Path(path)) if path else {}
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections")
    names = serve_env_names()
    from_env = {names[k]: _scalar(v) for k, v in (env or {}).items() if k in names}
    given = {k: v for k, v in overrides.items() if v is not None}
    for key, value in {**from_env, **given}.items():  # "server.port": 8001, or "model": ...
        section, _, field = key.partition(".")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    # The model directory's generation.yaml fills the fields this config leaves out (a section
    # left out entirely starts from ServeConfig's default for it).
    for section, values in model_generation_settings(data.get("model", ServeConfig.model)).items():
        ours = data.get(section)
        if ours is None:
            data[section] = {**dataclasses.asdict(getattr(ServeConfig(), section)), **values}
        elif isinstance(ours, dict):
            data[section] = {**values, **ours}
    try:
        return from_dict(ServeConfig, data, where=str(path or "serve"))
    except ConfigError as e:
        used = sorted(k for k in (env or {}) if k in names)
        if used:
            raise ConfigError(f"{e} (environment settings in effect: {', '.join(used)})") from None
        raise
