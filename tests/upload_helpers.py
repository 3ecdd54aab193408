"""Helpers shared by the upload tests (sim, fake CuPy, real GPU): random jobs that tile
device buffers, fills that write known bytes, an uploader with its own threads, exact
checks."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiogguf._config import Config
from aiogguf._jobs import ReadJob, SlotFill
from aiogguf.io._devices.arena import device_arenas
from aiogguf.io._devices.base import Device, DeviceBuffer
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.upload import DeviceUploadStats, Uploader

KiB = 1024


def copy_threads() -> set[threading.Thread]:
    """The simulated copy-engine threads alive now (anyio's idle worker threads are
    not ours to count)."""
    return {t for t in threading.enumerate() if t.name.startswith("aiogguf-sim-copy")}


def buffers_in_use(device: Any) -> int:
    """Device allocations of a simulated device that a load or a model still holds:
    those its arena does not keep idle for the next load."""
    idle = sum(a.stats().idle_blocks for a in device_arenas() if a.target is device)
    live: int = device.live.buffers
    return live - idle


def ring_config(slots: int, staging_bytes: int, pool_bytes: int | None = None) -> Config:
    """``slots`` staging slots per transfer thread of ``staging_bytes`` each."""
    return Config().with_overrides(
        staging_buffers=slots,
        staging_buffer_size=staging_bytes,
        staging_pool_size=pool_bytes,
        alignment=4096,
    )


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


def fill_from(targets: Sequence[Target]) -> SlotFill:
    """A fill that writes each job's bytes of its target (``buffer_index`` = position)."""

    def fill(job: ReadJob, view: memoryview) -> None:
        assert view.nbytes == job.nbytes
        payload = targets[job.buffer_index].payload
        view[:] = payload[job.buffer_offset : job.buffer_offset + job.nbytes]

    return fill


@contextlib.asynccontextmanager
async def open_uploader(
    devices: Mapping[str, Device], config: Config, threads: int = 2, **kwargs: Any
) -> AsyncIterator[Uploader]:
    """An entered ``Uploader`` with ``threads`` transfer threads of its own."""
    async with (
        LoadThreads(threads, name="test-transfer") as pool,
        Uploader(devices, config, threads=pool, **kwargs) as up,
    ):
        yield up


async def upload_all(
    up: Uploader, targets: Sequence[Target], rng: random.Random
) -> list[DeviceBuffer]:
    """Allocate every buffer, then transfer all jobs, in random order."""
    buffers = [await up.allocate(t.device, t.payload.nbytes) for t in targets]
    work = [(job, buf) for t, buf in zip(targets, buffers, strict=True) for job in t.jobs]
    rng.shuffle(work)
    await up.transfer(work, fill_from(targets))
    return buffers


def stats_by_device(up: Uploader) -> dict[str, DeviceUploadStats]:
    return {s.device: s for s in up.stats}


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


@contextlib.contextmanager
def cupy_stand_in_backend() -> Iterator[Any]:
    """The CuPy backend over ``stand_ins/cupy`` (CuPy's names on host memory) for the
    length of the block; yields the stand-in module. A patch of its own: a test's
    ``monkeypatch.undo()`` must not undo it."""
    import pytest
    from stand_ins import cupy_stand_in

    import aiogguf
    from aiogguf.io._devices import cupy_backend

    stand_in = cupy_stand_in()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cupy_backend, "import_cupy", lambda: stand_in)
        cupy_backend.forget_cupy_devices()
        try:
            yield stand_in
        finally:
            aiogguf.release_staging_sync()  # its pool holds the stand-in's slots
            cupy_backend.forget_cupy_devices()
