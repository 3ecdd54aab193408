"""The oracle the parse tests compare with: what ``gguf.GGUFReader`` (llama.cpp's own
Python reader) reads from a file, in the shape of ``aiogguf inspect --json``."""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import select
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
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


def reader_tensors(reader: gguf.GGUFReader) -> dict[str, dict[str, Any]]:
    """name → type, shape (ggml order), absolute offset and size, as gguf-py reads them."""
    return {
        t.name: {
            "type": t.tensor_type.name,
            "shape": [int(d) for d in t.field.parts[3]],
            "offset": int(t.data_offset),
            "nbytes": int(t.n_bytes),
        }
        for t in reader.tensors
    }


@dataclass(frozen=True, slots=True)
class ReaderTensor:
    """One tensor as ``gguf.GGUFReader`` gives it, its data copied out of the mapping."""

    name: str
    type_id: int
    dims: tuple[int, ...]  # ggml order
    data_offset: int  # absolute, in its file
    n_bytes: int
    data: np.ndarray  # the reader's array (its shape and dtype)


@dataclass(frozen=True, slots=True)
class ReaderView:
    """What ``gguf.GGUFReader`` reads from one file, as plain values."""

    data_offset: int
    alignment: int
    big_endian: bool
    metadata: KV  # ``reader_metadata``
    tensors: tuple[ReaderTensor, ...]
    tensors_json: dict[str, dict[str, Any]]  # ``reader_tensors``


@functools.cache
def reference_reader(path: Path) -> ReaderView:
    """``gguf.GGUFReader(path)`` read once per run, for files that never change (the
    reference files): it takes a second on a big vocabulary, and several test modules
    compare with the same files. Plain values, not the reader: its fields are hundreds of
    thousands of small arrays, which every garbage collection after it would walk."""
    reader = gguf.GGUFReader(path)
    return ReaderView(
        data_offset=int(reader.data_offset),
        alignment=int(reader.alignment),
        big_endian=reader.endianess == gguf.GGUFEndian.BIG,
        metadata=reader_metadata(reader),
        tensors=tuple(
            ReaderTensor(
                name=t.name,
                type_id=int(t.tensor_type),
                dims=tuple(int(d) for d in t.shape),
                data_offset=int(t.data_offset),
                n_bytes=int(t.n_bytes),
                data=np.array(t.data),
            )
            for t in reader.tensors
        ),
        tensors_json=reader_tensors(reader),
    )


# What a sandboxed gguf-py may take: on a hostile header it allocates without bound (an
# array count of 2**40) or loops for a long time, which must fail the read, not the run.
# The files are small (a few hundred bytes, read in a few milliseconds): a quarter of a
# second of CPU time is a loop, whatever else the machine is doing; the wall-clock alarm
# is a backstop.
ORACLE_EXTRA_BYTES = 64 * 1024**2
ORACLE_CPU_SECONDS = 0.25
ORACLE_SECONDS = 5


def sandboxed_reader_view(path: Path) -> dict[str, Any] | str:
    """What ``gguf.GGUFReader`` makes of ``path``: ``{"metadata", "tensors"}`` (JSON
    shapes), or the text of its failure. Runs in a forked child with an address-space
    cap, a CPU-time cap and an alarm, so a hostile file cannot exhaust this process."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 0
        try:
            os.close(read_end)
            with open("/proc/self/status") as f:
                vm_kib = next(int(ln.split()[1]) for ln in f if ln.startswith("VmSize:"))
            cap = vm_kib * 1024 + ORACLE_EXTRA_BYTES
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            # A forked child starts with no CPU time used and no timers; SIGPROF's default
            # action ends it once it has used ORACLE_CPU_SECONDS (user and system time).
            signal.signal(signal.SIGPROF, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_PROF, ORACLE_CPU_SECONDS)
            # The default action (the end of the child), not pytest-timeout's handler,
            # which the fork inherited and which gguf-py's loops may never reach.
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(ORACLE_SECONDS)
            try:
                reader = gguf.GGUFReader(path)
                view: dict[str, Any] | str = {
                    "metadata": reader_metadata(reader),
                    "tensors": reader_tensors(reader),
                }
            except BaseException as exc:
                view = f"{type(exc).__name__}: {exc}"[:500]
            with os.fdopen(write_end, "w") as out:
                json.dump(view, out)
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as inp:
        # The child's alarm ends it; this bound is for a child that ignores it.
        ready, _, _ = select.select([inp], [], [], ORACLE_SECONDS + 10)
        text = inp.read() if ready else ""
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, wait_status = os.waitpid(pid, 0)
    if not text:
        return f"gguf-py's reader died or ran out of time (wait status {wait_status})"
    result: dict[str, Any] | str = json.loads(text)
    return result
