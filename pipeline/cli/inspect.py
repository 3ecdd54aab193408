"""``aiogguf inspect PATH [--json]``: a model's files, metadata and tensors.

The readable form abbreviates long arrays and strings; ``--json`` prints one complete JSON
object (shape in ``inspect_json``). Nothing but the headers is read: of a URL or an
``hf://`` name, the first request's megabyte, more only for a larger header.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from aiogguf._dry_run import inspect_sync
from aiogguf._records import GGUFArray, MetadataValue, ValueType, WeightIndex
from aiogguf._units import counted, format_bytes

__all__ = ["add_arguments", "inspect_json", "run"]

_PREVIEW_ITEMS = 6
_PREVIEW_CHARS = 80


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``inspect`` command's flags."""
    parser.add_argument(
        "path", help="a .gguf file, URL or hf:// name (the first split of a split model)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print a model's header and tensor index (a summary, or JSON)."""
    index = inspect_sync(args.path)
    if args.json:
        sys.stdout.write(json.dumps(inspect_json(index), allow_nan=False) + "\n")
    else:
        _print_summary(index, Console())
    return 0


# --- JSON ----------------------------------------------------------------------------


def _json_float(value: float) -> float | str:
    # JSON has no NaN or infinities: they travel as the strings "nan", "inf", "-inf".
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _json_value(value: MetadataValue) -> Any:
    if isinstance(value, GGUFArray):
        values = value.values
        if isinstance(values, np.ndarray):
            items = values.tolist()
            if values.dtype.kind == "f" and not bool(np.isfinite(values).all()):
                return [_json_float(v) for v in items]
            return items
        return [_json_value(v) for v in values]
    if isinstance(value, float):
        return _json_float(value)
    return value


def _json_metadata_type(value: MetadataValue, vt: ValueType) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": vt.json_name, "value": _json_value(value)}
    if isinstance(value, GGUFArray):
        entry["item_type"] = value.item_type.json_name
    return entry


def inspect_json(index: WeightIndex) -> dict[str, Any]:
    """The ``inspect --json`` object: ``files``, ``metadata``, ``tensors``, ``totals``.

    ``metadata`` is the first file's keys, complete; tensor offsets are absolute byte
    offsets in their file (``file`` = split index); shapes are in ggml order (ne[0] first).
    """
    files = [
        {
            "path": f.path,
            "version": f.version,
            "byte_order": f.byte_order,
            "alignment": f.alignment,
            "data_offset": f.data_offset,
            "size": f.file_size,
            "n_tensors": len(f.tensors),
        }
        for f in index.files
    ]
    metadata = {
        key: _json_metadata_type(entry.value, entry.type) for key, entry in index.metadata.items()
    }
    tensors = [
        {
            "name": t.name,
            "type": t.type.name,
            "shape": list(t.shape),
            "file": t.file_index,
            "offset": t.offset,
            "nbytes": t.nbytes,
            "layer": t.layer,
            "class": t.tensor_class.value,
        }
        for t in index.tensors
    ]
    totals = index.totals
    return {
        "files": files,
        "metadata": metadata,
        "tensors": tensors,
        "totals": {
            "n_tensors": totals.n_tensors,
            "nbytes": totals.nbytes,
            "n_elements": totals.n_elements,
            "bpw": totals.bpw,
        },
    }


# --- readable summary ----------------------------------------------------------------


def _short(text: str) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= _PREVIEW_CHARS else text[: _PREVIEW_CHARS - 1] + "…"


def _preview(value: MetadataValue) -> str:
    if isinstance(value, GGUFArray):
        first = value.values[:_PREVIEW_ITEMS]
        items = first.tolist() if isinstance(first, np.ndarray) else first
        head = [_preview(v) if isinstance(v, GGUFArray) else repr(v) for v in items]
        more = ", …" if len(value) > _PREVIEW_ITEMS else ""
        return _short(f"[{len(value)} × {value.item_type.json_name}] [{', '.join(head)}{more}]")
    if isinstance(value, str):
        return _short(repr(value))
    return str(value)


def _print_summary(index: WeightIndex, console: Console) -> None:
    files = Table(title="files", title_justify="left")
    for column in ("split", "file", "version", "order", "align", "data at", "size", "tensors"):
        files.add_column(column, overflow="fold")
    for i, f in enumerate(index.files):
        files.add_row(
            str(i),
            os.path.basename(f.path),
            str(f.version),
            f.byte_order,
            str(f.alignment),
            str(f.data_offset),
            format_bytes(f.file_size),
            str(len(f.tensors)),
        )
    console.print(files)

    metadata = Table(title="metadata", title_justify="left")
    metadata.add_column("key", overflow="fold")
    metadata.add_column("type")
    metadata.add_column("value", overflow="fold")
    for key, entry in index.metadata.items():
        metadata.add_row(key, entry.type.json_name, _preview(entry.value))
    console.print(metadata)

    tensors = Table(title="tensors (by layer)", title_justify="left")
    name_width = min(40, max((len(t.name) for t in index.tensors), default=4))
    tensors.add_column("layer")
    tensors.add_column("name", min_width=name_width, overflow="fold")
    tensors.add_column("type")
    tensors.add_column("shape", overflow="fold")
    tensors.add_column("bytes", justify="right")
    tensors.add_column("class")
    tensors.add_column("file:offset", justify="right", overflow="fold")
    for t in index.tensors:
        tensors.add_row(
            "-" if t.layer is None else str(t.layer),
            t.name,
            t.type.name,
            "×".join(map(str, t.shape)) or "scalar",
            format_bytes(t.nbytes),
            t.tensor_class.value,
            f"{t.file_index}:{t.offset}",
        )
    console.print(tensors)

    histogram = Table(title="tensor types", title_justify="left")
    for column in ("type", "tensors", "bytes", "share"):
        histogram.add_column(column, justify="left" if column == "type" else "right")
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for t in index.tensors:
        counts[t.type.name] += 1
        sizes[t.type.name] += t.nbytes
    total = index.totals
    for name, count in counts.most_common():
        share = sizes[name] / total.nbytes if total.nbytes else 0.0
        histogram.add_row(name, str(count), format_bytes(sizes[name]), f"{share:.1%}")
    console.print(histogram)

    console.print(
        f"{counted(total.n_tensors, 'tensor')}, {total.n_elements:,} elements, "
        f"{format_bytes(total.nbytes)}, {total.bpw:.3f} bits per weight"
    )
    notes = [w for f in index.files for w in f.warnings] + list(index.warnings)
    if not all(f.llama_cpp_loadable for f in index.files):
        notes.append("llama.cpp cannot load this model (arrays of arrays in its metadata)")
    for note in notes:
        console.print(f"[yellow]warning:[/yellow] {note}", highlight=False)
