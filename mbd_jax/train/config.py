"""TrainConfig: one training run (configs/train/*.yaml), validated at load."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any, Literal

import yaml

from mbd_jax.config import REPO_ROOT, from_dict, load_yaml
from mbd_jax.config.fields import _check
from mbd_jax.config.paths import shipped
from mbd_jax.errors import ConfigError
from mbd_jax.train.tasks import FORMAT_WEIGHTS, TRAIN_TASKS


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    name: str  # the trained model's name (written into its config.yaml)
    # Architecture: a preset / YAML (random init) or a model directory (start from its weights).
    model: str
    output: str | None = None  # the model directory written at the end (relative paths: to the
    # repo root); default runs/<name>-model. A shipped model (models/...) is replaced only with
    # force (`mbd-jax train --force`).
    tasks: tuple[str, ...] = ("arith", "sort", "reverse", "recall")  # in turn: k times = k shares
    # The share of examples asked with the thinking switch on (a worked trace, then the answer:
    # train/tasks.py); the rest are drawn by format_weights.
    thinking_share: float = 0.0
    # The question formats' relative weights (chat, system, multiturn, raw; a format left out is
    # never drawn). None: tasks.FORMAT_WEIGHTS.
    format_weights: dict[str, float] | None = None
    # Raw-format replies start with tasks.RAW_ANSWER_PREFIX ("Answer:"): the only mark of where a
    # raw answer begins (train/tasks.py). False: the bare answer (the stages before it).
    raw_answer_prefix: bool = False
    # Token-to-token training for the edit sampling mode: each unmasked answer position of a noisy
    # block becomes a random token with this probability, and the loss also covers every unmasked
    # answer position (keep a right token, restore a wrong one). 0: masked positions only.
    edit_share: float = 0.0
    # Objective: block diffusion is MultiTF with groups of one block (g_max 1).
    objective: Literal["bd", "multitf"] = "bd"
    g_max: int = 1  # multitf: largest noise group (= the N_buf it prepares for)
    n_random_layouts: int = 1  # multitf: random layouts per example, beside the systematic ones
    weighting: Literal["llada2", "sdar"] = "llada2"  # mean over masked, or 1/t self-normalised
    seq_len: int = 48  # tokens per example (prompt + answer + EOS padding), multiple of block
    # Shorter row lengths a step may use beside seq_len (each a multiple of block_size): a step's
    # examples all fit its length and come from the examples that need it, and each length gets
    # the share of steps its examples have, so the data seen is the same and padding is not.
    length_buckets: tuple[int, ...] = ()
    batch_size: int = 32  # examples per step (rows = examples x layouts)
    steps: int = 1000  # the schedule's length (warmup, then cosine decay to the end)
    # Stop (checkpoint and export) at this step instead, the schedule still spanning `steps`: a
    # run that keeps an early point of a longer one (configs/train/recall-lookup.yaml).
    stop_at: int | None = None
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    end_lr_fraction: float = 0.1  # cosine decays to learning_rate * this
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b2: float = 0.98
    # Auxiliary-loss-free load balancing (routers with an expert_bias): after each step every
    # expert's bias moves this much toward balance (down if it got more than the mean of its
    # layer's routed tokens, up if fewer). DeepSeek-V3 uses 0.001; 0 leaves the bias fixed.
    expert_bias_rate: float = 1e-3
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # parameters stay float32
    seed: int = 0
    data_parallel: int = -1  # devices on the mesh's data axis; -1 = all local devices
    checkpoint_dir: str | None = None  # orbax CheckpointManager directory (resume from it)
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10

    def validate(self, where: str = "train") -> None:
        bad = [t for t in self.tasks if t not in TRAIN_TASKS]
        _check(not bad and len(self.tasks) > 0, where,
               f"field 'tasks' has unknown task(s) {bad}; allowed: {', '.join(TRAIN_TASKS)}")
        _check(0 <= self.thinking_share <= 1, where,
               f"field 'thinking_share' must be in [0, 1], got {self.thinking_share}")
        fw = self.format_weights
        _check(fw is None or (set(fw) <= set(FORMAT_WEIGHTS) and all(w >= 0 for w in fw.values())
                              and sum(fw.values()) > 0), where,
               f"field 'format_weights' must map some of {', '.join(FORMAT_WEIGHTS)} to weights "
               f">= 0, not all 0; got {fw}")
        _check(0 <= self.edit_share < 1, where,
               f"field 'edit_share' must be in [0, 1), got {self.edit_share}")
        _check(self.g_max >= 1, where, f"field 'g_max' must be >= 1, got {self.g_max}")
        _check(self.objective == "multitf" or self.g_max == 1, where,
               "objective 'bd' trains one block per noise group: set g_max 1 or objective multitf")
        _check(self.objective == "bd" or self.g_max >= 2, where,
               "objective 'multitf' needs g_max >= 2")
        for f in ("seq_len", "batch_size", "steps", "checkpoint_every", "keep_checkpoints",
                  "log_every"):
            _check(getattr(self, f) >= 1, where, f"field '{f}' must be >= 1, got {getattr(self, f)}")
        _check(self.stop_at is None or 1 <= self.stop_at <= self.steps, where,
               f"field 'stop_at' must be in [1, steps ({self.steps})], got {self.stop_at}")
        _check(all(0 < b < self.seq_len for b in self.length_buckets)
               and list(self.length_buckets) == sorted(set(self.length_buckets)), where,
               f"field 'length_buckets' must be increasing lengths below seq_len "
               f"({self.seq_len}), got {list(self.length_buckets)}")
        _check(self.n_random_layouts >= 0 and self.warmup_steps >= 0, where,
               "fields 'n_random_layouts' and 'warmup_steps' must be >= 0")
        _check(self.learning_rate > 0 and 0 <= self.end_lr_fraction <= 1, where,
               "field 'learning_rate' must be > 0 and 'end_lr_fraction' in [0, 1]")
        _check(self.weight_decay >= 0 and self.clip_norm > 0 and 0 < self.b2 < 1, where,
               "need weight_decay >= 0, clip_norm > 0, 0 < b2 < 1")
        _check(self.expert_bias_rate >= 0, where,
               f"field 'expert_bias_rate' must be >= 0, got {self.expert_bias_rate}")
        _check(self.data_parallel == -1 or self.data_parallel >= 1, where,
               "field 'data_parallel' must be >= 1 or -1 (all devices)")

    def run_fields(self) -> dict[str, Any]:
        """The fields that define what a run trains (JSON values): a checkpoint resumes only
        under a config that agrees on all of them (RESUMABLE_FIELDS may change)."""
        return json.loads(json.dumps({f.name: getattr(self, f.name)
                                      for f in dataclasses.fields(self)
                                      if f.name not in RESUMABLE_FIELDS}))

    def lengths(self) -> tuple[int, ...]:
        """Every row length a step may use, ascending (length_buckets, then seq_len)."""
        return (*self.length_buckets, self.seq_len)

    def output_dir(self) -> pathlib.Path:
        return self.path(self.output or f"runs/{self.name}-model")

    def path(self, p: str) -> pathlib.Path:
        q = pathlib.Path(p)
        return q if q.is_absolute() else REPO_ROOT / q


# What a resumed run may change: where it writes, how often it logs and saves, how far it goes.
RESUMABLE_FIELDS = frozenset({"name", "model", "output", "steps", "stop_at", "checkpoint_dir",
                              "checkpoint_every", "keep_checkpoints", "log_every",
                              "data_parallel"})


def parse_overrides(pairs: Sequence[str], where: str = "--set") -> dict[str, Any]:
    """FIELD=VALUE strings (VALUE read as YAML: 3, 0.5, [a, b], text) as a mapping; the config
    then checks each field's name and type like a field of the file."""
    out = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep or not field.strip():
            raise ConfigError(f"{where} {pair!r}: expected FIELD=VALUE, e.g. g_max=3")
        try:
            out[field.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"{where} {pair!r}: VALUE is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    return out


def load_train_config(path: str | pathlib.Path, **overrides) -> TrainConfig:
    """The config file (a shipped one by its relative path from anywhere: paths.shipped) with
    `overrides` (field -> value; None keeps the file's) on top."""
    path = shipped(path)
    data = load_yaml(path) or {}
    if isinstance(data, dict):
        data.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(TrainConfig, data, where=str(path))
