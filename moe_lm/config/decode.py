"""The typed decoder: a nested mapping (YAML, overrides) into the config dataclasses, every value coerced by its
field's declared type (YAML reads `1e-3` as a string), and every unknown key or wrong type an error naming the
dotted path."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from moe_lm.errors import ConfigError, shown


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, coercing each value by the field's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise ConfigError(f"unknown config key '{dotted}'; valid keys here: {', '.join(fields)}")
        kwargs[key] = _coerce(hints[key], value, dotted)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: cannot accept {shown(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: must be one of {', '.join(map(repr, choices))}, got {shown(value)}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str | int | float):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {shown(value)}")
        return origin(_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}: expected true or false, got {shown(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {shown(value)}")
        if isinstance(value, int):
            return value
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected an integer, got {shown(value)}") from None
        if not as_float.is_integer():
            raise ConfigError(f"{path}: expected an integer, got {shown(value)}")
        return int(as_float)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {shown(value)}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {shown(value)}") from None
    if tp is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"{path}: expected a string, got {shown(value)}")
        return str(value)
    raise ConfigError(f"{path}: unsupported field type {tp!r}")
