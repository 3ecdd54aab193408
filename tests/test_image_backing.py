"""A host image's pages are backed a ``BACK_BYTES`` unit at a time, each unit once, and
no read lands in a unit before it is backed."""

from __future__ import annotations

import threading
from typing import cast

import pytest

from aiogguf.images import BACK_BYTES, HostImage
from aiogguf.io.buffers import HostBuffer
from aiogguf.io.workers import StopLink, Stopped
from aiogguf.jobs import BufferLayout, ReadJob

MiB = 1 << 20


class _Recording:
    """A buffer that records the ranges it is asked to back."""

    def __init__(self, nbytes: int = 64 * BACK_BYTES) -> None:
        self.nbytes = nbytes
        self.ranges: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def populate(self, start: int, end: int) -> None:
        with self._lock:
            self.ranges.append((start, end))


class _Held(_Recording):
    """Backing the first unit waits until ``go`` is set."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
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


def _start(fn: object, *args: object) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
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


def test_a_job_whose_unit_is_being_backed_backs_the_next_unit_then_waits() -> None:
    buffer = _Held(3 * BACK_BYTES)
    image, _ = _image(buffer)
    first = _start(image.back, _job(0, 0, 64 * MiB))
    assert buffer.holding.wait(10)
    second = _start(image.back, _job(1, 64 * MiB, 64 * MiB))
    second.join(0.3)
    # It backed the unit after (its next jobs' pages), and did not go on to read into
    # pages that are not backed yet.
    assert (BACK_BYTES, 2 * BACK_BYTES) in buffer.ranges
    assert second.is_alive()
    buffer.go.set()
    first.join(10)
    second.join(10)
    assert not second.is_alive()
    # The last unit: one look ahead per wait, and the next job finds its unit backed.
    image.back(_job(2, 2 * BACK_BYTES, 64 * MiB))
    assert sorted(buffer.ranges) == [(u * BACK_BYTES, (u + 1) * BACK_BYTES) for u in range(3)]


def test_the_last_unit_has_none_after_it_to_back() -> None:
    buffer = _Held(BACK_BYTES)
    image, _ = _image(buffer)
    first = _start(image.back, _job(0, 0, 64 * MiB))
    assert buffer.holding.wait(10)
    second = _start(image.back, _job(1, 64 * MiB, 64 * MiB))
    second.join(0.2)
    assert buffer.ranges == [(0, BACK_BYTES)]
    buffer.go.set()
    for thread in (first, second):
        thread.join(10)
        assert not thread.is_alive()


def test_a_wait_for_another_readers_unit_stops_with_the_load() -> None:
    buffer = _Held(2 * BACK_BYTES)
    image, _ = _image(buffer)
    first = _start(image.back, _job(0, 0, 64 * MiB))
    assert buffer.holding.wait(10)
    stop = threading.Event()
    raised: list[BaseException] = []

    def waiter() -> None:
        try:
            StopLink(stop.is_set).run(lambda: image.back(_job(1, 64 * MiB, 64 * MiB)))
        except BaseException as exc:
            raised.append(exc)

    second = _start(waiter)
    second.join(0.2)
    assert second.is_alive()
    stop.set()
    second.join(1.0)  # within a second of the stop
    assert not second.is_alive()
    assert len(raised) == 1
    assert isinstance(raised[0], Stopped)
    buffer.go.set()
    first.join(10)


def test_a_backer_that_stops_lets_the_others_read() -> None:
    image, buffer = _image()
    with pytest.raises(Stopped):
        StopLink(lambda: True).run(lambda: image.back(_job(0, 0, 64 * MiB)))
    assert buffer.ranges == []
    done = _start(image.back, _job(1, 64 * MiB, 64 * MiB))
    done.join(10)
    assert not done.is_alive()  # its reads fault the unit in: nobody will back it now
