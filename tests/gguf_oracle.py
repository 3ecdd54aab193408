"""The oracle the parse tests compare with: what ``gguf.GGUFReader`` (llama.cpp's own
Python reader) reads from a file, in the shape of ``aiogguf inspect --json``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import pytest

from aiogguf.cli import main

# key → (type, item type or None, value)
KV = dict[str, tuple[str, str | None, Any]]


def norm(value: Any) -> Any:
    """JSON's spelling of a value: non-finite floats as strings, lists element-wise."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return [norm(v) for v in value]
    return value


def flatten(value: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in value:
        out.extend(flatten(v) if isinstance(v, list) else [v])
    return out


def reader_metadata(reader: gguf.GGUFReader) -> KV:
    """key → (type, item type, value) as gguf-py reads them (it flattens nested arrays)."""
    out: KV = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            # parts: key length, key, value type, item type, count, items…
            item = gguf.GGUFValueType(int(field.parts[3][0])).name.lower()
            value = field.contents() if len(field.data) else []
            out[key] = ("array", item, norm(value))
        else:
            out[key] = (field.types[0].name.lower(), None, norm(field.contents()))
    return out


def json_metadata(metadata: dict[str, Any], *, flat: bool = True) -> KV:
    """``inspect --json``'s metadata in the reader's shape; ``flat`` flattens nested
    arrays as gguf-py does."""
    out: KV = {}
    for key, entry in metadata.items():
        value = entry["value"]
        if flat and entry["type"] == "array" and entry["item_type"] == "array":
            value = flatten(value)
        out[key] = (entry["type"], entry.get("item_type"), value)
    return out


def run_inspect(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, Any]:
    """``aiogguf inspect --json PATH``: exit 0, nothing on stderr, one JSON object."""
    assert main(["inspect", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    result: dict[str, Any] = json.loads(captured.out)
    return result
