"""Byte sizes written the way people write them: ``"64MiB"``, ``"1.5 GB"``, ``4096``;
durations the way ollama's ``keep_alive`` takes them (``"5m"``, ``"1h30m"``, ``300``,
``-1``); and counts of things (``"1 tensor"``, ``"3 tensors"``)."""

from __future__ import annotations

import math
import re
from decimal import Decimal

__all__ = [
    "MAX_DURATION_S",
    "MAX_SIZE",
    "counted",
    "format_bytes",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_size",
]

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


# Go's ``time.Duration`` (what ollama's ``keep_alive`` is) holds 2**63 ns, about 292
# years: a longer duration is a typo, and the clients that script against ollama could
# not send it back.
MAX_DURATION_S = (2**63 - 1) / 1e9
_DURATION_UNITS: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,  # micro sign
    "\u03bcs": 1e-6,  # Greek mu
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
# One ``<number><unit>`` of Go's duration syntax; a duration is one or more of them.
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_PLAIN_SECONDS = re.compile(r"[-+]?(\d+(?:\.\d*)?|\.\d+)")
# Longer text is no duration anyone writes; it is refused before any arithmetic.
_MAX_DURATION_CHARS = 64


def parse_duration(value: int | float | str) -> float:
    """Seconds in ``value``, as ollama reads ``keep_alive``: a number of seconds (JSON or
    text, ``300``, ``"2.5"``) or Go's duration syntax (``"5m"``, ``"1h30m"``, ``"300ms"``;
    units ns, us, ms, s, m, h; no spaces). Any negative value (``-1``, ``"-1m"``) means
    forever and returns ``math.inf``; ``0`` means at once.

    Raises ``ValueError`` naming the value: not a duration, not finite, or longer than
    ``MAX_DURATION_S`` (Go's limit, about 292 years).
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(
            f"expected a duration like '5m', '30s' or '1h', or seconds, got {_shown_any(value)}"
        )
    if isinstance(value, int):
        seconds = float(value) if value.bit_length() <= 128 else (math.inf if value > 0 else -1.0)
    elif isinstance(value, float):
        if math.isnan(value):
            raise ValueError("a duration cannot be NaN")
        seconds = value
    else:
        seconds = _duration_text(value)
    if seconds < 0:
        return math.inf
    seconds += 0.0  # "-0s" is 0, not -0.0
    if seconds > MAX_DURATION_S:
        raise ValueError(
            f"duration {_shown_any(value)} is too long: at most {MAX_DURATION_S:.0f} s "
            "(use -1 for forever)"
        )
    return seconds


def _duration_text(text: str) -> float:
    if len(text) > _MAX_DURATION_CHARS:
        raise ValueError(f"duration {_shown(text)} is too long to be one")
    if _PLAIN_SECONDS.fullmatch(text):
        return float(text)
    body = text[1:] if text[:1] in "+-" else text
    pos, seconds = 0, 0.0
    while pos < len(body):
        part = _DURATION_PART.match(body, pos)
        if part is None:
            break
        seconds += float(part.group(1)) * _DURATION_UNITS[part.group(2)]
        pos = part.end()
    if not body or pos != len(body):
        raise ValueError(
            f"expected a duration like '5m', '30s', '1h30m' or '-1' (forever), or seconds "
            f"(units: ns, us, ms, s, m, h), got {_shown(text)}"
        )
    return -seconds if text.startswith("-") else seconds


_NANOSECOND = Decimal("1e-9")


def format_duration(seconds: float) -> str:
    """``seconds`` as ``parse_duration`` reads it back, to the nanosecond (Go's unit):
    ``"5m"``, ``"90s"``, ``"0.25s"``, ``"-1"`` for forever."""
    if math.isinf(seconds):
        return "-1"
    for unit, scale in (("h", 3600), ("m", 60)):
        if seconds and seconds % scale == 0:
            return f"{int(seconds // scale)}{unit}"
    # The shortest digits that read back as the same float, never an exponent (which
    # Go's syntax has not).
    text = f"{Decimal(repr(seconds)).quantize(_NANOSECOND):f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _shown_any(value: object) -> str:
    return _shown(value) if isinstance(value, int | str) else repr(value)[:40]


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
