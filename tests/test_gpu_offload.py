"""Full offload end to end, on a real GPU and on a simulated one.

Every test body takes a ``Rig``: the placement overrides that put the model on one GPU,
and how to read that GPU's arrays back. The ``cupy`` rig is a real CUDA device
(``gpu``-marked, skipped without CuPy and a device); the ``sim`` rig is a simulated GPU
and the ``cupy-stand-in`` rig the CuPy backend over ``stand_ins/cupy`` (CuPy's names on
host memory), and both run everywhere. Tests of issue 10's process-wide staging pool (a
second load pins nothing, concurrent loads share the pool, a cancelled load leaves
nothing pinned beyond it) run on every rig.

Oracles: the file's bytes (read with plain ``open``), and ``corrupt.expected_bad`` for
planted bad tensors (numpy's own float conversions, not the validator's bit masks).
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from corrupt import expected_bad
from upload_helpers import cupy_stand_in_backend

import aiogguf
from aiogguf._events import Progress
from aiogguf.errors import TensorValidationError
from aiogguf.io._devices.cupy_backend import (
    CupyCopyStream,
    cupy_devices,
    import_cupy,
)
from aiogguf.io._devices.sim import SimCopyStream
from aiogguf.io.ggml_types import GGML_TYPES
from aiogguf.stages.allocate import Allocation
from aiogguf.testing.synth import Corruption, SynthModel, write_synthetic_model

KiB = 1024
MiB = 1024 * KiB
SIM_GPU = "name=g0,free=2GiB"
# Small slots, so that even a small model is many copies (and a load can be cancelled
# half way); a pool capped at 4 slots per device, so that sharing can be told from not
# sharing (two loads of two threads with two slots each would want 8).
SLOT_BYTES = 64 * KiB
SLOTS = 4
STAGING = {
    "staging_buffer_size": SLOT_BYTES,
    "staging_buffers": 2,
    "staging_pool_size": SLOTS * SLOT_BYTES,
    "readers": 2,
}


@dataclass(frozen=True)
class Rig:
    """One GPU to offload to: ``overrides`` place every layer on it."""

    kind: str  # "cupy" or "sim"
    device: str  # its name in plans and reports
    overrides: dict[str, Any]
    stream_class: type
    cupy: Any = None

    def on_device(self, array: Any) -> bool:
        if self.cupy is not None:
            return isinstance(array, self.cupy.ndarray)
        return isinstance(array, np.ndarray)

    def to_host(self, array: Any) -> np.ndarray:
        if self.cupy is not None and isinstance(array, self.cupy.ndarray):
            host: np.ndarray = self.cupy.asnumpy(array)
            return host
        return np.asarray(array)


@pytest.fixture(
    params=[
        pytest.param("sim", id="sim"),
        pytest.param("stand-in", id="cupy-stand-in"),
        pytest.param("cupy", id="cupy", marks=pytest.mark.gpu),
    ]
)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    if request.param == "sim":
        yield Rig("sim", "g0", {"n_gpu_layers": -1, "sim_gpus": [SIM_GPU]}, SimCopyStream)
        return
    if request.param == "stand-in":
        # The CuPy backend end to end on a CPU: CuPy's names over host memory.
        with cupy_stand_in_backend() as stand_in:
            yield Rig("cupy", "CUDA0", {"n_gpu_layers": -1}, CupyCopyStream, stand_in)
        return
    cupy = import_cupy()
    if cupy is None:
        pytest.skip("CuPy is not installed")
    found = cupy_devices()
    if not found:
        pytest.skip("CuPy sees no CUDA device")
    if len(found) > 1:
        pytest.skip("one CUDA device expected (every layer must land on CUDA0)")
    yield Rig("cupy", found[0].name, {"n_gpu_layers": -1}, CupyCopyStream, cupy)


def pool_api() -> dict[str, Any]:
    """``warm_up_sync`` and ``release_staging_sync``."""
    return {"warm_up": aiogguf.warm_up_sync, "release": aiogguf.release_staging_sync}


@pytest.fixture
def fresh_pool() -> Iterator[dict[str, Any]]:
    """An empty staging pool before the test and after it (the pool is process-wide)."""
    api = pool_api()
    api["release"]()
    yield api
    gc.collect()
    api["release"]()


def live_staging_slots() -> list[Any]:
    """Staging slots of any device that are open now (pinned memory not yet freed):
    objects of a ``*StagingSlot`` class whose memory is still held (frozen ones too)."""
    gc.unfreeze()
    gc.collect()
    live = []
    for obj in gc.get_objects():
        cls = type(obj)
        if not cls.__name__.endswith("StagingSlot") or not cls.__module__.startswith("aiogguf"):
            continue
        # Sim slots hold a HostBuffer in _buffer, CuPy slots a view in _view; close()
        # drops it.
        if getattr(obj, "_buffer", None) is not None or getattr(obj, "_view", None) is not None:
            live.append(obj)
    return live


def file_bytes(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def assert_exact(model: Any, synth: SynthModel) -> None:
    for t in synth.tensors:
        assert bytes(model.raw(t.name)) == file_bytes(synth.paths[t.shard], t.file_offset, t.nbytes)


def uploads_of(model: Any, rig: Rig) -> Any:
    entries = {u.device: u for u in model.report.uploads}
    assert rig.device in entries, model.report.uploads
    return entries[rig.device]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("offload") / "m.gguf"
    return write_synthetic_model(path, size_bytes="8MiB", seed=5, n_layer=4)


# --- end to end ----------------------------------------------------------------------------


# Direct mode on a filesystem that refuses O_DIRECT (tmpfs) falls back to "none", warning.
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["none", "direct"])
def test_full_offload_holds_the_files_bytes(rig: Rig, model: SynthModel, mode: str) -> None:
    with aiogguf.load_sync(model.path, mode=mode, **rig.overrides) as loaded:
        offloaded = [b for b in loaded.report.buffers if b.device == rig.device]
        assert sum(b.nbytes for b in offloaded) > model.tensor_bytes // 2
        on_device = 0
        for t in model.tensors:
            want = file_bytes(model.paths[t.shard], t.file_offset, t.nbytes)
            array = loaded.tensors[t.name]
            if loaded.plan.placement(t.name).buffer_type == rig.device:
                assert rig.on_device(array), t.name
                on_device += 1
            # The array where it lives, copied back, and the raw bytes, both the file's.
            assert rig.to_host(array).tobytes() == want, t.name
            assert bytes(loaded.raw(t.name)) == want, t.name
        assert on_device > len(model.tensors) // 2


# --- planted bad tensors ------------------------------------------------------------------


@dataclass(frozen=True)
class Damaged:
    bad: SynthModel
    expected: dict[str, tuple[str, int, int]]  # name → (type, first bad index, count)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Damaged:
    d = tmp_path_factory.mktemp("bad")
    args: dict[str, Any] = {"size_bytes": "3MiB", "types": "all-types", "include_q2_0": False}
    clean = write_synthetic_model(d / "clean.gguf", seed=21, **args)

    def in_a_layer(type_name: str, last: bool = False) -> str:
        names = [t.name for t in clean.tensors_of_type(type_name) if t.name.startswith("blk.")]
        return names[-1 if last else 0]

    q4k, f16, q80, bf16 = (
        in_a_layer("Q4_K"),
        in_a_layer("F16", last=True),
        in_a_layer("Q8_0"),
        in_a_layer("BF16"),
    )
    corruptions = [
        Corruption(q4k, "nan_scale", 5),
        Corruption(q4k, "nan_scale", 9),
        Corruption(f16, "inf_element", 1234),
        Corruption(q80, "ff_fill", 17, length=3 * 34),  # three whole Q8_0 blocks of 0xFF
        Corruption(bf16, "bf16_nan", 77),
    ]
    bad = write_synthetic_model(d / "bad.gguf", seed=21, corruptions=corruptions, **args)
    expected: dict[str, tuple[str, int, int]] = {}
    for t in bad.tensors:
        ggml = GGML_TYPES[t.type_id]
        data = np.frombuffer(file_bytes(bad.path, t.file_offset, t.nbytes), np.uint8).copy()
        first, count = expected_bad(data, ggml)
        if count:
            assert first is not None
            expected[t.name] = (ggml.name, first, count)
    assert set(expected) == {q4k, f16, q80, bf16}
    return Damaged(bad, expected)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["none", "direct"])
def test_bad_tensors_are_found_on_the_device(rig: Rig, damaged: Damaged, mode: str) -> None:
    with aiogguf.load_sync(damaged.bad.path, mode=mode, keep_invalid=True, **rig.overrides) as m:
        # The planted tensors really went to the GPU, and every one was named.
        for name in damaged.expected:
            assert m.plan.placement(name).device == rig.device, name
        got = {f.name: (f.type_name, f.first_index, f.count) for f in m.failures}
        assert got == damaged.expected
    with (
        pytest.raises(TensorValidationError) as info,
        aiogguf.load_sync(damaged.bad.path, mode=mode, **rig.overrides),
    ):
        pytest.fail("a model with bad tensors must not be returned")
    got = {f.name: (f.type_name, f.first_index, f.count) for f in info.value.failures}
    assert got == damaged.expected


# --- the staging pool ------------------------------------------------------------------------


def test_second_load_pins_no_memory(rig: Rig, model: SynthModel, fresh_pool: Any) -> None:
    overrides = {**rig.overrides, **STAGING, "mode": "none"}
    with aiogguf.load_sync(model.path, **overrides) as first:
        pinned_first = uploads_of(first, rig).pinned_bytes_allocated
        assert_exact(first, model)
    with aiogguf.load_sync(model.path, **overrides) as second:
        entry = uploads_of(second, rig)
        assert_exact(second, model)
    assert pinned_first >= SLOT_BYTES  # the first load filled the empty pool
    assert entry.pinned_bytes_allocated == 0
    assert entry.bytes_copied >= model.tensor_bytes // 2
    assert entry.copies >= entry.bytes_copied // SLOT_BYTES


def test_transfers_wait_for_each_device_buffer_once(
    rig: Rig, model: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transfers wait for a device buffer's allocation once, not once per job: a wait
    on an event already set is still a trip through the event loop, and a load has
    dozens of jobs per buffer."""
    waits: list[int] = []
    ready = Allocation.ready

    async def counted(self: Allocation, k: int) -> Any:
        waits.append(k)
        return await ready(self, k)

    monkeypatch.setattr(Allocation, "ready", counted)
    overrides = {**rig.overrides, **STAGING, "mode": "none"}
    with aiogguf.load_sync(model.path, **overrides) as loaded:
        copies = uploads_of(loaded, rig).copies
        assert_exact(loaded, model)
    assert copies >= 8 * len(waits)  # many jobs per buffer: the case the test is about
    assert sorted(waits) == sorted(set(waits))  # each buffer once
    assert waits  # and the device buffers were waited for


def test_second_load_allocates_and_pins_nothing(
    rig: Rig, model: SynthModel, fresh_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23's must-show on every rig: closing a model gives its device memory to the
    device's arena, and the next load of the same model takes it from there and its
    slots from the pool, so it allocates no device memory and pins nothing. The oracle
    counts the backend's own calls (``cupy.cuda.Memory`` is a ``cudaMalloc``,
    ``PinnedMemory`` a ``cudaHostAlloc``), not only what the report says."""
    overrides = {**rig.overrides, **STAGING, "mode": "none"}
    made: list[tuple[str, int]] = []
    if rig.cupy is not None:
        for name in ("Memory", "PinnedMemory"):
            original = getattr(rig.cupy.cuda, name)

            def counted(size: int, *args: Any, _name: str = name, _made: Any = original) -> Any:
                made.append((_name, size))
                return _made(size, *args)

            monkeypatch.setattr(rig.cupy.cuda, name, counted)
    reports = []
    calls = []
    for _ in range(2):
        made.clear()
        with aiogguf.load_sync(model.path, **overrides) as loaded:
            reports.append(uploads_of(loaded, rig))
            assert_exact(loaded, model)
            on_device = sum(b.nbytes for b in loaded.report.buffers if b.device == rig.device)
        calls.append(list(made))
    first, second = reports
    assert first.device_bytes_allocated >= on_device > 0
    assert first.pinned_bytes_allocated >= SLOT_BYTES
    assert (second.device_bytes_allocated, second.pinned_bytes_allocated) == (0, 0)
    assert second.bytes_copied == first.bytes_copied
    if rig.cupy is not None:
        assert {name for name, _ in calls[0]} == {"Memory", "PinnedMemory"}
        assert sum(n for name, n in calls[0] if name == "Memory") == first.device_bytes_allocated
        assert calls[1] == []


def test_load_after_warm_up_pins_no_memory(rig: Rig, model: SynthModel, fresh_pool: Any) -> None:
    overrides = {**rig.overrides, **STAGING, "mode": "none"}
    warm = fresh_pool["warm_up"](None, **overrides)
    assert rig.device in warm.devices
    assert warm.pinned_bytes >= SLOT_BYTES
    assert live_staging_slots(), "the pool holds no slot after warm_up"
    with aiogguf.load_sync(model.path, **overrides) as loaded:
        assert uploads_of(loaded, rig).pinned_bytes_allocated == 0
        assert_exact(loaded, model)
    fresh_pool["release"]()
    assert live_staging_slots() == []


def test_concurrent_loads_share_the_pool(rig: Rig, model: SynthModel, fresh_pool: Any) -> None:
    overrides = {**rig.overrides, **STAGING, "mode": "none"}
    pinned: list[int] = []

    async def one() -> None:
        async with aiogguf.load(model.path, **overrides) as loaded:
            pinned.append(uploads_of(loaded, rig).pinned_bytes_allocated)
            await anyio.to_thread.run_sync(assert_exact, loaded, model)

    async def both() -> None:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one)
                tg.start_soon(one)

    anyio.run(both)
    assert len(pinned) == 2
    # One pool of SLOTS slots for both loads; two private rings would pin twice that.
    # (A slot may be over-allocated by a page, for alignment: hence the half.)
    assert sum(pinned) <= SLOTS * SLOT_BYTES * 3 // 2
    slots = live_staging_slots()
    assert 0 < len(slots) <= SLOTS


def test_cancel_mid_offload_leaves_nothing_beyond_the_pool(
    rig: Rig, model: SynthModel, fresh_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = {**rig.overrides, **STAGING, "mode": "none", "chunk_size": SLOT_BYTES}
    fresh_pool["warm_up"](None, **overrides)
    pool_slots = len(live_staging_slots())
    assert pool_slots > 0
    # The third copy holds its thread until the cancel is asked for: the load is then
    # cancelled with copies in flight and most of the model still to come, however fast
    # the device is.
    in_flight, cancel_asked = threading.Event(), threading.Event()
    calls = itertools.count()
    copy_async = rig.stream_class.copy_async

    def held_copy(stream: Any, *args: Any) -> None:
        copy_async(stream, *args)
        if next(calls) == 2:
            in_flight.set()
            cancel_asked.wait(10)

    monkeypatch.setattr(rig.stream_class, "copy_async", held_copy)
    seen: list[Progress] = []

    async def cancelled_load() -> None:
        with anyio.fail_after(60), anyio.CancelScope() as scope:

            async def canceller() -> None:
                await anyio.to_thread.run_sync(in_flight.wait, 30)
                scope.cancel()
                cancel_asked.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(canceller)
                async with aiogguf.load(model.path, progress=seen.append, **overrides):
                    pytest.fail("the load was cancelled half way: the body must not run")

    try:
        anyio.run(cancelled_load)
    finally:
        cancel_asked.set()
    assert in_flight.is_set()
    assert seen[-1].message == "cancelled"
    assert seen[-1].bytes_done < model.tensor_bytes
    monkeypatch.undo()
    # Only the pool's slots are left, and the pool still works: the next load is exact
    # and pins nothing.
    assert len(live_staging_slots()) <= max(pool_slots, SLOTS)
    with aiogguf.load_sync(model.path, **overrides) as loaded:
        assert uploads_of(loaded, rig).pinned_bytes_allocated == 0
        assert_exact(loaded, model)
    fresh_pool["release"]()
    assert live_staging_slots() == []
