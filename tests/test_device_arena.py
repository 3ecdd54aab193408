"""The device arena (``io/devices/arena.py``): device memory kept across loads, handed
out again only when it is safe, bounded, and freed by ``release_device_memory``; and
the simulated device's ``cudaMalloc``/``cudaFree`` as the device-wide synchronisations
they are."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from aiogguf.errors import LoadError
from aiogguf.io._devices.arena import DeviceArena, close_device_arenas, device_arena
from aiogguf.io._devices.sim import SimDevice

KiB = 1024
MiB = 1024 * KiB


class _Event:
    """A copy event that completes when ``synchronize`` is called (counted)."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0

    def record(self, stream: object) -> None:
        raise AssertionError("not recorded here")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_a_closed_buffer_is_reused_and_an_open_one_never() -> None:
    sim = SimDevice("g0", free=64 * MiB)
    arena = DeviceArena(sim)
    first = arena.take(3 * MiB)
    assert first.allocated_bytes == 4 * MiB  # rounded to CUDA's 2 MiB granularity
    # Still open (a model holds it): a second take must not get its memory.
    second = arena.take(3 * MiB)
    assert second.allocated_bytes == 4 * MiB
    address = first.buffer.array(0, 1).ctypes.data
    first.buffer.close()
    third = arena.take(3 * MiB)
    assert third.allocated_bytes == 0
    assert third.buffer.array(0, 1).ctypes.data == address
    stats = arena.stats()
    assert (stats.allocated, stats.reused, stats.blocks, stats.idle_blocks) == (2, 1, 2, 0)
    for grant in (second, third):
        grant.buffer.close()
    assert arena.stats().idle_blocks == 2
    assert arena.release() == 8 * MiB
    assert sim.live.buffers == 0


def test_an_array_kept_past_close_keeps_its_memory_out_of_the_arena() -> None:
    sim = SimDevice("g0", free=64 * MiB)
    arena = DeviceArena(sim)
    grant = arena.take(MiB)
    view = grant.buffer.array(0, 16)
    view[:] = 9
    grant.buffer.close()
    assert arena.stats().idle_blocks == 0  # the array still reads it
    other = arena.take(MiB)
    assert other.allocated_bytes > 0
    other.buffer.array(0, 16)[:] = 1
    assert bytes(view) == b"\x09" * 16  # nobody wrote into the kept array's memory
    del view
    gc.collect()
    assert arena.stats().idle_blocks == 1
    other.buffer.close()


def test_a_block_is_handed_out_only_after_the_streams_that_wrote_it_are_done() -> None:
    sim = SimDevice("g0", free=64 * MiB)
    arena = DeviceArena(sim)
    grant = arena.take(MiB)
    pending, done = _Event(), _Event()
    done.done = True
    grant.used_by([pending, done])
    grant.buffer.close()
    assert pending.waits == 0  # returning does not wait
    again = arena.take(MiB)
    assert again.allocated_bytes == 0
    assert (pending.waits, done.waits) == (1, 0)
    again.buffer.close()


def test_idle_memory_stays_within_the_cap_and_what_the_device_can_spare() -> None:
    sim = SimDevice("g0", free=64 * MiB)
    arena = DeviceArena(sim, cap_bytes=5 * MiB)
    grants = [arena.take(2 * MiB) for _ in range(3)]
    for grant in grants:
        grant.buffer.close()
    # Three 2 MiB blocks came back; the oldest was freed to stay within 5 MiB.
    stats = arena.stats()
    assert (stats.idle_blocks, stats.idle_bytes, stats.freed) == (2, 4 * MiB, 1)
    assert sim.live.buffer_bytes == 4 * MiB
    # A device with less than a tenth of its memory free keeps nothing idle.
    tight = SimDevice("g1", free=MiB, total=64 * MiB)
    tight_arena = DeviceArena(tight)
    assert tight_arena.cap_bytes == int(64 * MiB * 0.9)
    grant = tight_arena.take(2 * MiB)
    grant.buffer.close()
    assert tight_arena.stats().idle_blocks == 0
    assert tight.live.buffers == 0


def test_an_allocation_that_fails_frees_idle_blocks_and_tries_again() -> None:
    sim = SimDevice("g0", free=10 * MiB)
    arena = DeviceArena(sim)
    arena.take(6 * MiB).buffer.close()
    assert arena.stats().idle_bytes == 6 * MiB
    # 8 MiB does not fit beside the idle 6 MiB block, which is too small to serve it.
    grant = arena.take(8 * MiB)
    assert grant.allocated_bytes == 8 * MiB
    assert arena.stats().freed == 1
    with pytest.raises(LoadError, match="g0: out of memory"):
        arena.take(4 * MiB)  # nothing idle left to free
    grant.buffer.close()


def test_a_block_that_comes_back_after_release_is_freed() -> None:
    sim = SimDevice("g0", free=64 * MiB)
    arena = device_arena(sim)
    grant = arena.take(MiB)
    close_device_arenas()  # a model still holds the buffer
    assert sim.live.buffers == 1
    grant.buffer.close()
    assert sim.live.buffers == 0
    assert device_arena(sim) is not arena  # a new one for the next load


def test_sim_malloc_and_free_wait_for_every_stream_of_the_device() -> None:
    """``cudaMalloc`` and ``cudaFree`` synchronise the device: a free while another
    stream's copy is in flight waits for it, and the thread that frees pays the wait."""
    sim = SimDevice("g0", free=64 * MiB, bandwidth=40_000)  # 8 KiB: 200 ms
    stream = sim.open_copy_stream(asynchronous=True)
    slot = sim.open_staging_slot(0, 8 * KiB, 4096)
    dest = sim.allocate(8 * KiB)
    block = sim.allocate_block(MiB)
    try:
        syncs = sim.syncs
        began = time.perf_counter()
        stream.copy_async(dest, 0, slot, 8 * KiB)
        block.free()  # another user's free during this stream's copy
        assert time.perf_counter() - began >= 0.18
        assert sim.syncs.count == syncs.count + 1
        assert sim.syncs.wait_s - syncs.wait_s >= 0.15
        # A free with nothing in flight does not wait.
        quick = sim.allocate_block(MiB)
        began = time.perf_counter()
        quick.free()
        assert time.perf_counter() - began < 0.1
    finally:
        stream.close()
        slot.close()
        dest.close()


def test_sim_block_lends_poisoned_memory_to_one_buffer_at_a_time() -> None:
    sim = SimDevice("g0", free=64 * MiB)
    block = sim.allocate_block(64 * KiB)
    released = threading.Event()
    buffer = block.buffer(40 * KiB, released.set)
    assert buffer.nbytes == 40 * KiB
    buffer.array(0, 8)[:] = 5
    buffer.close()
    assert released.is_set()
    again = block.buffer(64 * KiB, lambda: None)
    # The last user's bytes never show through: unwritten ranges read as poison.
    assert bytes(again.to_host(0, 8)) != b"\x05" * 8
    again.close()
    block.free()
    with pytest.raises(LoadError, match="after free"):
        block.buffer(8, lambda: None)
