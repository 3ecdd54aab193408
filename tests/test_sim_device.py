"""The simulated GPU's behaviour: memory accounting, events, in-order copies, and the
ring check it performs itself (so a broken upload ring cannot pass a test)."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiogguf
from aiogguf._config import Config
from aiogguf._devices import enumerate_devices
from aiogguf.errors import LoadError
from aiogguf.io import _libc
from aiogguf.io._devices.arena import device_arenas
from aiogguf.io._devices.base import DeviceBuffer, UploadTarget
from aiogguf.io._devices.sim import POISON_BYTE, RingViolation, SimDevice, SimUsage
from aiogguf.testing.synth import write_synthetic_model

KiB = 1024


def _fill(slot_view: memoryview, value: int) -> None:
    slot_view[:] = bytes([value]) * slot_view.nbytes


def test_device_memory_accounting_and_views() -> None:
    dev = SimDevice("g0", free=1 * KiB * KiB)
    assert isinstance(dev, UploadTarget)
    assert dev.live == SimUsage(0, 0, 0, 0)
    buf = dev.allocate(4096)
    assert isinstance(buf, DeviceBuffer)
    assert buf.xp is np
    assert dev.live == SimUsage(1, 4096, 0, 0)
    # Fresh memory is poisoned; array() is a view, to_host() a copy.
    assert bytes(buf.to_host(0, 16)) == bytes([POISON_BYTE]) * 16
    view = buf.array(100, 10)
    view[:] = 7
    assert bytes(buf.to_host(98, 14)) == bytes([POISON_BYTE] * 2 + [7] * 10 + [POISON_BYTE] * 2)
    with pytest.raises(ValueError, match="outside"):
        buf.array(4090, 10)
    buf.close()
    buf.close()  # idempotent
    assert dev.live == SimUsage(0, 0, 0, 0)
    with pytest.raises(LoadError, match="after close"):
        buf.to_host(0, 1)


def test_out_of_device_memory_is_a_load_error() -> None:
    dev = SimDevice("g1", free=10 * KiB)
    a = dev.allocate(8 * KiB)
    with pytest.raises(LoadError, match="g1: out of memory"):
        dev.allocate(4 * KiB)
    a.close()
    dev.allocate(10 * KiB).close()


def test_events_follow_the_stream_in_order() -> None:
    dev = SimDevice("g0", bandwidth=100_000, seed=1)  # 4 KiB ≈ 40 ms per copy
    stream = dev.open_copy_stream(asynchronous=True)
    try:
        dest = dev.allocate(3 * 4096)
        slots = [dev.open_staging_slot(i, 4096, 4096) for i in range(3)]
        events = [dev.new_event() for _ in slots]
        assert all(e.query() for e in events)  # never recorded: done, as in CUDA
        for i, (slot, event) in enumerate(zip(slots, events, strict=True)):
            slot.begin_write()
            _fill(slot.view(), i + 1)
            stream.copy_async(dest, i * 4096, slot, 4096)
            event.record(stream)
        assert not events[2].query()
        events[0].synchronize()
        assert events[0].query()
        # Copies run in issue order: when the first is done, the later ones may not be,
        # but when the last is done, all are.
        events[2].synchronize()
        assert all(e.query() for e in events)
        data = bytes(dest.to_host(0, 3 * 4096))
        assert data == b"\x01" * 4096 + b"\x02" * 4096 + b"\x03" * 4096
        # After completion the slots can be refilled.
        slots[0].begin_write()
        for slot in slots:
            slot.close()
        dest.close()
    finally:
        stream.close()
    assert dev.live == SimUsage(0, 0, 0, 0)


def test_begin_write_on_busy_slot_raises_naming_the_slot() -> None:
    dev = SimDevice("g3", bandwidth=20_000)  # 4 KiB = 200 ms
    stream = dev.open_copy_stream(asynchronous=True)
    dest = dev.allocate(4096)
    slot = dev.open_staging_slot(2, 4096, 4096)
    try:
        _fill(slot.view(), 9)
        stream.copy_async(dest, 0, slot, 4096)
        with pytest.raises(
            RingViolation, match=r"device g3: staging slot 2: written while copy #1"
        ):
            slot.begin_write()
        # Sticky: the violation fails everything that follows.
        with pytest.raises(RingViolation, match="slot 2"):
            stream.synchronize()
        with pytest.raises(RingViolation):
            stream.copy_async(dest, 0, slot, 4096)
    finally:
        slot.close()
        dest.close()
        stream.close()


def test_write_that_skips_begin_write_is_caught_by_the_checksum() -> None:
    dev = SimDevice("g0", bandwidth=40_000)  # 8 KiB = 200 ms
    stream = dev.open_copy_stream(asynchronous=True)
    dest = dev.allocate(8192)
    slot = dev.open_staging_slot(1, 8192, 4096)
    try:
        _fill(slot.view(), 1)
        stream.copy_async(dest, 0, slot, 8192)
        _fill(slot.view(), 2)  # no begin_write: the copy is still in flight
        with pytest.raises(RingViolation, match=r"slot 1: copy #1 .* overwritten"):
            stream.synchronize()
    finally:
        slot.close()
        dest.close()
        stream.close()


def test_rewriting_identical_bytes_is_harmless() -> None:
    # The checksum flags changed bytes, not writes: the copy still delivers the right data.
    dev = SimDevice("g0", bandwidth=400_000)
    stream = dev.open_copy_stream(asynchronous=True)
    dest = dev.allocate(4096)
    slot = dev.open_staging_slot(0, 4096, 4096)
    try:
        _fill(slot.view(), 5)
        stream.copy_async(dest, 0, slot, 4096)
        _fill(slot.view(), 5)
        stream.synchronize()
        assert bytes(dest.to_host(0, 4096)) == b"\x05" * 4096
    finally:
        slot.close()
        dest.close()
        stream.close()


def test_copy_into_freed_buffer_fails_the_stream() -> None:
    dev = SimDevice("g0", bandwidth=20_000)
    stream = dev.open_copy_stream(asynchronous=True)
    dest = dev.allocate(4096)
    slot = dev.open_staging_slot(0, 4096, 4096)
    try:
        stream.copy_async(dest, 0, slot, 4096)
        dest.close()
        with pytest.raises(LoadError, match="freed buffer"):
            stream.synchronize()
    finally:
        slot.close()
        stream.close()


def test_slots_are_aligned_and_freed() -> None:
    dev = SimDevice("g0")
    stream = dev.open_copy_stream(asynchronous=False)
    for alignment in (4096, 65536):
        slot = dev.open_staging_slot(0, 10_000, alignment)
        view = slot.view()
        assert view.nbytes == 10_000
        assert not view.readonly
        assert np.frombuffer(view, np.uint8).ctypes.data % alignment == 0
        assert dev.live.slots == 1
        slot.close()
        slot.close()
        assert dev.live.slots == 0
        with pytest.raises(LoadError, match="closed"):
            slot.view()
    stream.close()


def test_slot_view_kept_alive_is_reported_on_close() -> None:
    dev = SimDevice("g0")
    stream = dev.open_copy_stream(asynchronous=False)
    slot = dev.open_staging_slot(0, 4096, 4096)
    kept = slot.view()[:10]
    with pytest.raises(LoadError, match="still referenced"):
        slot.close()
    kept.release()
    stream.close()


def test_synchronous_stream_has_no_thread() -> None:
    before = set(threading.enumerate())
    dev = SimDevice("g0", async_copies=False, bandwidth=10_000_000)
    stream = dev.open_copy_stream(asynchronous=False)
    assert set(threading.enumerate()) == before
    dest = dev.allocate(4096)
    start = time.perf_counter()
    stream.copy_sync(dest, 0, memoryview(b"\x11" * 4096))
    assert time.perf_counter() - start >= 4096 / 10_000_000
    assert bytes(dest.to_host(0, 4096)) == b"\x11" * 4096
    slot = dev.open_staging_slot(0, 4096, 4096)
    with pytest.raises(RuntimeError, match="synchronous copies only"):
        stream.copy_async(dest, 0, slot, 4096)
    slot.close()
    dest.close()
    stream.close()


def test_close_joins_the_copy_thread_after_the_queue_drains() -> None:
    before = set(threading.enumerate())
    dev = SimDevice("g7", bandwidth=400_000)
    stream = dev.open_copy_stream(asynchronous=True)
    started = set(threading.enumerate()) - before
    assert [t.name for t in started] == ["aiogguf-sim-copy-g7"]
    dest = dev.allocate(4096)
    slot = dev.open_staging_slot(0, 4096, 4096)
    _fill(slot.view(), 3)
    stream.copy_async(dest, 0, slot, 4096)
    stream.close()  # waits for the queued copy
    stream.close()
    assert set(threading.enumerate()) == before
    assert bytes(dest.to_host(0, 4096)) == b"\x03" * 4096
    assert dev.live.streams == 0
    with pytest.raises(RuntimeError, match="after close"):
        stream.copy_async(dest, 0, slot, 1)
    slot.close()
    dest.close()


# --- device memory: backed at allocation, cached after free -----------------------------

PAGE = 4096


def _address(buf: DeviceBuffer) -> int:
    address: int = buf.array(0, 1).ctypes.data
    return address


def test_new_device_memory_is_backed_before_allocate_returns() -> None:
    # A GPU's memory takes no host page faults: every page is resident before a copy.
    dev = SimDevice("g0", free=64 * KiB * KiB)
    buf = dev.allocate(8 * KiB * KiB)
    try:
        start = -(-_address(buf) // PAGE) * PAGE
        end = (_address(buf) + buf.nbytes) // PAGE * PAGE
        resident = _libc.mincore(start, end - start)
        assert all(page & 1 for page in resident)
        stats = dev.memory_cache.stats()
        assert (stats.backed, stats.backed_bytes, stats.reused) == (1, 8 * KiB * KiB, 0)
    finally:
        buf.close()


def test_freed_device_memory_is_reused_and_poisoned_again() -> None:
    dev = SimDevice("g0", free=1 * KiB * KiB)
    first = dev.allocate(64 * KiB)
    first.array(0, 64 * KiB)[:] = 7
    address = _address(first)
    first.close()
    assert dev.memory_cache.stats().cached_bytes == 64 * KiB
    second = dev.allocate(40 * KiB)  # fits: at most twice the request
    try:
        assert _address(second) == address
        stats = dev.memory_cache.stats()
        assert (stats.backed, stats.reused, stats.cached_blocks) == (1, 1, 0)
        # The last user's bytes never show through: unwritten ranges read as poison.
        assert bytes(second.to_host(0, 16)) == bytes([POISON_BYTE]) * 16
        assert dev.live == SimUsage(1, 40 * KiB, 0, 0)
    finally:
        second.close()


def test_memory_an_array_still_views_is_not_reused_until_the_array_dies() -> None:
    dev = SimDevice("g0", free=1 * KiB * KiB)
    buf = dev.allocate(16 * KiB)
    view = buf.array(0, 16)
    view[:] = 3
    buf.close()
    assert dev.live == SimUsage(0, 0, 0, 0)  # freed, as far as the device counts
    assert dev.memory_cache.stats().cached_blocks == 0  # but not handed out again
    other = dev.allocate(16 * KiB)
    try:
        assert _address(other) != view.ctypes.data
        assert bytes(view) == b"\x03" * 16  # the array's bytes are untouched
    finally:
        other.close()
    del view
    assert dev.memory_cache.stats().cached_blocks == 2


def test_cache_takes_a_fitting_block_and_stays_within_its_cap() -> None:
    dev = SimDevice("g0", free=1 * KiB * KiB, memory_cache_bytes=96 * KiB)
    held = [dev.allocate(nbytes) for nbytes in (64 * KiB, 32 * KiB)]
    for buf in held:
        buf.close()
    assert dev.memory_cache.stats().cached_bytes == 96 * KiB
    # Far smaller than any idle block: new memory, the big blocks are not spent on it.
    dev.allocate(4 * KiB).close()
    stats = dev.memory_cache.stats()
    assert (stats.backed, stats.reused) == (3, 0)
    # The 4 KiB block came back over the cap: the oldest idle block (64 KiB) made room.
    assert (stats.cached_blocks, stats.cached_bytes) == (2, 36 * KiB)
    dev.allocate(200 * KiB).close()  # larger than the cap: freed, never cached
    assert dev.memory_cache.stats().cached_bytes == 36 * KiB
    assert dev.release_cached_memory() == 36 * KiB
    assert dev.memory_cache.stats().cached_blocks == 0


def test_cache_picks_the_smallest_fitting_block_among_several() -> None:
    # Idle blocks of other sizes come before it: the pick is by position, not by
    # comparing blocks (arrays of different sizes cannot be compared).
    dev = SimDevice("g0", free=1 * KiB * KiB, memory_cache_bytes=512 * KiB)
    held = [dev.allocate(nbytes) for nbytes in (8 * KiB, 100 * KiB, 60 * KiB)]
    addresses = [_address(buf) for buf in held]
    for buf in held:
        buf.close()
    again = dev.allocate(50 * KiB)
    try:
        assert _address(again) == addresses[2]  # 60 KiB: fits, and smaller than 100 KiB
        stats = dev.memory_cache.stats()
        assert (stats.reused, stats.cached_blocks) == (1, 2)
    finally:
        again.close()


def test_release_device_memory_frees_the_arena_and_the_cached_device_memory(
    tmp_path: Path,
) -> None:
    path = write_synthetic_model(tmp_path / "m.gguf", size_bytes="2MiB", seed=3).path
    overrides: dict[str, Any] = {
        "n_gpu_layers": -1,
        "staging_buffer_size": "256KiB",
        "sim_gpus": ["name=gr,free=1GiB"],
    }
    allocated = []
    for _ in range(2):
        with aiogguf.load_sync(path, **overrides) as model:
            allocated.append(model.report.uploads[0].device_bytes_allocated)
        gc.collect()  # no array of the model may keep its memory out of the arena
    (sim,) = [d for d in enumerate_devices(Config().with_overrides(**overrides)) if d.name == "gr"]
    assert isinstance(sim, SimDevice)
    # The second load took every buffer from what the first one gave back: no
    # allocation, so no device-wide synchronisation either.
    assert allocated[0] > 0
    assert allocated[1] == 0
    (arena,) = device_arenas()
    held = arena.stats()
    assert (held.allocated, held.reused, held.freed) == (1, 1, 0)
    assert sim.live.buffer_bytes == held.idle_bytes == allocated[0]
    syncs = sim.syncs.count
    aiogguf.release_device_memory_sync()
    assert sim.syncs.count == syncs + 1  # one cudaFree
    assert sim.live.buffers == 0
    assert sim.memory_cache.stats().cached_bytes == 0
    assert device_arenas() == ()


def test_a_device_that_keeps_no_bytes_times_copies_and_still_checks_the_ring() -> None:
    dev = SimDevice("g0", bandwidth=40_000, keep_bytes=False)  # 8 KiB = 200 ms
    stream = dev.open_copy_stream(asynchronous=True)
    dest = dev.allocate(8192)
    slot = dev.open_staging_slot(1, 8192, 4096)
    try:
        assert dev.memory_cache.stats().backed == 0  # nothing was backed for it
        _fill(slot.view(), 1)
        began = time.perf_counter()
        stream.copy_async(dest, 0, slot, 8192)
        stream.synchronize()
        assert time.perf_counter() - began >= 0.19  # the modelled copy's time
        # Written as far as the device counts (no poison), but no byte moved.
        assert bytes(dest.to_host(0, 8192)) == bytes(8192)
        slot.begin_write()
        _fill(slot.view(), 2)
        stream.copy_async(dest, 0, slot, 8192)
        _fill(slot.view(), 3)  # no begin_write: the modelled copy is still in flight
        with pytest.raises(RingViolation, match=r"slot 1: copy #2 .* overwritten"):
            stream.synchronize()
    finally:
        slot.close()
        dest.close()
        stream.close()


def test_full_offload_to_a_device_that_keeps_no_bytes(tmp_path: Path) -> None:
    path = write_synthetic_model(tmp_path / "m.gguf", size_bytes="2MiB", seed=5).path
    spec = "name=gk,free=1GiB,keep_bytes=false,bandwidth=1000000000000"
    with aiogguf.load_sync(path, n_gpu_layers=-1, sim_gpus=[spec], check_tensors=False) as model:
        (upload,) = model.report.uploads
        assert upload.bytes_copied > 0
        # Every device tensor reads back as zeros: the copies were timed, not made.
        device_names = [t.name for t in model.plan.tensors if t.device == "gk" and t.nbytes]
        assert device_names
        assert all(not bytes(model.raw(n)).strip(b"\0") for n in device_names)
    (sim,) = [
        d for d in enumerate_devices(Config().with_overrides(sim_gpus=[spec])) if d.name == "gk"
    ]
    assert isinstance(sim, SimDevice)
    assert sim.keep_bytes is False
    assert sim.memory_cache.stats().backed == 0


def test_streams_of_one_device_share_its_bandwidth() -> None:
    dev = SimDevice("g0", bandwidth=80_000, keep_bytes=False)  # 8 KiB = 100 ms
    streams = [dev.open_copy_stream(asynchronous=True) for _ in range(3)]
    dests = [dev.allocate(8192) for _ in streams]
    slots = [dev.open_staging_slot(i, 8192, 4096) for i in range(len(streams))]
    try:
        began = time.perf_counter()
        for stream, dest, slot in zip(streams, dests, slots, strict=True):
            stream.copy_async(dest, 0, slot, 8192)
        for stream in streams:
            stream.synchronize()
        # One after the other over the link, not three at once at the full rate.
        assert time.perf_counter() - began >= 0.29
    finally:
        for slot in slots:
            slot.close()
        for dest in dests:
            dest.close()
        for stream in streams:
            stream.close()
