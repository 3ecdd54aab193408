"""Frozen records to JSON and back, by their type hints: how a plan and a load report
cross a process border (``_share``) without pickle.

``to_json`` writes a record as an object of its fields (enums by value, tuples as
lists); ``from_json`` rebuilds a record of a given class from such an object and trusts
nothing in it: every field present and no other, every value of its field's type (no
``true`` for an int, no ``1`` for a bool), every int within 64 bits. What is wrong
raises ``RecordError`` naming the field's path (``plan.buffers[2].ranges[0].end``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from typing import Any

__all__ = ["RecordError", "from_json", "to_json"]

_INT_LIMIT = 1 << 63


class RecordError(ValueError):
    """A JSON value that is not the record it should be: ``where`` names the field."""

    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")


def to_json(value: Any) -> Any:
    """``value`` (a frozen dataclass, an enum, a tuple, or a JSON scalar) as plain JSON
    values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [to_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # "nan", "inf": JSON has no such numbers
    return value


def from_json(cls: Any, data: Any, where: str) -> Any:
    """The value of type ``cls`` (a record class, or a type such as ``tuple[R, ...]``)
    that ``data`` (from ``to_json``, or a liar) describes. Raises ``RecordError`` naming
    the first field that is wrong."""
    return _decode(cls, data, where)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is type(None):
        if data is not None:
            raise RecordError(where, f"expected null, got {_kind(data)}")
        return None
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:
            return _decode(others[0], data, where)
        raise RecordError(where, f"cannot decide between {args}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, list):
            raise RecordError(where, f"expected a list, got {_kind(data)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise RecordError(where, f"expected {len(args)} items, got {len(data)}")
        pairs = enumerate(zip(args, data, strict=True))
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in pairs)
    if tp is bool:
        if not isinstance(data, bool):
            raise RecordError(where, f"expected true or false, got {_kind(data)}")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise RecordError(where, f"expected an integer, got {_kind(data)}")
        if not -_INT_LIMIT <= data < _INT_LIMIT:
            raise RecordError(where, f"{data} does not fit in 64 bits")
        return data
    if tp is float:
        if isinstance(data, str) and data in ("nan", "inf", "-inf"):
            return float(data)
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise RecordError(where, f"expected a number, got {_kind(data)}")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise RecordError(where, f"expected a string, got {_kind(data)}")
        return data
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except (ValueError, TypeError):
            raise RecordError(where, f"{data!r} is not a {tp.__name__}") from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_record(tp, data, where)
    raise RecordError(where, f"no JSON form for {tp!r}")  # a record this module cannot take


def _decode_record(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise RecordError(where, f"expected an object, got {_kind(data)}")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    if unknown:
        raise RecordError(where, f"unknown field {unknown[0]!r}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in fields:
        if f.name not in data:
            raise RecordError(where, f"field {f.name!r} is missing")
        values[f.name] = _decode(hints[f.name], data[f.name], f"{where}.{f.name}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise RecordError(where, str(exc)) from None


def _kind(data: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(data), "null" if data is None else "a number"
    )
