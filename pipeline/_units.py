"""Byte sizes written the way people write them: ``"64MiB"``, ``"1.5 GB"``, ``4096``; and
counts of things (``"1 tensor"``, ``"3 tensors"``)."""

from __future__ import annotations

import re

__all__ = ["MAX_SIZE", "counted", "format_bytes", "format_size", "parse_size"]

# The largest size anything here takes: what an ``off_t`` holds. Beyond it a number is
# a typo or an attack, and it would overflow the first C call that took it.
MAX_SIZE = 2**63 - 1

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+)(?:\.(\d+))?\s*([a-zA-Z]*)\s*$")
# Digits of a fraction that can still change a whole byte of the largest size.
_FRACTION_DIGITS = 24


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a number with a unit (``KiB``/``MiB``/``GiB``/``TiB``
    are powers of 1024, ``KB``/``MB``/``GB``/``TB`` of 1000, a bare ``K``/``M``/``G`` 1024).

    Raises ``ValueError`` naming the value when it is negative, not a size, or more than
    ``MAX_SIZE`` bytes.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '64MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return _at_most_max(value, value)
    match = _SIZE.match(value)
    unit = match.group(3).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size like '64MiB' or '1GiB', got {_shown(value)}")
    whole, fraction = match.group(1).lstrip("0"), (match.group(2) or "")[:_FRACTION_DIGITS]
    scale = _UNITS[unit]
    # In integers, not floats: a float turns 400 digits into infinity, and int(inf) is
    # an OverflowError; more digits than MAX_SIZE has are refused before any arithmetic.
    if len(whole) > len(str(MAX_SIZE)):
        raise ValueError(f"size {_shown(value)} is too large: at most {MAX_SIZE} bytes")
    size = int(whole or "0") * scale
    if fraction:
        size += int(fraction) * scale // 10 ** len(fraction)
    return _at_most_max(size, value)


def _at_most_max(size: int, value: int | str) -> int:
    if size > MAX_SIZE:
        raise ValueError(f"size {_shown(value)} is too large: at most {MAX_SIZE} bytes")
    return size


def _shown(value: int | str) -> str:
    """``value`` for a one-line message: a 400-digit number is cut, not quoted whole."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"of {value.bit_length()} bits"  # its digits may be too many to print
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-12:]} ({len(str(value))} chars)"


def format_size(n: int) -> str:
    """``n`` bytes as ``parse_size`` reads them back: ``"64MiB"`` when a binary unit
    divides it exactly, else ``"1000"``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_bytes(n: int | float) -> str:
    """``n`` bytes in binary units with three significant digits: ``"1.50 GiB"``,
    ``"1023 MiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(size)} B"
            digits = 2 if abs(size) < 10 else 1 if abs(size) < 100 else 0
            return f"{size:.{digits}f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in the form that agrees: ``1 file``, ``2 files``, ``0 files``
    (``plural``: where adding an ``s`` is wrong, ``"tensors differ"``)."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural if plural is not None else noun + 's'}"
