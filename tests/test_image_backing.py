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


# --- which reader reads which unit (stages/read.py's _Feed) --------------------------------


def _feed(jobs: list[ReadJob], readers: int = 2) -> Any:
    from aiogguf.stages.read import _Feed

    return _Feed(jobs, readers)


def test_a_reader_reads_a_whole_unit_before_the_next() -> None:
    """Handed out job by job, two readers met in every unit: one backed it while the
    other read into it, faulting its pages in one by one. Each takes a unit's jobs in a
    row now, and two readers start in two units."""
    jobs = [_job(i, i * 64 * MiB, 64 * MiB) for i in range(12)]  # 3 units of 4 jobs
    feed = _feed(jobs)
    a: list[Any] = []
    b: list[Any] = []
    order = [(name, feed.get(run)) for name, run in [("a", a), ("b", b)] * 3]
    assert [(name, job.seq) for name, job in order] == [
        ("a", 0),
        ("b", 4),
        ("a", 1),
        ("b", 5),
        ("a", 2),
        ("b", 6),
    ]


def test_a_reader_with_no_unit_left_takes_the_last_job_of_the_longest_run() -> None:
    jobs = [_job(i, i * 64 * MiB, 64 * MiB) for i in range(8)]  # 2 units of 4 jobs
    feed = _feed(jobs)
    a: list[Any] = []
    b: list[Any] = []
    assert feed.get(a).seq == 0
    assert feed.get(b).seq == 4
    assert [feed.get(b).seq for _ in range(3)] == [5, 6, 7]
    # b's unit is done and no unit is left: it takes from the end of a's.
    assert feed.get(b).seq == 3
    assert feed.get(a).seq == 1
    assert feed.get(b).seq == 2
    assert feed.get(a) is None
    assert feed.get(b) is None
    assert feed.leave() is False
    assert feed.leave() is True


def test_a_stopped_feed_hands_out_nothing() -> None:
    feed = _feed([_job(i, i * MiB, MiB) for i in range(4)])
    run: list[Any] = []
    assert feed.get(run).seq == 0
    feed.stop()
    assert feed.get(run) is None


def test_every_job_is_handed_out_once_to_readers_at_once() -> None:
    jobs = [_job(i, i * 16 * MiB, 16 * MiB) for i in range(64)]  # 4 units
    feed = _feed(jobs, readers=8)
    got: list[list[int]] = [[] for _ in range(8)]
    barrier = threading.Barrier(8)

    def reader(mine: list[int]) -> None:
        run: list[Any] = []
        barrier.wait()
        while (job := feed.get(run)) is not None:
            mine.append(job.seq)

    threads = [threading.Thread(target=reader, args=(g,)) for g in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(s for g in got for s in g) == list(range(64))
