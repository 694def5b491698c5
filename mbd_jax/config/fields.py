"""How every config is read: a frozen dataclass filled from YAML data by `from_dict`, which
rejects unknown fields and ill-typed values with a `ConfigError` naming the field and what is
allowed; `validate` methods check cross-field constraints with `_check` / `_check_range`."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import types
import typing
from typing import Any, Literal

import yaml

from mbd_jax.errors import ConfigError


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


def config_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as plain YAML/JSON data (nested configs as mappings, tuples as lists):
    what from_dict reads back."""
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x
    return plain(dataclasses.asdict(cfg))


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
