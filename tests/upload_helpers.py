"""Helpers shared by the upload tests (sim, fake CuPy, real GPU): random jobs that tile
device buffers, fills that write known bytes, concurrent writers, exact checks."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import anyio.abc
import numpy as np

from aiogguf.config import Config
from aiogguf.io.devices.base import DeviceBuffer
from aiogguf.jobs import ReadJob
from aiogguf.stages.upload import Uploader

KiB = 1024


def copy_threads() -> set[threading.Thread]:
    """The simulated copy-engine threads alive now (anyio's idle worker threads are
    not ours to count)."""
    return {t for t in threading.enumerate() if t.name.startswith("aiogguf-sim-copy")}


def ring_config(slots: int, staging_bytes: int) -> Config:
    return Config().with_overrides(staging_buffers=slots, staging_buffer_size=staging_bytes)


@dataclass
class Target:
    """One device buffer to fill and the bytes it must end up holding."""

    device: str
    payload: np.ndarray  # uint8
    jobs: list[ReadJob]


def plan_targets(
    rng: random.Random, devices: Sequence[str], sizes: Sequence[int], max_job: int
) -> list[Target]:
    """Buffers of ``sizes`` spread over ``devices``, each cut into jobs of random size
    (at most ``max_job``) that tile it exactly."""
    targets = []
    seq = 0
    for i, size in enumerate(sizes):
        payload = np.frombuffer(rng.randbytes(size), np.uint8)
        jobs = []
        offset = 0
        while offset < size:
            n = min(rng.randint(1, max_job), size - offset)
            jobs.append(ReadJob(seq, i, 0, 10_000 + offset, n, offset, offset, offset + n))
            seq += 1
            offset += n
        targets.append(Target(devices[i % len(devices)], payload, jobs))
    return targets


def filler(payload: np.ndarray, job: ReadJob) -> Callable[[memoryview], None]:
    def fill(view: memoryview) -> None:
        assert view.nbytes == job.nbytes
        view[:] = payload[job.buffer_offset : job.buffer_offset + job.nbytes]

    return fill


async def upload_all(
    up: Uploader,
    targets: Sequence[Target],
    rng: random.Random,
    writers: int,
) -> list[DeviceBuffer]:
    """Allocate every buffer, then write all jobs in random order from ``writers``
    concurrent tasks."""
    buffers = [await up.allocate(t.device, t.payload.nbytes) for t in targets]
    work = [(t, buf, job) for t, buf in zip(targets, buffers, strict=True) for job in t.jobs]
    rng.shuffle(work)
    send, receive = anyio.create_memory_object_stream[tuple[Target, DeviceBuffer, ReadJob]](
        len(work)
    )
    async with send:
        for item in work:
            send.send_nowait(item)

    async def writer(
        jobs: anyio.abc.ObjectReceiveStream[tuple[Target, DeviceBuffer, ReadJob]],
    ) -> None:
        async with jobs:
            async for t, buf, job in jobs:
                await up.write(job, buf, filler(t.payload, job))

    async with receive, anyio.create_task_group() as tg:
        for _ in range(writers):
            tg.start_soon(writer, receive.clone())
    return buffers


def host_array(buf: DeviceBuffer, offset: int, nbytes: int) -> np.ndarray:
    """``buf.array(offset, nbytes)`` as a numpy array: a device view (CuPy) is copied
    back with ``xp.asnumpy``, since numpy refuses to convert a CuPy array implicitly."""
    array = buf.array(offset, nbytes)
    if isinstance(array, np.ndarray):
        return array
    host: np.ndarray = buf.xp.asnumpy(array)
    return host


def assert_exact(targets: Sequence[Target], buffers: Sequence[DeviceBuffer]) -> None:
    for t, buf in zip(targets, buffers, strict=True):
        assert bytes(buf.to_host(0, buf.nbytes)) == t.payload.tobytes()
        assert np.array_equal(host_array(buf, 0, buf.nbytes), t.payload)
