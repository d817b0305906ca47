"""Configuration dataclasses to and from plain values (JSON, TOML, command-line overrides).

One helper, driven by ``dataclasses.fields``, so that a knob has one name everywhere: the
Python field, the key in a JSON or TOML file, and the dotted command-line flag
(``--store.gpu_bytes 2GiB`` sets field ``gpu_bytes`` of section ``store``). Values are checked by
the dataclasses themselves; this module only routes them, and names the full dotted field in
every error.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any, Mapping, TypeVar

import tomllib
import torch

from pagemem.errors import ConfigError

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The dtype names a plain value may give."""


def to_plain(value: Any) -> Any:
    """A dataclass (recursively) as dicts, lists, strings and numbers; dtypes by name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def from_plain(cls: type[T], data: Any, where: str = "") -> T:
    """Build ``cls`` from :func:`to_plain`'s shape. Missing keys take the field's default; an
    unknown key, a value of the wrong kind or one the dataclass refuses raises ``ConfigError``
    naming the dotted field (``where`` is the prefix: ``"store"`` gives ``store.gpu_bytes``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a table of fields, got {type(data).__name__}")
    init = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in init:
            raise ConfigError(f"{_dot(where, key)}: unknown key; known: {', '.join(init)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value, _dot(where, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if not where:
            raise
        raise ConfigError(f"{where}.{exc}") from None
    except TypeError as exc:  # a required field missing
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


def field_names(cls: type) -> list[str]:
    """Every settable dotted name of ``cls`` (nested dataclasses expanded)."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        inner = _dataclass_in(hints[f.name])
        out.extend(f"{f.name}.{n}" for n in field_names(inner)) if inner else out.append(f.name)
    return out


def with_overrides(data: Mapping[str, Any], overrides: Mapping[str, str], cls: type | None = None) -> dict[str, Any]:
    """``data`` with dotted overrides set (``{"optimizer.lr": "3e-4"}``). Each value is read as a
    TOML value where it is one (``3e-4``, ``true``, ``[0.9, 0.95]``) and as a string otherwise
    (``2GiB``, a path). With ``cls``, a dotted name that is no field of it is refused."""
    out = _deep_copy(data)
    known = set(field_names(cls)) if cls is not None else None
    for dotted, text in overrides.items():
        if known is not None and dotted not in known:
            raise ConfigError(f"{dotted}: unknown setting; known: {', '.join(sorted(known))}")
        *sections, last = dotted.split(".")
        node = out
        for s in sections:
            child = node.setdefault(s, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{dotted}: {s} is a value, not a section")
            node = child
        node[last] = parse_value(text)
    return out


def parse_value(text: str) -> Any:
    """A command-line value: a TOML value where it parses as one, else the string itself."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _convert(hint: Any, value: Any, where: str) -> Any:
    inner = _dataclass_in(hint)
    if inner is not None and isinstance(value, Mapping):
        return from_plain(inner, value, where)
    if _is(hint, torch.dtype) and isinstance(value, str):
        if value.removeprefix("torch.") not in DTYPES:
            raise ConfigError(f"{where}: must be one of {', '.join(DTYPES)}, got {value!r}")
        return DTYPES[value.removeprefix("torch.")]
    if isinstance(value, list) and _is_tuple(hint):
        return tuple(value)
    return value


def _options(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _dataclass_in(hint: Any) -> type | None:
    for option in _options(hint):
        if isinstance(option, type) and dataclasses.is_dataclass(option):
            return option
    return None


def _is(hint: Any, kind: type) -> bool:
    return any(option is kind for option in _options(hint))


def _is_tuple(hint: Any) -> bool:
    return any(option is tuple or typing.get_origin(option) is tuple for option in _options(hint))


def _dot(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
