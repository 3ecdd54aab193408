"""``aiogguf inspect PATH [--json]``: a model's files, metadata and tensors.

The readable form is plain-text tables, one line per tensor, with long arrays and strings
abbreviated; ``--json`` prints one complete JSON object (shape in ``inspect_json``).
Nothing but the headers is read: of a URL or an ``hf://`` name, the first request's
megabyte, more only for a larger header.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from aiogguf._local_index import index_local_file
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
    index = _index(args.path)
    if args.json:
        sys.stdout.write(json.dumps(inspect_json(index), allow_nan=False) + "\n")
    else:
        _print_summary(index, sys.stdout)
    return 0


def _index(path: str) -> WeightIndex:
    """The model's index, as ``aiogguf.inspect_sync`` makes it. A single local file is
    parsed on a thread of this command's, without an event loop or the loader's import
    (``index_local_file``); a split set or a remote name goes through ``inspect_sync``."""
    found: list[WeightIndex | BaseException | None] = []

    def parse() -> None:
        try:
            found.append(index_local_file(path))
        except BaseException as exc:  # handed to the main thread, which raises it
            found.append(exc)

    # A daemon thread, and the main thread waits for it: an open() stuck on a hung
    # filesystem cannot hold the main thread, so Ctrl-C still ends the process.
    thread = threading.Thread(target=parse, name="aiogguf-inspect", daemon=True)
    thread.start()
    thread.join()
    result = found[0]
    if isinstance(result, BaseException):
        raise result
    if result is not None:
        return result
    from aiogguf._dry_run import inspect_sync

    return inspect_sync(path)


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


def _shown(text: str) -> str:
    """A name from the file, safe to print: a control character (a newline, a terminal's
    escape sequence) is shown escaped, as ``repr`` shows it."""
    return (
        text
        if text.isprintable()
        else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    )


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], right: int = 0) -> str:
    """A titled table of plain text: one line per row, columns padded to their widest
    cell, the last ``right`` columns right-aligned. Plain lines cost a few microseconds
    a row where a rich table costs half a millisecond (150 ms for a model's 300
    tensors), keep each tensor on one line for grep, and show a file's strings as they
    are (no markup in them is interpreted)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    first_right = len(header) - right

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.rjust(w) if i >= first_right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *map(line, rows), ""]) + "\n"


def _print_summary(index: WeightIndex, out: TextIO) -> None:
    files = [
        (
            str(i),
            _shown(os.path.basename(f.path)),
            str(f.version),
            f.byte_order,
            str(f.alignment),
            str(f.data_offset),
            format_bytes(f.file_size),
            str(len(f.tensors)),
        )
        for i, f in enumerate(index.files)
    ]
    header = ("split", "file", "version", "order", "align", "data at", "size", "tensors")
    parts = [_table("files", header, files, right=4)]
    metadata = [
        (_shown(key), entry.type.json_name, _preview(entry.value))
        for key, entry in index.metadata.items()
    ]
    parts.append(_table("metadata", ("key", "type", "value"), metadata))
    tensors = [
        (
            "-" if t.layer is None else str(t.layer),
            _shown(t.name),
            t.type.name,
            "×".join(map(str, t.shape)) or "scalar",
            t.tensor_class.value,
            format_bytes(t.nbytes),
            f"{t.file_index}:{t.offset}",
        )
        for t in index.tensors
    ]
    columns = ("layer", "name", "type", "shape", "class", "bytes", "file:offset")
    parts.append(_table("tensors (by layer)", columns, tensors, right=2))

    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for t in index.tensors:
        counts[t.type.name] += 1
        sizes[t.type.name] += t.nbytes
    total = index.totals
    histogram = [
        (
            name,
            str(count),
            format_bytes(sizes[name]),
            f"{sizes[name] / total.nbytes if total.nbytes else 0.0:.1%}",
        )
        for name, count in counts.most_common()
    ]
    parts.append(_table("tensor types", ("type", "tensors", "bytes", "share"), histogram, right=3))
    parts.append(
        f"{counted(total.n_tensors, 'tensor')}, {total.n_elements:,} elements, "
        f"{format_bytes(total.nbytes)}, {total.bpw:.3f} bits per weight\n"
    )
    notes = [w for f in index.files for w in f.warnings] + list(index.warnings)
    if not all(f.llama_cpp_loadable for f in index.files):
        notes.append("llama.cpp cannot load this model (arrays of arrays in its metadata)")
    parts.extend(f"warning: {note}\n" for note in notes)
    out.write("".join(parts))
