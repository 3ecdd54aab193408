"""The CuPy upload backend.

``gpu``-marked tests run the upload invariants on real CUDA devices (skipped without
CuPy or a GPU). The others drive the same code through a small fake ``cupy`` module
that does copies with ``ctypes.memmove``: it cannot prove anything about CUDA, but it
checks the pointer arithmetic (alignment, offsets), that every call runs with its
device current, and the translation of CuPy errors into ``LoadError``.
"""

from __future__ import annotations

import ctypes
import random
import threading
import types
from typing import Any

import anyio
import numpy as np
import pytest
from upload_helpers import (
    assert_exact,
    fill_from,
    open_uploader,
    plan_targets,
    ring_config,
    upload_all,
)

from aiogguf._jobs import ReadJob
from aiogguf.errors import LoadError
from aiogguf.io._devices import cupy_backend
from aiogguf.io._devices.base import Device, DeviceBuffer, UploadTarget
from aiogguf.io._devices.cupy_backend import CupyDevice, CupyDeviceBuffer
from aiogguf.io._devices.pool import staging_pool

KiB = 1024
MiB = 1024 * KiB

# --- a fake cupy -------------------------------------------------------------------------


def _fake_cupy(memory_limit: int = 1 << 30) -> Any:
    current = threading.local()
    calls: list[tuple[str, int | None]] = []

    def now() -> int | None:
        return getattr(current, "device", None)

    class Device:
        def __init__(self, ordinal: int) -> None:
            self.ordinal = ordinal

        def __enter__(self) -> Device:
            self.saved = now()
            current.device = self.ordinal
            return self

        def __exit__(self, *exc: object) -> None:
            current.device = self.saved

    class Memory:
        def __init__(self, size: int) -> None:
            if size > memory_limit:
                raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
            self.device = now()
            self._buf = ctypes.create_string_buffer(max(size, 1))
            self.ptr = ctypes.addressof(self._buf)

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
            self.ptr, self.size, self.owner, self.device = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem: Memory | UnownedMemory, offset: int) -> None:
            self.mem, self.ptr = mem, mem.ptr + offset

    class PinnedMemory:
        def __init__(self, size: int, flags: int = 0) -> None:
            self.size = size
            self.device = now()

    class PinnedMemoryPointer(bytearray):
        # Real ones export the pinned buffer; a bytearray is the fake's "pinned" memory
        # (deliberately not page-aligned, so the slot must align itself).
        def __init__(self, mem: PinnedMemory, offset: int) -> None:
            super().__init__(mem.size)
            anchor = (ctypes.c_char * mem.size).from_buffer(self)
            self.ptr = ctypes.addressof(anchor) + offset
            del anchor

    class Stream:
        null: Any = types.SimpleNamespace(device=None, ptr=0)  # any device's

        def __init__(self, non_blocking: bool = False) -> None:
            assert non_blocking
            self.device = now()
            self.ptr = id(self)

        def synchronize(self) -> None:
            calls.append(("streamSynchronize", now()))

    class Event:
        def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
            self.recorded_on: Stream | None = None

        def record(self, stream: Stream) -> None:
            if stream.device is not None:
                assert now() == stream.device, "event recorded with another device current"
            self.recorded_on = stream

        @property
        def done(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class Runtime:
        memcpyHostToDevice = 1
        memcpyDeviceToHost = 2

        @staticmethod
        def memcpyAsync(dst: int, src: int, n: int, kind: int, stream: int) -> None:
            assert kind == Runtime.memcpyHostToDevice
            calls.append(("memcpyAsync", now()))
            ctypes.memmove(dst, src, n)

        @staticmethod
        def memcpy(dst: int, src: int, n: int, kind: int) -> None:
            calls.append(("memcpy", now()))
            ctypes.memmove(dst, src, n)

    def ndarray(shape: tuple[int], dtype: Any, memptr: MemoryPointer) -> Any:
        return np.ctypeslib.as_array((ctypes.c_uint8 * shape[0]).from_address(memptr.ptr))

    cuda = types.SimpleNamespace(
        Device=Device,
        Memory=Memory,
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        PinnedMemory=PinnedMemory,
        PinnedMemoryPointer=PinnedMemoryPointer,
        Stream=Stream,
        Event=Event,
        runtime=Runtime,
    )
    return types.SimpleNamespace(cuda=cuda, ndarray=ndarray, uint8=np.uint8, calls=calls)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = _fake_cupy(memory_limit=4 * MiB)
    monkeypatch.setattr(cupy_backend, "import_cupy", lambda: fake)
    return fake


def _cuda_devices(n: int) -> dict[str, Device]:
    return {f"CUDA{i}": CupyDevice(i, kind="gpu", device_id=None) for i in range(n)}


@pytest.mark.asyncio
@pytest.mark.parametrize("slots", [1, 2, 4])
async def test_fake_cupy_uploads_exact_bytes_on_the_right_device(
    fake_cupy: Any, slots: int
) -> None:
    devices = _cuda_devices(2)
    assert all(isinstance(d, UploadTarget) for d in devices.values())
    rng = random.Random(slots)
    targets = plan_targets(
        rng, list(devices), [rng.randint(1, 64 * KiB) for _ in range(5)], 8 * KiB
    )
    async with open_uploader(devices, ring_config(slots, 8 * KiB), 3) as up:
        buffers = await upload_all(up, targets, rng)
        assert all(s.asynchronous for s in up.stats)
    pool = staging_pool(devices["CUDA1"])  # type: ignore[arg-type]
    lease = pool.lease(16, 8 * KiB, 4096, cap_bytes=0, wait=False, pin=False)
    assert lease.slots
    for pooled in lease.slots:
        # The fill's view starts on a page boundary, inside the pinned allocation.
        assert np.frombuffer(pooled.slot.view(), np.uint8).ctypes.data % 4096 == 0
        assert pooled.slot.view().nbytes == 8 * KiB
    pool.give_back(lease)
    assert_exact(targets, buffers)
    for t, buf in zip(targets, buffers, strict=True):
        assert isinstance(buf, CupyDeviceBuffer)
        assert buf._mem.device == int(t.device.removeprefix("CUDA"))
    # Every copy was issued with its destination's device current.
    copies = [device for name, device in fake_cupy.calls if name == "memcpyAsync"]
    assert len(copies) == sum(len(t.jobs) for t in targets)
    assert set(copies) <= {0, 1}
    for buf in buffers:
        buf.close()
        assert buf.closed


@pytest.mark.asyncio
async def test_fake_cupy_errors_become_load_errors(fake_cupy: Any) -> None:
    devices = _cuda_devices(1)
    async with open_uploader(devices, ring_config(2, 4 * KiB)) as up:
        with pytest.raises(LoadError, match=r"CUDA0: allocating 8388608 bytes .* out of memory"):
            await up.allocate("CUDA0", 8 * MiB)
        buf = await up.allocate("CUDA0", 4 * KiB)
        job = ReadJob(0, 0, 0, 0, 4 * KiB, 0, 0, 0)

        def explode(*args: object) -> None:
            raise RuntimeError("cudaErrorIllegalAddress")

        fake_cupy.cuda.runtime.memcpyAsync = explode
        with pytest.raises(LoadError, match=r"CUDA0: queueing a 4096-byte copy failed"):
            await up.transfer([(job, buf)], lambda job, v: None)
    buf.close()


def test_without_cupy_allocation_is_a_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cupy_backend, "import_cupy", lambda: None)
    with pytest.raises(LoadError, match="CUDA0: CuPy is not available"):
        CupyDevice(0, kind="gpu", device_id=None).allocate(1)


# --- real GPUs -----------------------------------------------------------------------------


def _real_cuda_devices() -> dict[str, Device]:
    cupy = cupy_backend.import_cupy()
    if cupy is None:
        pytest.skip("CuPy is not installed")
    found = cupy_backend.cupy_devices()
    if not found:
        pytest.skip("CuPy sees no CUDA device")
    return {d.name: d for d in found[:2]}


def _device_sha(buf: DeviceBuffer) -> bytes:
    # The bytes as the device holds them, copied back in one go.
    return bytes(buf.to_host(0, buf.nbytes))


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_gpu_uploads_exact_bytes(slots: int) -> None:
    devices = _real_cuda_devices()
    rng = random.Random(slots)
    sizes = [rng.randint(1, 8 * MiB) for _ in range(6)]
    targets = plan_targets(rng, list(devices), sizes, 1 * MiB)

    async def main() -> list[DeviceBuffer]:
        async with open_uploader(devices, ring_config(slots, 1 * MiB), 4) as up:
            return await upload_all(up, targets, rng)

    buffers = anyio.run(main)
    assert_exact(targets, buffers)
    for t, buf in zip(targets, buffers, strict=True):
        # Device-side view: compare on the device too.
        xp = buf.xp
        assert bool(xp.all(buf.array(0, buf.nbytes) == xp.asarray(t.payload)))
        buf.close()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_cancel_frees_everything(seed: int) -> None:
    devices = _real_cuda_devices()
    rng = random.Random(seed)
    targets = plan_targets(rng, list(devices), [rng.randint(1, 32 * MiB) for _ in range(4)], MiB)
    allocated: list[DeviceBuffer] = []

    async def main() -> None:
        with anyio.move_on_after(rng.uniform(0.0, 0.05)):
            async with open_uploader(devices, ring_config(2, MiB), 4) as up:
                for t in targets:
                    allocated.append(await up.allocate(t.device, t.payload.nbytes))
                work = [(j, b) for t, b in zip(targets, allocated, strict=True) for j in t.jobs]
                await up.transfer(work, fill_from(targets))
                # Finished before the deadline: the buffers are ours to free.
                allocated_now = list(allocated)
            for buf in allocated_now:
                buf.close()

    anyio.run(main)
    assert all(isinstance(b, CupyDeviceBuffer) and b.closed for b in allocated)
    assert not [t for t in threading.enumerate() if t.name.startswith("aiogguf-")]
