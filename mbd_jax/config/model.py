"""The model's config: its architecture (`ModelConfig`, with RoPE scaling and a hybrid's sequence
module), the runtime settings that may change at load time (`RuntimeConfig`), and loading a
model YAML (a preset's `base:` underneath)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Literal

from mbd_jax.config.fields import _check, _merged, config_dict, from_dict, load_yaml
from mbd_jax.errors import ConfigError

RouterType = Literal["softmax_topk", "sigmoid_grouped"]
# auto: chosen per backend (AUTO below); measure: an engine's warm-up times the backend's candidates
# (MEASURED below) on each of its decode programs and keeps the faster (engine/core.py)
MoeImpl = Literal["auto", "measure", "dense", "ragged", "tiled", "looped"]
AttentionImpl = Literal["chunked", "dense", "pallas"]
# How the layers run: one lax.scan per run of identical layers (compile time and program size
# flat in depth) or unrolled; auto: per backend (AUTO below).
LayerLoop = Literal["auto", "scan", "unrolled"]

DType = Literal["float32", "bfloat16", "float16"]
# How the weight matrices are stored: in the param dtype, or in 8 bits with a scale per output
# channel (model/quantize.py: int8, fp8 = e4m3).
Quantization = Literal["none", "int8", "fp8"]
# What mixes tokens in a layer: softmax attention over the KV cache, or a gated delta rule over a
# recurrent state (SequenceModule below).
LayerType = Literal["full_attention", "linear_attention"]
# How a linear-attention layer reads inside a block (model/delta_rule.py, docs/architecture.md).
BlockMode = Literal["causal", "bidirectional"]
Platform = Literal["cpu", "gpu", "tpu"]  # what jax calls a device's platform
RopeType = Literal["linear", "yarn", "llama3"]  # static rope scalings (model/rope.py)


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
    # Block routing (LLaDA2.2): per window of this many consecutive positions of a sequence
    # (0: block_size), each expert scores its best token there; the top router_block_pool
    # experts are the window's pool, and every token takes its top-k inside it (0: off; on, it
    # takes the place of the n_group / topk_group rule).
    router_block_pool: int = 0
    router_block_window: int = 0
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
    # Levenshtein editing (LLaDA2.2): the ids a model predicts at a filled position to delete it
    # or to insert a MASK before it (decoding/indel.py). They are actions, never text. None: the
    # model has none (sampling_mode "indel" is refused).
    delete_token_id: int | None = None
    split_token_id: int | None = None
    # Numerics.
    param_dtype: DType = "float32"  # every parameter but the quantized weights
    compute_dtype: DType = "float32"
    quantization: Quantization = "none"
    # The attention layers' KV pool: in the compute dtype, or 8-bit with a float32 scale per
    # position and kv head (model/paged_kv.py). The hybrids' recurrent states stay float32.
    kv_quantization: Quantization = "none"
    # The platform the programs are built for ("cpu", "gpu", "tpu"): what `auto` settings stand for
    # (config/backend.py). None: the first device's. An engine sets it from its mesh's devices,
    # so a CPU host compiling for a GPU topology traces the GPU program.
    platform: Platform | None = None
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
        specials = {"mask_token_id": self.mask_token_id, **{
            f: getattr(self, f) for f in ("delete_token_id", "split_token_id")
            if getattr(self, f) is not None}}
        for f in ("delete_token_id", "split_token_id"):
            v = getattr(self, f)
            _check(v is None or (0 <= v < self.vocab_size and v not in self.eos_token_ids
                                 and list(specials.values()).count(v) == 1), where,
                   f"field '{f}' must be null or an id in [0, vocab_size) other than the mask, "
                   f"EOS and the other edit id, got {v}")
        _check((self.delete_token_id is None) == (self.split_token_id is None), where,
               "fields 'delete_token_id' and 'split_token_id' come together (both or neither)")
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
            _check(self.router_block_pool == 0
                   or self.num_experts_per_tok <= self.router_block_pool <= self.num_experts,
                   where, f"field 'router_block_pool' must be 0 (off) or in "
                          f"[num_experts_per_tok={self.num_experts_per_tok}, "
                          f"num_experts={self.num_experts}]")
            _check(self.router_block_window >= 0, where,
                   "field 'router_block_window' must be >= 0 (0: block_size)")
            if self.router == "sigmoid_grouped":
                per_group = self.num_experts // self.n_group
                _check(per_group >= 2 or self.n_group == 1, where,
                       "sigmoid_grouped needs >= 2 experts per group (group score = top-2 sum)")
                _check(self.num_experts_per_tok <= self.topk_group * per_group, where,
                       "num_experts_per_tok exceeds the experts in the kept groups "
                       f"(topk_group * num_experts / n_group = {self.topk_group * per_group})")

    @property
    def edit_op_ids(self) -> tuple[int, ...]:
        """(delete, split) ids, () for a model without Levenshtein editing."""
        return () if self.delete_token_id is None else (self.delete_token_id, self.split_token_id)

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
    # quantize a float model's weights as it loads (a model stored quantized keeps its scheme)
    quantization: Quantization | None = None
    kv_quantization: Quantization | None = None  # the KV pool (nothing stored changes)
    max_seq_len: int | None = None  # serve a shorter context than the model's (a smaller KV buffer)

    def validate(self, where: str = "runtime") -> None:
        _check(self.attention_chunk is None or self.attention_chunk > 0, where,
               "field 'attention_chunk' must be > 0 or null")
        _check(self.max_seq_len is None or self.max_seq_len > 0, where,
               "field 'max_seq_len' must be > 0 or null")


RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(RuntimeConfig))


def with_runtime(cfg: ModelConfig, overrides: dict[str, Any] | None, where: str) -> ModelConfig:
    """`cfg` with runtime settings replaced (None values ignored); anything else is refused."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    bad = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if bad:
        raise ConfigError(f"{where}: {', '.join(bad)} cannot be overridden at load time; runtime "
                          f"settings: {', '.join(RUNTIME_FIELDS)}")
    if not overrides:
        return cfg
    wanted = overrides.get("quantization", cfg.quantization)
    if cfg.quantization != "none" and wanted != cfg.quantization:
        raise ConfigError(f"{where}: quantization {overrides['quantization']}: the model's weights "
                          f"are stored quantized ({cfg.quantization}); only a float model is "
                          "quantized at load")
    if overrides.get("max_seq_len", 0) > cfg.max_seq_len:
        raise ConfigError(f"{where}: max_seq_len {overrides['max_seq_len']} exceeds the model's "
                          f"{cfg.max_seq_len}")
    return from_dict(ModelConfig, {**config_dict(cfg), **overrides}, where=where)


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


def refuse_other_family(path: pathlib.Path, data: Any) -> None:
    """A model file of another family (canvas_model.py's `family: diffusion_gemma`) is not a
    ModelConfig: refused by name, with what does take it."""
    if isinstance(data, dict) and data.get("family") == "diffusion_gemma":
        raise ConfigError(f"{path}: a diffusion_gemma (uniform-noise canvas) model: `mbd-jax "
                          "generate` and `mbd-jax serve` run it; eval, bench and train do not "
                          "take this family yet")


def load_model_config(path: str | pathlib.Path) -> ModelConfig:
    path = pathlib.Path(path)
    data = load_model_yaml(path)
    refuse_other_family(path, data)
    return from_dict(ModelConfig, data, where=str(path))
