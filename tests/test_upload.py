"""The upload stage on simulated GPUs: exact bytes through the staging ring with random
copy delays, the broken ring caught, cancellation that leaves nothing behind, and the
synchronous fallback."""

from __future__ import annotations

import random
import time

import anyio
import anyio.abc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from upload_helpers import (
    Target,
    assert_exact,
    copy_threads,
    filler,
    plan_targets,
    ring_config,
    upload_all,
)

from aiogguf.errors import LoadError
from aiogguf.io.devices.base import Device, DeviceBuffer
from aiogguf.io.devices.cpu import CpuDevice
from aiogguf.io.devices.sim import (
    RingViolation,
    SimDevice,
    SimDeviceBuffer,
    SimStagingSlot,
    SimUsage,
)
from aiogguf.jobs import ReadJob
from aiogguf.stages.upload import Uploader, UploaderState

KiB = 1024
IDLE = SimUsage(0, 0, 0, 0)


# --- 1. exact bytes through the ring, two devices, random delays ---------------------------


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    slots=st.sampled_from([1, 2, 4]),
    staging_kib=st.sampled_from([4, 8, 16]),
    bandwidth=st.sampled_from([None, 20_000_000, 100_000_000]),
    max_delay_ms=st.sampled_from([0.0, 0.5, 2.0]),
    writers=st.integers(1, 5),
    sizes=st.lists(st.integers(1, 48 * KiB), min_size=1, max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_two_devices_get_exact_bytes(
    slots: int,
    staging_kib: int,
    bandwidth: int | None,
    max_delay_ms: float,
    writers: int,
    sizes: list[int],
    seed: int,
) -> None:
    rng = random.Random(seed)
    sims = [
        SimDevice(name, bandwidth=bandwidth, max_delay_ms=max_delay_ms, seed=seed + i)
        for i, name in enumerate(("g0", "g1"))
    ]
    devices: dict[str, Device] = {"CPU": CpuDevice(), **{d.name: d for d in sims}}
    config = ring_config(slots, staging_kib * KiB)
    targets = plan_targets(rng, ["g0", "g1"], sizes, staging_kib * KiB)
    threads_before = copy_threads()

    async def main() -> None:
        async with Uploader(devices, config, "none") as up:
            assert up.staging_bytes == staging_kib * KiB
            buffers = await upload_all(up, targets, rng, writers)
            assert len(copy_threads() - threads_before) == len(up.stats)
            await up.drain()
            assert_exact(targets, buffers)
            stats = up.stats
            for name in stats:
                jobs = [j for t in targets if t.device == name for j in t.jobs]
                assert stats[name].copies == len(jobs)
                assert stats[name].bytes_copied == sum(j.nbytes for j in jobs)
                assert stats[name].asynchronous
                assert stats[name].slots == slots
        # Ownership passed to us: the buffers are still there until we close them.
        assert sum(d.live.buffers for d in sims) == len(targets)
        assert_exact(targets, buffers)
        for buf in buffers:
            buf.close()

    anyio.run(main)
    assert all(d.live == IDLE for d in sims)
    assert copy_threads() == threads_before


@pytest.mark.asyncio
async def test_waits_sit_before_slot_reuse_and_never_block_the_loop() -> None:
    # 40 KiB per copy at 100 KB/s: every copy takes ~400 ms and, with one slot, every
    # write after the first must wait for the previous copy. The loop keeps ticking.
    sim = SimDevice("g0", bandwidth=100_000)
    config = ring_config(1, 40 * KiB)
    payload = np.frombuffer(random.Random(3).randbytes(120 * KiB), np.uint8)
    jobs = [ReadJob(i, 0, 0, i * 40 * KiB, 40 * KiB, i * 40 * KiB, 0, 0) for i in range(3)]
    lags: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.002)
            lags.append(time.perf_counter() - start - 0.002)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with Uploader({"g0": sim}, config, "none") as up:
            buf = await up.allocate("g0", payload.nbytes)
            durations = []
            for job in jobs:
                start = time.perf_counter()
                await up.write(job, buf, filler(payload, job))
                durations.append(time.perf_counter() - start)
            # write() returns once its copy is issued, without waiting for it: the first
            # one is quick though its copy takes 400 ms; the others wait for the slot.
            assert durations[0] < 0.3
            assert not up._rings["g0"].events[0].query()
            await up.drain("g0")
            assert up._rings["g0"].events[0].query()
            assert bytes(buf.to_host(0, buf.nbytes)) == payload.tobytes()
            stats = up.stats["g0"]
            assert stats.slot_waits == 2
            assert stats.wait_s > 0.5
        done.set()
    buf.close()
    # A wait on the loop would hold it for ~400 ms; allow for a busy test machine.
    assert max(lags) < 0.2, f"event loop held for {max(lags):.3f} s"


# --- 2. the broken ring is caught ----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("skip_begin_write", [False, True])
async def test_broken_ring_is_caught_by_the_sim_device(
    skip_begin_write: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if skip_begin_write:
        # Only the copy engine's checksum is left to notice the overwrite.
        monkeypatch.setattr(SimStagingSlot, "begin_write", lambda self: None)
    # 8 KiB = 400 ms per copy: the second write surely lands while the first copy runs.
    sim = SimDevice("g1", bandwidth=20_000)
    config = ring_config(1, 8 * KiB)
    job0 = ReadJob(0, 0, 0, 0, 8 * KiB, 0, 0, 8 * KiB)
    job1 = ReadJob(1, 0, 0, 8 * KiB, 8 * KiB, 8 * KiB, 0, 0)

    allocated: list[DeviceBuffer] = []

    async def scenario() -> None:
        async with Uploader({"g1": sim}, config, "none", _unsafe_skip_slot_wait=True) as up:
            buf = await up.allocate("g1", 16 * KiB)
            allocated.append(buf)
            await up.write(job0, buf, lambda v: v.__setitem__(slice(None), b"\x01" * v.nbytes))
            await up.write(job1, buf, lambda v: v.__setitem__(slice(None), b"\x02" * v.nbytes))
            await up.drain()

    with pytest.raises(RingViolation, match=r"device g1: staging slot 0: ") as caught:
        await scenario()
    expected = "overwritten" if skip_begin_write else "written while copy #1"
    assert expected in str(caught.value)
    # The load failed: the uploader freed the buffer it had handed out.
    assert [b.closed for b in allocated if isinstance(b, SimDeviceBuffer)] == [True]
    assert sim.live == IDLE


@pytest.mark.asyncio
async def test_same_ring_with_waits_passes() -> None:
    sim = SimDevice("g1", bandwidth=20_000)
    config = ring_config(1, 8 * KiB)
    async with Uploader({"g1": sim}, config, "none") as up:
        buf = await up.allocate("g1", 16 * KiB)
        for i in range(2):
            job = ReadJob(i, 0, 0, 0, 8 * KiB, i * 8 * KiB, 0, 0)
            await up.write(
                job, buf, lambda v, i=i: v.__setitem__(slice(None), bytes([i]) * v.nbytes)
            )
    assert bytes(buf.to_host(0, 16 * KiB)) == b"\x00" * 8 * KiB + b"\x01" * 8 * KiB
    assert up.stats["g1"].slot_waits == 1
    buf.close()


# --- 3. cancellation releases everything -------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_cancel_at_random_points_releases_everything(seed: int) -> None:
    rng = random.Random(seed)
    sims = [SimDevice(n, bandwidth=50_000_000, max_delay_ms=1.0, seed=seed) for n in ("g0", "g1")]
    devices: dict[str, Device] = {d.name: d for d in sims}
    config = ring_config(rng.choice([1, 2, 4]), 4 * KiB)
    targets = plan_targets(rng, ["g0", "g1"], [rng.randint(1, 40 * KiB) for _ in range(4)], 4 * KiB)
    n_jobs = sum(len(t.jobs) for t in targets)
    cancel_after = rng.randint(0, n_jobs)  # completed writes, or a timer below
    threads_before = copy_threads()

    async def main() -> None:
        with anyio.CancelScope() as scope:
            if rng.random() < 0.3:
                scope.deadline = anyio.current_time() + rng.uniform(0.0, 0.02)
            async with Uploader(devices, config, "direct") as up:
                buffers = [await up.allocate(t.device, t.payload.nbytes) for t in targets]
                written = 0
                async with anyio.create_task_group() as tg:

                    async def run(t: Target, buf: DeviceBuffer) -> None:
                        nonlocal written
                        for job in t.jobs:
                            await up.write(job, buf, filler(t.payload, job))
                            written += 1
                            if written >= cancel_after:
                                scope.cancel()

                    for t, buf in zip(targets, buffers, strict=True):
                        tg.start_soon(run, t, buf)
                    if cancel_after == 0:
                        scope.cancel()
            # Only reached when every write finished before the cancel took effect.
            for buf in buffers:
                buf.close()
        assert up.state is UploaderState.CLOSED

    anyio.run(main)
    assert all(d.live == IDLE for d in sims), [d.live for d in sims]
    assert copy_threads() == threads_before


@pytest.mark.asyncio
async def test_failed_fill_frees_buffers_and_slots() -> None:
    sim = SimDevice("g0", max_delay_ms=1.0)
    config = ring_config(2, 4 * KiB)

    def bad_fill(view: memoryview) -> None:
        raise LoadError("model.gguf", 4096, "short read")

    job0 = ReadJob(0, 0, 0, 0, 4 * KiB, 0, 0, 0)
    job1 = ReadJob(1, 0, 0, 4096, 4 * KiB, 4 * KiB, 0, 0)

    async def scenario() -> None:
        async with Uploader({"g0": sim}, config, "none") as up:
            buf = await up.allocate("g0", 8 * KiB)
            await up.write(job0, buf, filler(np.zeros(8 * KiB, np.uint8), job0))
            await up.write(job1, buf, bad_fill)

    with pytest.raises(LoadError, match="short read"):
        await scenario()
    assert sim.live == IDLE


@pytest.mark.asyncio
async def test_fill_that_keeps_a_view_is_an_error() -> None:
    sim = SimDevice("g0")
    kept: list[np.ndarray] = []

    async def scenario() -> None:
        async with Uploader({"g0": sim}, ring_config(1, 4 * KiB), "none") as up:
            buf = await up.allocate("g0", 4 * KiB)
            job = ReadJob(0, 0, 0, 0, 4 * KiB, 0, 0, 0)
            await up.write(job, buf, lambda v: kept.append(np.frombuffer(v, np.uint8)))

    # The body succeeded, so the failure surfaces at exit, and the load counts as failed.
    with pytest.raises(LoadError, match="staging slot 0 is still referenced after its last use"):
        await scenario()
    kept.clear()
    assert sim.live.buffers == 0


# --- 4. synchronous fallback ---------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("missing", ["async_copies", "events", "pinned_host"])
async def test_devices_without_async_copies_get_synchronous_copies(missing: str) -> None:
    sim = SimDevice("g0", bandwidth=50_000_000, **{missing: False})  # type: ignore[arg-type]
    rng = random.Random(7)
    targets = plan_targets(rng, ["g0"], [30 * KiB, 5 * KiB], 4 * KiB)
    threads_before = copy_threads()
    async with Uploader({"g0": sim}, ring_config(2, 4 * KiB), "none") as up:
        buffers = await upload_all(up, targets, rng, writers=3)
        # No copy engine thread: every copy was done by the time write() returned.
        assert copy_threads() == threads_before
        assert_exact(targets, buffers)
        assert not up.stats["g0"].asynchronous
        assert up.stats["g0"].copies == sum(len(t.jobs) for t in targets)
    for buf in buffers:
        buf.close()
    assert sim.live == IDLE


# --- misuse --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_misuse_is_refused() -> None:
    sim = SimDevice("g0", free=64 * KiB)
    devices: dict[str, Device] = {"CPU": CpuDevice(), "g0": sim}
    up = Uploader(devices, ring_config(2, 4 * KiB), "none")
    with pytest.raises(RuntimeError, match="inside 'async with'"):
        await up.allocate("g0", 1)
    async with up:
        with pytest.raises(ValueError, match="does not take uploads"):
            await up.allocate("CPU", 1)
        with pytest.raises(ValueError, match="no device named 'g9'"):
            await up.allocate("g9", 1)
        with pytest.raises(LoadError, match="out of memory"):
            await up.allocate("g0", 65 * KiB)
        buf = await up.allocate("g0", 8 * KiB)
        with pytest.raises(ValueError, match="> staging slot size"):
            await up.write(ReadJob(0, 0, 0, 0, 4 * KiB + 1, 0, 0, 0), buf, lambda v: None)
        with pytest.raises(ValueError, match="outside the 8192-byte buffer on g0"):
            await up.write(ReadJob(0, 0, 0, 0, 4 * KiB, 6 * KiB, 0, 0), buf, lambda v: None)
    with pytest.raises(RuntimeError, match="closed"):
        await up.write(ReadJob(0, 0, 0, 0, 1, 0, 0, 0), buf, lambda v: None)
    buf.close()
    assert sim.live == IDLE
