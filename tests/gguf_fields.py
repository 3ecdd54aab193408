"""Where the integer fields of a GGUF file are, found by a walk of its own (independent of
the parser under test), so that tests can set counts and lengths to extremes.

Little-endian GGUF v2/v3 only; the walk stops at the first thing it cannot follow and
returns what it found so far, so it also works on damaged files."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

__all__ = ["IntField", "integer_fields", "metadata_value_field", "set_field"]

# value type id → bytes of a fixed-size value (8: string, 9: array are not fixed).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FLOATS = {6, 12}
# At most this many items of one array are listed (a vocabulary has 10^5).
_ITEMS_LISTED = 16


@dataclass(frozen=True, slots=True)
class IntField:
    """An unsigned integer field of ``size`` bytes at ``offset``; ``what`` says which."""

    offset: int
    size: int
    what: str


class _Stop(Exception):
    pass


class _Walk:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.fields: list[IntField] = []

    def take(self, pos: int, size: int, what: str, *, listed: bool = True) -> int:
        if pos + size > len(self.buf):
            raise _Stop
        if listed:
            self.fields.append(IntField(pos, size, what))
        return int.from_bytes(self.buf[pos : pos + size], "little")

    def string(self, pos: int, what: str, *, listed: bool = True) -> int:
        length = self.take(pos, 8, what + " length", listed=listed)
        if pos + 8 + length > len(self.buf):
            raise _Stop
        return pos + 8 + length

    def value(self, vt: int, pos: int, what: str, depth: int) -> int:
        if vt == 8:
            return self.string(pos, what)
        if vt == 9:
            if depth > 4:
                raise _Stop
            item_vt = self.take(pos, 4, what + " item type")
            count = self.take(pos + 4, 8, what + " count")
            pos += 12
            if item_vt in _FIXED:
                size = _FIXED[item_vt]
                for k in range(min(count, _ITEMS_LISTED)):
                    if item_vt not in _FLOATS:
                        self.take(pos + k * size, size, f"{what}[{k}]")
                if pos + count * size > len(self.buf):
                    raise _Stop
                return pos + count * size
            for k in range(count):
                if item_vt == 8:
                    pos = self.string(pos, f"{what}[{k}]", listed=k < _ITEMS_LISTED)
                else:
                    pos = self.value(item_vt, pos, f"{what}[{k}]", depth + 1)
            return pos
        size = _FIXED.get(vt)
        if size is None:
            raise _Stop
        if vt not in _FLOATS:
            self.take(pos, size, what)
        return pos + size

    def walk(self) -> None:
        self.take(4, 4, "version")
        n_tensors = self.take(8, 8, "tensor_count")
        n_kv = self.take(16, 8, "kv_count")
        pos = 24
        for i in range(n_kv):
            end = self.string(pos, f"kv #{i} key")
            key = self.buf[pos + 8 : end].decode(errors="replace")
            vt = self.take(end, 4, f"{key} type")
            pos = self.value(vt, end + 4, key, 0)
        for i in range(n_tensors):
            end = self.string(pos, f"tensor #{i} name")
            n_dims = self.take(end, 4, f"tensor #{i} n_dims")
            if n_dims > 4:
                raise _Stop
            for k in range(n_dims):
                self.take(end + 4 + 8 * k, 8, f"tensor #{i} ne[{k}]")
            pos = end + 4 + 8 * n_dims
            self.take(pos, 4, f"tensor #{i} type")
            self.take(pos + 4, 8, f"tensor #{i} offset")
            pos += 12


def integer_fields(buf: bytes) -> list[IntField]:
    """Every integer field of the header in ``buf`` (counts, lengths, ids, scalars, the
    first items of arrays), in file order."""
    walk = _Walk(buf)
    with contextlib.suppress(_Stop):
        walk.walk()
    return walk.fields


def metadata_value_field(buf: bytes, key: str) -> IntField:
    """The field holding the integer value of metadata ``key``."""
    for f in integer_fields(buf):
        if f.what == key:
            return f
    raise KeyError(key)


def set_field(buf: bytes, field: IntField, value: int) -> bytes:
    """``buf`` with ``field`` set to ``value`` (cut to the field's width)."""
    raw = (value % (1 << (8 * field.size))).to_bytes(field.size, "little")
    return buf[: field.offset] + raw + buf[field.offset + field.size :]
