"""Sizes and durations as callers write them, turned into the protocol's integers: "3GiB" -> bytes
(a bare K/M/G/T/P is binary, as in the daemon's config), seconds (float) -> milliseconds."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Optional, Union

Size = Union[int, str]

_U64_MAX = 2**64 - 1
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*\Z")


def _units() -> dict:
    units = {"": 1, "b": 1}
    for power, letter in enumerate("kmgtp", start=1):
        units[letter] = units[letter + "i"] = units[letter + "ib"] = 1024**power
        units[letter + "b"] = 1000**power
    return units


_UNITS = _units()


def parse_size(value: Size, what: str = "size") -> int:
    """Bytes from an int or a string such as "3GiB", "512MiB", "1.5 GiB", "4G" (binary) or
    "4GB" (decimal). Raises ValueError/TypeError naming `what` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f'{what}: {value!r} is not a size (give bytes as an int or a string such as "3GiB")'
        )
    if isinstance(value, int):
        number = Fraction(value)
        multiplier = 1
    else:
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ValueError(
                f'{what}: {value!r} is not a size (use e.g. "3GiB", "512MiB" or a number of bytes)'
            )
        number = Fraction(match.group(1))
        multiplier = _UNITS[unit]
    size = int(number * multiplier)
    if size < 0 or size > _U64_MAX:
        raise ValueError(f"{what}: {value!r} is out of range (0 to 2^64-1 bytes)")
    return size


def seconds_to_ms(value: Optional[float], what: str, *, allow_zero: bool = True) -> Optional[int]:
    """Milliseconds (rounded up, so a tiny wait never becomes "do not wait") from seconds;
    None stays None (the daemon's default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{what}: {value!r} is not a number of seconds")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(
            f"{what}: {value!r} must be {'at least' if allow_zero else 'more than'} 0 seconds"
        )
    millis = math.ceil(value * 1000)
    if millis > _U64_MAX:
        raise ValueError(f"{what}: {value!r} seconds is out of range")
    return millis
