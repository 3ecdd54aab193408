"""A host image's pages are backed a ``BACK_BYTES`` unit at a time, each unit once; a
read into a unit another reader is still backing goes in short calls."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
from test_load_bytes import assert_same_bytes

import aiogguf
from aiogguf._images import BACK_BYTES, HostImage
from aiogguf._jobs import BufferLayout, ReadJob
from aiogguf.io.buffers import HostBuffer
from aiogguf.io.workers import StopLink, Stopped
from aiogguf.stages.read import FAULTING_CALL_BYTES
from aiogguf.testing.synth import write_synthetic_model

MiB = 1 << 20


class _Recording:
    """A buffer that records the ranges it is asked to back."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def populate(self, start: int, end: int) -> None:
        with self._lock:
            self.ranges.append((start, end))


class _Held(_Recording):
    """Backing the first unit waits until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = threading.Event()
        self.go = threading.Event()

    def populate(self, start: int, end: int) -> None:
        super().populate(start, end)
        if start == 0:
            self.holding.set()
            assert self.go.wait(10)


def _job(seq: int, offset: int, nbytes: int) -> ReadJob:
    return ReadJob(seq, 0, 0, offset, nbytes, offset, offset, offset + nbytes)


def _image(buffer: _Recording | None = None) -> tuple[HostImage, _Recording]:
    buffer = buffer or _Recording()
    return HostImage(cast(BufferLayout, None), cast(HostBuffer, buffer)), buffer


def _start(fn: Callable[..., object], *args: object) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


def test_each_unit_is_backed_once_by_the_first_job_that_reaches_it() -> None:
    image, buffer = _image()
    jobs = [_job(i, i * 64 * MiB, 64 * MiB) for i in range(9)]  # 576 MiB
    for job in jobs:
        image.back(job)
    assert buffer.ranges == [
        (0, BACK_BYTES),
        (BACK_BYTES, 2 * BACK_BYTES),
        (2 * BACK_BYTES, 3 * BACK_BYTES),
    ]


def test_a_job_across_units_backs_every_unit_it_reaches() -> None:
    image, buffer = _image()
    image.back(_job(0, BACK_BYTES - MiB, 2 * MiB))
    assert buffer.ranges == [(0, BACK_BYTES), (BACK_BYTES, 2 * BACK_BYTES)]
    image.back(_job(1, 0, MiB))
    image.back(_job(2, 2 * BACK_BYTES - 1, 1))
    assert len(buffer.ranges) == 2


def test_readers_at_once_back_each_unit_once() -> None:
    image, buffer = _image()
    jobs = [_job(i, i * 16 * MiB, 16 * MiB) for i in range(64)]  # 4 units
    barrier = threading.Barrier(8)

    def reader(mine: list[ReadJob]) -> None:
        barrier.wait()
        for job in mine:
            image.back(job)

    threads = [threading.Thread(target=reader, args=(jobs[k::8],)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(buffer.ranges) == [(u * BACK_BYTES, (u + 1) * BACK_BYTES) for u in range(4)]


def test_backing_a_real_buffer_keeps_what_landed_before() -> None:
    with HostBuffer(8 * MiB) as buffer:
        image = HostImage(cast(BufferLayout, None), buffer)
        buffer.memoryview[5 * MiB] = 9
        image.back(_job(0, 0, MiB))  # backs the unit, clipped to the buffer
        image.back(_job(1, 4 * MiB, 4 * MiB))
        assert buffer.memoryview[5 * MiB] == 9
        assert int(buffer.as_array().sum()) == 9


def test_a_job_whose_unit_another_reader_is_backing_is_told_its_pages_are_not_backed() -> None:
    buffer = _Held()
    image, _ = _image(buffer)
    first = _start(image.back, _job(0, 0, 64 * MiB))
    assert buffer.holding.wait(10)
    # No wait for the other reader: its read faults its pages in (in short calls).
    assert image.back(_job(1, 64 * MiB, 64 * MiB)) is False
    assert buffer.ranges == [(0, BACK_BYTES)]
    # Across the unit being backed and the next: the next is backed, the job is not.
    assert image.back(_job(2, BACK_BYTES - 32 * MiB, 64 * MiB)) is False
    assert buffer.ranges == [(0, BACK_BYTES), (BACK_BYTES, 2 * BACK_BYTES)]
    buffer.go.set()
    first.join(10)
    assert not first.is_alive()
    assert image.back(_job(3, 128 * MiB, 64 * MiB)) is True  # its unit is backed now
    assert image.back(_job(4, 2 * BACK_BYTES, MiB)) is True  # backed by this call
    assert len(buffer.ranges) == 3


def test_a_unit_whose_backer_stopped_is_never_backed() -> None:
    image, buffer = _image()
    with pytest.raises(Stopped):
        StopLink(lambda: True).run(lambda: image.back(_job(0, 0, 64 * MiB)))
    assert image.back(_job(1, 64 * MiB, 64 * MiB)) is False
    assert buffer.ranges == []


@pytest.mark.parametrize("check_tensors", [False, True])
@pytest.mark.parametrize("backed", [False, True])
def test_a_read_into_pages_not_backed_goes_in_short_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_tensors: bool, backed: bool
) -> None:
    """Every job of the load finds its unit still being backed (``backed`` False): each
    read call that lands in the image is at most ``FAULTING_CALL_BYTES``, and every byte
    still lands. Backed, a job is read in calls as large as it is."""
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes=48 * MiB, seed=3)
    calls: list[int] = []
    preadv = os.preadv

    def read(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if threading.current_thread().name.startswith("aiogguf-reader"):
            calls.append(sum(memoryview(b).nbytes for b in buffers))
        return preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", read)
    monkeypatch.setattr(HostImage, "back", lambda self, job: backed)
    with aiogguf.load_sync(
        model.path, mode="none", n_gpu_layers=0, check_tensors=check_tensors, readers=1
    ) as loaded:
        assert_same_bytes(loaded, [model.path])
    assert sum(calls) >= loaded.report.nbytes
    assert (max(calls) <= FAULTING_CALL_BYTES) is not backed
