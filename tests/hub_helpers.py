"""What the hub cache's tests share: a stand-in CDN serving a 4 MiB synthetic model
and a stand-in hub in front of it (module-scoped; each test gets the CDN's faults reset),
and readers of what a load asked of the CDN and recorded in its partial file."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_server import FileServer, HubServer, file_server

from aiogguf.remote._http_source import HEAD_BYTES
from aiogguf.remote._hub_cache import PARTIAL_SUFFIX, hub_cache_dir
from aiogguf.testing.synth import write_synthetic_model

__all__ = [
    "HEADER_AGAIN",
    "NAME",
    "SMALL",
    "cdn",
    "data_bytes",
    "hub",
    "recorded_ranges",
    "records",
    "served",
]

SMALL: dict[str, Any] = {"chunk_size": "256KiB", "remote_in_flight": 4}
NAME = "hf://own/repo/m.gguf"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FileServer]:
    root = tmp_path_factory.mktemp("served")
    write_synthetic_model(root / "m.gguf", size_bytes="4MiB", seed=3)
    with file_server(root) as server:
        yield server


@pytest.fixture
def cdn(served: FileServer) -> FileServer:
    served.faults.__init__()  # type: ignore[misc]
    return served


@pytest.fixture
def hub(cdn: FileServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer(cdn, {"own/repo/m.gguf": "m.gguf"}) as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{stand_in.port}")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield stand_in


def data_bytes(cdn: FileServer) -> int:
    """Bytes the CDN was asked for, by every ranged request (the size probes too)."""
    total = 0
    for seen in cdn.faults.headers:
        lo, _, hi = seen.get("Range", "bytes=0--1")[6:].partition("-")
        total += int(hi) + 1 - int(lo)
    return total


# The partial file's records: two slots after the file's end, written in turn.
SLOT_BYTES = 48 + (1 << 20)


def records(size: int) -> dict[int, dict[str, Any]]:
    """The partial file's records that check out, by their offset."""
    (partial,) = Path(hub_cache_dir()).glob(f"*/blobs/*{PARTIAL_SUFFIX}")
    found = {}
    with open(partial, "rb") as f:
        for at in (size, size + SLOT_BYTES):
            f.seek(at)
            head = f.read(48)
            if len(head) < 48:
                continue
            magic, length, check = struct.unpack("<8sQ32s", head)
            payload = f.read(length) if magic == b"AIOGGPR1" else b""
            if payload and hashlib.sha256(payload).digest() == check:
                found[at] = json.loads(payload)
    return found


def recorded_ranges(size: int) -> list[list[int]]:
    """The ranges the partial file's newest record vouches for."""
    found = records(size)
    assert found, "no record after the partial file's end"
    newest = max(found.values(), key=lambda r: int(r.get("seq", 0)))
    ranges: list[list[int]] = newest["ranges"]
    return ranges


# The header is read from the network again (a resumed load parses what the hub sends):
# the first request's bytes, and the header's growing reads past them, if any.
HEADER_AGAIN = max(HEAD_BYTES, 256 << 10)
