"""Configs as validated dataclasses loaded from YAML, one module per owner: the model
(model.py), decoding (decoding.py), the service with its generation, cache and monitoring
sections (serving.py); how any of them is read (fields.py), what `auto` stands for per backend
(backend.py), where shipped models live (paths.py). Every public name is importable from here."""

from mbd_jax.config.backend import AUTO, MEASURED, measured_candidates, resolve_auto
from mbd_jax.config.decoding import (BlockActivation, DecodeConfig, EditConfirm, SamplingMode,
                                     UnmaskPolicy, VoteExtractor, VoteWeighting, VotingConfig,
                                     decode_config)
from mbd_jax.config.fields import config_dict, from_dict, load_yaml
from mbd_jax.config.model import (RUNTIME_FIELDS, AttentionImpl, BlockMode, DType, LayerLoop,
                                  LayerType, ModelConfig, MoeImpl, Platform, Quantization,
                                  RopeScaling, RopeType,
                                  RouterType, RuntimeConfig, SequenceModule, load_model_config,
                                  load_model_yaml, with_runtime)
from mbd_jax.config.paths import (DATA_ROOT, IN_CHECKOUT, MODEL_PRESET_DIR, REPO_ROOT,
                                  SHIPPED_MODEL_DIR, available_presets, latest_version,
                                  model_version, resolve_model_path)
from mbd_jax.config.serving import (GENERATION_FILE, GENERATION_SECTIONS, CacheConfig,
                                    GenerationConfig, MonitoringConfig, SchedulerConfig,
                                    ServeConfig, ServerConfig,
                                    load_serve_config, model_generation_settings, serve_env_names)
from mbd_jax.config.structure import Structure, StructureKind
from mbd_jax.errors import ConfigError

__all__ = [
    "AUTO", "MEASURED", "measured_candidates", "resolve_auto",
    "BlockActivation", "DecodeConfig", "EditConfirm", "SamplingMode", "UnmaskPolicy",
    "VoteExtractor", "VoteWeighting", "VotingConfig", "decode_config",
    "config_dict", "from_dict", "load_yaml",
    "RUNTIME_FIELDS", "AttentionImpl", "BlockMode", "DType", "LayerLoop", "LayerType",
    "ModelConfig", "MoeImpl", "Platform", "Quantization", "RopeScaling", "RopeType", "RouterType",
    "RuntimeConfig",
    "SequenceModule", "load_model_config", "load_model_yaml", "with_runtime",
    "DATA_ROOT", "IN_CHECKOUT", "MODEL_PRESET_DIR", "REPO_ROOT", "SHIPPED_MODEL_DIR",
    "available_presets", "latest_version", "model_version", "resolve_model_path",
    "GENERATION_FILE", "GENERATION_SECTIONS", "CacheConfig", "GenerationConfig",
    "MonitoringConfig", "SchedulerConfig", "ServeConfig", "ServerConfig", "load_serve_config",
    "model_generation_settings", "serve_env_names",
    "Structure", "StructureKind",
    "ConfigError",
]
