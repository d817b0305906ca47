"""Argument checks shared by every config dataclass: each raises ConfigError naming the field
and the allowed range."""

from __future__ import annotations

import dataclasses
import math

from pagemem.errors import ConfigError


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` must be an int (not a bool) in ``[lo, hi]`` (``>= lo`` when ``hi`` is None)."""
    ok = not isinstance(value, bool) and isinstance(value, int) and value >= lo and (hi is None or value <= hi)
    if not ok:
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name}: must be an integer {allowed}, got {value!r}")
    return value  # type: ignore[return-value]


def check_rate(name: str, value: object) -> float:
    """``value`` must be a positive finite number; returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: must be a positive finite number, got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def as_set(config: object, name: str) -> str:
    """``name=value`` of a config dataclass's field, with ``(the default)`` where the value is the
    field's default, so a refusal that the user's other fields caused says the user never set it."""
    value = getattr(config, name)
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        if f.name == name:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            if isinstance(default, str) and isinstance(value, int):  # a size given as text, kept as bytes
                from pagemem.units import parse_size
                try:
                    default = parse_size(default)
                except ValueError:
                    pass
            if default is not dataclasses.MISSING and type(default) is type(value) and default == value:
                return f"{name}={value!r} (the default)"
    return f"{name}={value!r}"
