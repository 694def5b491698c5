"""The service's config (`ServeConfig`: server, generation limits, decoding defaults, cache,
monitoring, runtime), from a YAML file, `MBD_<SECTION>_<FIELD>` variables and a model
directory's generation.yaml."""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from collections.abc import Mapping
from typing import Any, Literal

import yaml

from mbd_jax.config.decoding import DecodeConfig
from mbd_jax.config.fields import _check, from_dict, load_yaml
from mbd_jax.config.model import RuntimeConfig
from mbd_jax.config.paths import resolve_model_path
from mbd_jax.errors import ConfigError


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


SchedulerType = Literal["fifo", "dynamic"]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Which waiting requests each engine step offers first (serving/admission_order.py).
    fifo: normal requests in arrival order, then thinking ones. dynamic: the oldest request's
    length class first (prompts under min_segment_len tokens are one class, merged into the same
    calls; longer ones by prefill bucket), so the rows admitted together pad less; any request
    waiting past max_wait_ms goes ahead of every grouping, thinking requests too."""

    type: SchedulerType = "dynamic"
    min_segment_len: int = 32  # tokens: shorter prompts are one class
    max_wait_ms: int = 2000  # after this long in the queue (at most half of
    # server.queue_timeout_ms), arrival order alone

    def validate(self, where: str = "scheduler") -> None:
        _check(self.min_segment_len >= 1, where, "field 'min_segment_len' must be >= 1")
        _check(self.max_wait_ms >= 0, where, "field 'max_wait_ms' must be >= 0")


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
    # The access log (serving/access.py: a line per request, always at INFO): the service's log,
    # or this file, rotated like it.
    access_log_file: str | None = None

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
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    monitoring: MonitoringConfig = MonitoringConfig()

    def validate(self, where: str = "serve") -> None:
        _check(self.decoding.buffer_size <= self.server.buffer_size, where,
               "decoding.buffer_size must be <= server.buffer_size (the compiled N_buf)")
        _check(self.decoding.max_nfe <= self.generation.max_nfe_limit, where,
               "decoding.max_nfe must be <= generation.max_nfe_limit")

    def decode_defaults(self, thinking: bool = False) -> dict[str, Any]:
        """A request's decoding settings before its own (DecodeConfig's fields): the decoding
        section, generation.diffusion_steps as the fixed_steps policy, generation.max_new_tokens
        (within the thinking budget for a thinking request). The service's requests and the
        offline commands (`generate`, `eval`) start from these."""
        gen = self.generation
        base = dataclasses.asdict(self.decoding)
        base["voting"] = self.decoding.voting and dataclasses.asdict(self.decoding.voting)
        if gen.diffusion_steps:
            base.update(policy="fixed_steps", steps_per_block=gen.diffusion_steps)
        limit = gen.thinking_max_new_tokens if thinking else gen.max_new_tokens_limit
        base["max_new_tokens"] = min(gen.max_new_tokens, limit)
        return base


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
    if load_yaml(config_path).get("family") == "diffusion_gemma":
        return {}  # its generation.yaml holds the canvas section (canvas_model.load reads it)
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
