"""Byte sizes: parse "4MiB"-style strings and format byte counts for people."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
    "p": 10**15, "pb": 10**15, "pib": 2**50,
    "e": 10**18, "eb": 10**18, "eib": 2**60,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, field: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int or a string such as ``"4MiB"``, ``"1.5GiB"``, ``"512"`` or ``"2GB"``
    (binary units KiB to EiB, decimal units KB to EB). Raises ConfigError naming ``field``.
    """
    from pagemem.errors import ConfigError

    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a byte count (int or '4MiB'-style string), got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{field}: cannot parse {value!r}; use an int or a number with a unit "
                "such as '4MiB', '2GiB', '512KiB', '1GB'"
            )
        number = Fraction(m.group(1)) * _UNITS[unit]
        if number.denominator != 1:
            raise ConfigError(f"{field}: {value!r} is not a whole number of bytes")
        return int(number)
    raise ConfigError(f"{field}: expected a byte count (int or '4MiB'-style string), got {type(value).__name__}")


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit, e.g. ``format_bytes(4 << 20) == '4.0 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
