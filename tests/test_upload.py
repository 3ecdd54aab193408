"""The upload stage on simulated GPUs: exact bytes through the staging slots with random
copy delays, the broken ring caught, slots leased from the device's pool and given back,
cancellation that leaves nothing behind, and the synchronous fallback."""

from __future__ import annotations

import random
import threading

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from upload_helpers import (
    Target,
    assert_exact,
    buffers_in_use,
    copy_threads,
    fill_from,
    open_uploader,
    plan_targets,
    ring_config,
    stats_by_device,
    upload_all,
)

from aiogguf._jobs import ReadJob
from aiogguf.errors import LoadError
from aiogguf.io._devices.base import Device, DeviceBuffer
from aiogguf.io._devices.cpu import CpuDevice
from aiogguf.io._devices.pool import close_staging_pools, staging_pool
from aiogguf.io._devices.sim import (
    RingViolation,
    SimDevice,
    SimDeviceBuffer,
    SimEvent,
    SimStagingSlot,
    SimUsage,
)
from aiogguf.stages.upload import UploaderState

KiB = 1024
IDLE = SimUsage(0, 0, 0, 0)


def _fill_byte(value: int) -> object:
    def fill(job: ReadJob, view: memoryview) -> None:
        view[:] = bytes([value]) * view.nbytes

    return fill


def _no_leases(*sims: SimDevice) -> bool:
    return all(staging_pool(s).stats().leased_slots == 0 for s in sims)


# --- 1. exact bytes, two devices, random delays ---------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    slots=st.sampled_from([1, 2, 4]),
    staging_kib=st.sampled_from([4, 8, 16]),
    bandwidth=st.sampled_from([None, 20_000_000, 100_000_000]),
    max_delay_ms=st.sampled_from([0.0, 0.5, 2.0]),
    threads=st.integers(1, 5),
    sizes=st.lists(st.integers(1, 48 * KiB), min_size=1, max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_two_devices_get_exact_bytes(
    slots: int,
    staging_kib: int,
    bandwidth: int | None,
    max_delay_ms: float,
    threads: int,
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
        async with open_uploader(devices, config, threads) as up:
            assert up.slot_bytes == staging_kib * KiB
            buffers = await upload_all(up, targets, rng)
            # transfer() returns once every copy has completed: no stream is left.
            assert copy_threads() == threads_before
            assert_exact(targets, buffers)
            stats = stats_by_device(up)
            for name, found in stats.items():
                jobs = [j for t in targets if t.device == name for j in t.jobs]
                assert found.copies == len(jobs)
                assert found.bytes_copied == sum(j.nbytes for j in jobs)
                assert found.asynchronous
                # Each thread that met the device leased its slots: pinned, or given back
                # by a thread that had already run out of jobs.
                assert found.slots % slots == 0
                assert 1 <= found.slots <= slots * threads
                assert 0 < found.pinned_bytes_allocated <= found.slots * found.slot_bytes
        # Ownership passed to us: the buffers are still there until we close them.
        assert sum(d.live.buffers for d in sims) == len(targets)
        assert_exact(targets, buffers)
        for buf in buffers:
            buf.close()

    anyio.run(main)
    assert _no_leases(*sims)
    close_staging_pools()
    assert all(d.live == IDLE for d in sims)


@pytest.mark.asyncio
async def test_waits_sit_before_slot_reuse_and_never_block_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 40 KiB per copy at 400 KB/s: every copy takes ~100 ms (filling a slot takes
    # microseconds) and, with one slot, every job after the first must wait for the
    # previous copy: on a transfer thread.
    sim = SimDevice("g0", bandwidth=400_000)
    config = ring_config(1, 40 * KiB)
    payload = np.frombuffer(random.Random(3).randbytes(120 * KiB), np.uint8)
    jobs = [ReadJob(i, 0, 0, i * 40 * KiB, 40 * KiB, i * 40 * KiB, 0, 0) for i in range(3)]
    target = Target("g0", payload, jobs)
    landed: list[int] = []
    waiters: list[threading.Thread] = []
    names: list[str] = []  # at the time of the wait: pooled threads are renamed after
    synchronize = SimEvent.synchronize

    def recorded(event: SimEvent) -> None:
        waiters.append(threading.current_thread())
        names.append(threading.current_thread().name)
        synchronize(event)

    monkeypatch.setattr(SimEvent, "synchronize", recorded)
    async with open_uploader({"g0": sim}, config, threads=1) as up:
        buf = await up.allocate("g0", payload.nbytes)
        await up.transfer(
            [(job, buf) for job in jobs],
            fill_from([target]),
            landed=lambda job: landed.append(job.seq),
        )
        # Every copy completed before transfer() returned.
        assert bytes(buf.to_host(0, buf.nbytes)) == payload.tobytes()
        stats = stats_by_device(up)["g0"]
        assert stats.slots == 1
        assert stats.slot_waits == 2
    buf.close()
    assert landed == [0, 1, 2]  # told on the loop, job by job
    assert len(waiters) == 2
    assert threading.current_thread() not in waiters
    assert {name.rsplit("-", 1)[0] for name in names} == {"test-transfer"}


@pytest.mark.asyncio
async def test_a_thread_fills_one_slot_while_the_other_is_copied() -> None:
    sim = SimDevice("g0", bandwidth=100_000)  # 8 KiB: 80 ms per copy
    config = ring_config(2, 8 * KiB)
    payload = np.zeros(24 * KiB, np.uint8)
    jobs = [ReadJob(i, 0, 0, i * 8 * KiB, 8 * KiB, i * 8 * KiB, 0, 0) for i in range(3)]
    async with open_uploader({"g0": sim}, config, threads=1) as up:
        buf = await up.allocate("g0", payload.nbytes)
        await up.transfer([(j, buf) for j in jobs], fill_from([Target("g0", payload, jobs)]))
        stats = stats_by_device(up)["g0"]
    buf.close()
    # Job 1 went to the second slot at once; job 2 had to wait for slot 0's copy.
    assert (stats.slots, stats.slot_waits) == (2, 1)
    assert stats.pinned_bytes_allocated == 2 * 8 * KiB


# --- 2. the pool: a second load pins nothing, loads share it ---------------------------------


@pytest.mark.asyncio
async def test_second_transfer_pins_no_new_memory() -> None:
    sim = SimDevice("g0", pin_s_per_gib=0.0)
    rng = random.Random(11)
    config = ring_config(2, 8 * KiB)
    pinned = []
    # The first transfer's two threads lease 2 slots each, or share a first lessee's
    # 2 if one finishes before the other starts; the second's one thread needs 2, which
    # the pool holds either way (two threads in the second too would race the first's).
    for threads in (2, 1):
        targets = plan_targets(rng, ["g0"], [40 * KiB, 24 * KiB], 8 * KiB)
        async with open_uploader({"g0": sim}, config, threads=threads) as up:
            buffers = await upload_all(up, targets, rng)
            assert_exact(targets, buffers)
            pinned.append(stats_by_device(up)["g0"].pinned_bytes_allocated)
        for buf in buffers:
            buf.close()
    assert pinned[0] > 0
    assert pinned[1] == 0
    assert sim.live.slots == staging_pool(sim).stats().slots > 0
    assert staging_pool(sim).stats().slots <= 4  # 2 threads x 2 slots: none pinned twice


@pytest.mark.asyncio
async def test_concurrent_transfers_share_the_pool_within_its_cap() -> None:
    sim = SimDevice("g0", bandwidth=2_000_000, pin_s_per_gib=0.0)
    rng = random.Random(5)
    # Room for three 8 KiB slots in all, while 2 loads x 2 threads x 2 slots could want 8.
    config = ring_config(2, 8 * KiB, pool_bytes=24 * KiB)
    results: dict[int, list[DeviceBuffer]] = {}
    all_targets = [plan_targets(rng, ["g0"], [64 * KiB, 48 * KiB], 8 * KiB) for _ in range(2)]

    async def one(i: int) -> None:
        async with open_uploader({"g0": sim}, config, threads=2) as up:
            results[i] = await upload_all(up, all_targets[i], random.Random(i))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        tg.start_soon(one, 1)
    for i, targets in enumerate(all_targets):
        assert_exact(targets, results[i])
        for buf in results[i]:
            buf.close()
    stats = staging_pool(sim).stats()
    assert stats.slots <= 3
    assert stats.pinned_bytes <= 24 * KiB
    assert stats.leased_slots == 0


# --- 3. the broken ring is caught ----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("skip_begin_write", [False, True])
async def test_broken_ring_is_caught_by_the_sim_device(
    skip_begin_write: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if skip_begin_write:
        # Only the copy engine's checksum is left to notice the overwrite.
        monkeypatch.setattr(SimStagingSlot, "begin_write", lambda self: None)
    # 8 KiB = 100 ms per copy: the second fill (microseconds after the first copy
    # starts) surely lands while that copy runs.
    sim = SimDevice("g1", bandwidth=80_000)
    config = ring_config(1, 8 * KiB)
    jobs = [ReadJob(i, 0, 0, i * 8 * KiB, 8 * KiB, i * 8 * KiB, 0, 0) for i in range(2)]
    allocated: list[DeviceBuffer] = []

    async def scenario() -> None:
        async with open_uploader({"g1": sim}, config, 1, _unsafe_skip_slot_wait=True) as up:
            buf = await up.allocate("g1", 16 * KiB)
            allocated.append(buf)
            values = iter([1, 2])

            def fill(job: ReadJob, view: memoryview) -> None:
                view[:] = bytes([next(values)]) * view.nbytes

            await up.transfer([(j, buf) for j in jobs], fill)

    with pytest.raises(RingViolation, match=r"device g1: staging slot \d+: ") as caught:
        await scenario()
    expected = "overwritten" if skip_begin_write else "written while copy #1"
    assert expected in str(caught.value)
    # The load failed: the uploader freed the buffer it had handed out.
    assert [b.closed for b in allocated if isinstance(b, SimDeviceBuffer)] == [True]
    assert _no_leases(sim)
    close_staging_pools()
    assert sim.live == IDLE


@pytest.mark.asyncio
async def test_same_ring_with_waits_passes() -> None:
    sim = SimDevice("g1", bandwidth=80_000)
    config = ring_config(1, 8 * KiB)
    jobs = [ReadJob(i, 0, 0, 0, 8 * KiB, i * 8 * KiB, 0, 0) for i in range(2)]
    async with open_uploader({"g1": sim}, config, 1) as up:
        buf = await up.allocate("g1", 16 * KiB)

        def fill(job: ReadJob, view: memoryview) -> None:
            view[:] = bytes([job.seq]) * view.nbytes

        await up.transfer([(j, buf) for j in jobs], fill)
    assert bytes(buf.to_host(0, 16 * KiB)) == b"\x00" * 8 * KiB + b"\x01" * 8 * KiB
    assert stats_by_device(up)["g1"].slot_waits == 1
    buf.close()


# --- 4. cancellation and failures release everything -------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_cancel_at_random_points_releases_everything(seed: int) -> None:
    rng = random.Random(seed)
    sims = [SimDevice(n, bandwidth=50_000_000, max_delay_ms=1.0, seed=seed) for n in ("g0", "g1")]
    devices: dict[str, Device] = {d.name: d for d in sims}
    config = ring_config(rng.choice([1, 2, 4]), 4 * KiB)
    targets = plan_targets(rng, ["g0", "g1"], [rng.randint(1, 40 * KiB) for _ in range(4)], 4 * KiB)
    n_jobs = sum(len(t.jobs) for t in targets)
    cancel_after = rng.randint(0, n_jobs)  # landed jobs, or a timer below
    threads_before = copy_threads()

    async def main() -> None:
        with anyio.CancelScope() as scope:
            if rng.random() < 0.3:
                scope.deadline = anyio.current_time() + rng.uniform(0.0, 0.02)
            async with open_uploader(devices, config, rng.randint(1, 4)) as up:
                buffers = [await up.allocate(t.device, t.payload.nbytes) for t in targets]
                work = [(j, b) for t, b in zip(targets, buffers, strict=True) for j in t.jobs]
                landed = 0

                def count(job: ReadJob) -> None:
                    nonlocal landed
                    landed += 1
                    if landed >= cancel_after:
                        scope.cancel()

                if cancel_after == 0:
                    scope.cancel()
                await up.transfer(work, fill_from(targets), landed=count)
            # Only reached when every job landed before the cancel took effect.
            for buf in buffers:
                buf.close()
        assert up.state is UploaderState.CLOSED

    anyio.run(main)
    assert all(buffers_in_use(d) == d.live.streams == 0 for d in sims), [d.live for d in sims]
    assert _no_leases(*sims)
    assert copy_threads() == threads_before
    assert not [t for t in threading.enumerate() if t.name.startswith("test-transfer")]
    close_staging_pools()
    assert all(d.live == IDLE for d in sims)


@pytest.mark.asyncio
async def test_failed_fill_frees_buffers_and_gives_slots_back() -> None:
    sim = SimDevice("g0", max_delay_ms=1.0)
    config = ring_config(2, 4 * KiB)
    jobs = [ReadJob(i, 0, 0, i * 4096, 4 * KiB, i * 4 * KiB, 0, 0) for i in range(2)]

    def fill(job: ReadJob, view: memoryview) -> None:
        if job.seq == 1:
            raise LoadError("model.gguf", 4096, "short read")
        view[:] = bytes(view.nbytes)

    async def scenario() -> None:
        async with open_uploader({"g0": sim}, config, 1) as up:
            buf = await up.allocate("g0", 8 * KiB)
            await up.transfer([(j, buf) for j in jobs], fill)

    with pytest.raises(LoadError, match="short read"):
        await scenario()
    assert buffers_in_use(sim) == sim.live.streams == 0
    assert _no_leases(sim)
    close_staging_pools()
    assert sim.live == IDLE


@pytest.mark.asyncio
async def test_a_failing_landed_callback_fails_the_transfer() -> None:
    """``landed`` runs as a loop callback, whose exceptions the loop would only log: the
    transfer raises it instead, and frees what it holds."""
    sim = SimDevice("g0")
    config = ring_config(2, 4 * KiB)
    jobs = [ReadJob(i, 0, 0, i * 4096, 4 * KiB, i * 4 * KiB, 0, 0) for i in range(3)]

    def landed(job: ReadJob) -> None:
        if job.seq == 1:
            raise RuntimeError("progress failed")

    async def scenario() -> None:
        async with open_uploader({"g0": sim}, config, 1) as up:
            buf = await up.allocate("g0", 12 * KiB)
            await up.transfer([(j, buf) for j in jobs], lambda job, view: None, landed=landed)

    with pytest.raises(RuntimeError, match="progress failed"):
        await scenario()
    assert buffers_in_use(sim) == sim.live.streams == 0
    close_staging_pools()
    assert sim.live == IDLE


@pytest.mark.asyncio
async def test_fill_that_keeps_a_view_is_an_error() -> None:
    sim = SimDevice("g0")
    kept: list[np.ndarray] = []
    async with open_uploader({"g0": sim}, ring_config(1, 4 * KiB), 1) as up:
        buf = await up.allocate("g0", 4 * KiB)
        job = ReadJob(0, 0, 0, 0, 4 * KiB, 0, 0, 0)
        await up.transfer([(job, buf)], lambda job, v: kept.append(np.frombuffer(v, np.uint8)))
    buf.close()
    # The view outlives the slot's lease: freeing the pool says so instead of freeing
    # memory that the view still reads.
    with pytest.raises(LoadError, match=r"staging slot \d+ is still referenced after its"):
        close_staging_pools()
    kept.clear()
    assert sim.live.buffers == 0


# --- 5. synchronous fallback ---------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("missing", ["async_copies", "events", "pinned_host"])
async def test_devices_without_async_copies_get_synchronous_copies(missing: str) -> None:
    sim = SimDevice("g0", bandwidth=50_000_000, **{missing: False})  # type: ignore[arg-type]
    rng = random.Random(7)
    targets = plan_targets(rng, ["g0"], [30 * KiB, 5 * KiB], 4 * KiB)
    threads_before = copy_threads()
    async with open_uploader({"g0": sim}, ring_config(2, 4 * KiB), 3) as up:
        buffers = await upload_all(up, targets, rng)
        # No copy engine thread was ever started: every copy was synchronous.
        assert copy_threads() == threads_before
        assert_exact(targets, buffers)
        stats = stats_by_device(up)["g0"]
        assert not stats.asynchronous
        assert stats.copies == sum(len(t.jobs) for t in targets)
    for buf in buffers:
        buf.close()
    close_staging_pools()
    assert sim.live == IDLE


# --- misuse --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_misuse_is_refused() -> None:
    sim = SimDevice("g0", free=64 * KiB)
    devices: dict[str, Device] = {"CPU": CpuDevice(), "g0": sim}
    async with open_uploader(devices, ring_config(2, 4 * KiB)) as up:
        with pytest.raises(ValueError, match="does not take uploads"):
            await up.allocate("CPU", 1)
        with pytest.raises(ValueError, match="no device named 'g9'"):
            await up.allocate("g9", 1)
        with pytest.raises(LoadError, match="out of memory"):
            await up.allocate("g0", 65 * KiB)
        buf = await up.allocate("g0", 8 * KiB)
        noop = fill_from([])
        with pytest.raises(ValueError, match="> staging slot size"):
            await up.transfer([(ReadJob(0, 0, 0, 0, 4 * KiB + 1, 0, 0, 0), buf)], noop)
        with pytest.raises(ValueError, match="outside the 8192-byte buffer on g0"):
            await up.transfer([(ReadJob(0, 0, 0, 0, 4 * KiB, 6 * KiB, 0, 0), buf)], noop)
    with pytest.raises(RuntimeError, match="closed"):
        await up.transfer([(ReadJob(0, 0, 0, 0, 1, 0, 0, 0), buf)], noop)
    buf.close()
    close_staging_pools()
    assert sim.live == IDLE
