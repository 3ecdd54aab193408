"""The read and validate stages read a model's bytes through ``ByteSource`` only: a
source that is no local file (here bytes in memory, as a reader of HTTP ranges would
be) is read into a staging slot and checked with no change to either stage."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiogguf._jobs import ReadJob
from aiogguf.errors import LoadError
from aiogguf.io.ggml_types import ggml_type_by_name
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.read import Reader
from aiogguf.stages.validate import FileBytes, ValidationCollector


class _Memory:
    """A ``ByteSource`` of bytes in memory."""

    # What a load does with it (``ByteSource``): a source that is not this machine's
    # storage, with no page cache to bypass and nothing to map.
    direct_ok = False
    direct_refusal = None
    direct = None
    mappable = None
    local = False
    piece_bytes = None

    def __init__(self, data: bytes) -> None:
        self.path = "mem://model.gguf"
        self._data = data
        self.reads: list[tuple[int, int]] = []

    def disk(self) -> str:
        return "memory"

    def read_into(self, dest: Any, offset: int, *, max_call: int = 0) -> None:
        view = memoryview(dest).cast("B")
        if offset + len(view) > len(self._data):
            raise LoadError(self.path, offset, "source ended")
        view[:] = self._data[offset : offset + len(view)]
        self.reads.append((offset, len(view)))

    def check_unchanged(self) -> None:
        pass

    def close(self) -> None:
        pass


def _source(data: bytes) -> ByteSource:
    return _Memory(data)


def test_the_reader_fills_a_slot_from_any_source() -> None:
    data = bytes(range(256)) * 16
    source = _Memory(data)
    reader = Reader([_source(b""), source], [], clock=lambda: 0.0)
    job = ReadJob(
        seq=0,
        buffer_index=0,
        file_index=1,
        file_offset=1024,
        nbytes=2048,
        buffer_offset=0,
        useful_start=1024,
        useful_end=3072,
    )
    slot = bytearray(2048)
    reader.fill_slot(job, memoryview(slot))
    assert bytes(slot) == data[1024:3072]
    assert source.reads == [(1024, 2048)]
    assert reader.direct == [False, False]


@pytest.mark.asyncio
async def test_the_checks_read_a_tensor_from_any_source() -> None:
    good = np.arange(64, dtype=np.float32)
    bad = good.copy()
    bad[5] = np.nan
    source = _source(good.tobytes() + bad.tobytes())
    f32 = ggml_type_by_name("F32")
    async with LoadThreads(1) as threads, ValidationCollector(1, threads=threads) as collector:
        await collector.submit("good", f32, FileBytes(source, 0, good.nbytes))
        await collector.submit("bad", f32, FileBytes(source, good.nbytes, bad.nbytes))
    assert [f.name for f in collector.failures] == ["bad"]
