"""What a process's first GPU load costs, told honestly by the simulated GPU and the CuPy
stand-in (issue 23), and what that revealed:

* CUDA's start-up (``cuInit``) and a device's first context hold the GIL: the stand-in
  holds it too, in one C call (a pure-Python thread makes no progress meanwhile);
* a driver pins one buffer at a time per device: so do the sim and the stand-in;
* CuPy's ``Memory`` cannot be weakly referenced: the stand-in's cannot either, and
  ``memory_held_by_views`` still tells a closed GPU model with no array left (no
  ``gc.collect`` after the next failed load) from one whose arrays live on;
* CuPy runs a kernel only on an array of the current device: the stand-in refuses the
  others too, and the checks of byte-swapped tensors on a second GPU make it current.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from stand_ins import cupy_stand_in

import aiogguf
from aiogguf import _api as api
from aiogguf.errors import TensorValidationError
from aiogguf.io._devices import cupy_backend
from aiogguf.io._devices.cupy_backend import forget_cupy_devices
from aiogguf.io._devices.sim import SimDevice
from aiogguf.io.buffers import memory_held_by_views
from aiogguf.io.ggml_types import GGML_TYPES
from aiogguf.testing.synth import Corruption, SynthModel, write_synthetic_model

STAND_INS = Path(__file__).resolve().parent / "stand_ins"
MiB = 1024**2


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The CuPy stand-in as the backend's CuPy, with two devices."""
    module = cupy_stand_in()
    monkeypatch.setenv("STAND_IN_CUPY_DEVICES", "2")
    monkeypatch.setattr(cupy_backend, "import_cupy", lambda: module)
    forget_cupy_devices()
    try:
        yield module
    finally:
        aiogguf.release_device_memory_sync()  # its pools and arenas hold stand-in memory
        forget_cupy_devices()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("first") / "m.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=8, n_layer=2)


# --- CUDA's start-up holds the GIL ---------------------------------------------------------

_GIL_PROBE = """
import json, threading, time
import cupy

gap = 0.0
stop = False

def spin():
    global gap
    last = time.perf_counter()
    while not stop:  # pure Python: it runs only while it holds the GIL
        now = time.perf_counter()
        gap = max(gap, now - last)
        last = now

thread = threading.Thread(target=spin)
thread.start()
time.sleep(0.05)
gaps = {}
for name, call in (
    ("init", cupy.cuda.runtime.getDeviceCount),
    ("context", lambda: cupy.cuda.Stream(non_blocking=True)),
    ("warm", cupy.cuda.runtime.getDeviceCount),
):
    gap = 0.0
    time.sleep(0.02)
    began = time.perf_counter()
    call()
    took = time.perf_counter() - began
    time.sleep(0.02)
    gaps[name] = [gap, took]
stop = True
thread.join()
print(json.dumps(gaps))
"""


def test_stand_in_cuda_start_up_holds_the_gil() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(STAND_INS),
        "STAND_IN_CUPY_INIT_S": "0.3",
        "STAND_IN_CUPY_CONTEXT_S": "0.2",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _GIL_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    gaps = json.loads(proc.stdout)
    # The spinner stood still for as long as each start-up took: the GIL was held (a
    # sleep that let it go would leave gaps of a switch interval, 5 ms).
    assert gaps["init"][1] >= 0.3
    assert gaps["init"][0] >= 0.28
    assert gaps["context"][1] >= 0.2
    assert gaps["context"][0] >= 0.18
    # Once per process.
    assert gaps["warm"][1] < 0.05


# --- pinning, one buffer at a time per device ----------------------------------------------


def _pin_side_by_side(pin: Any, threads: int) -> float:
    """Seconds for ``threads`` threads to run ``pin()`` at once."""
    started = threading.Barrier(threads + 1)

    def run() -> None:
        started.wait()
        pin()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    started.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    return time.perf_counter() - began


def test_sim_pins_one_slot_at_a_time_per_device() -> None:
    sim = SimDevice("g0", pin_s_per_gib=1024 / 16 * 0.1)  # 16 MiB: 0.1 s
    other = SimDevice("g1", pin_s_per_gib=1024 / 16 * 0.1)
    slots: list[Any] = []
    took = _pin_side_by_side(lambda: slots.append(sim.open_staging_slot(0, 16 * MiB, 4096)), 3)
    assert took >= 0.29  # three pins in a row, not side by side
    # Another device's pins do not wait for this one's.
    both = _pin_side_by_side(
        lambda: slots.append((sim if len(slots) % 2 else other).open_staging_slot(0, MiB, 4096)),
        1,
    )
    assert both < 0.29
    for slot in slots:
        slot.close()


def test_stand_in_pins_one_buffer_at_a_time_per_device(
    stand_in: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stand_in.cuda, "PIN_S_PER_GIB", 1024 / 16 * 0.1)  # 16 MiB: 0.1 s
    kept: list[Any] = []
    took = _pin_side_by_side(lambda: kept.append(stand_in.cuda.PinnedMemory(16 * MiB)), 3)
    assert took >= 0.29


# --- memory held by views, when CuPy's Memory cannot be weakly referenced ------------------


def test_stand_in_memory_cannot_be_weakly_referenced(stand_in: Any) -> None:
    with pytest.raises(TypeError):
        weakref.ref(stand_in.cuda.Memory(16))
    owner = stand_in.cuda.Memory(16)
    with pytest.raises(TypeError):
        weakref.ref(stand_in.cuda.UnownedMemory(owner.ptr, 16, owner, 0))


def _counting_gc(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the full collections the load's caller runs (``api``'s ``gc.collect``)."""
    collected: list[int] = []
    fake = types.SimpleNamespace(collect=lambda *args: collected.append(1) or 0)
    monkeypatch.setattr(api, "gc", fake)
    return collected


@pytest.fixture(scope="module")
def bad_model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("bad") / "bad.gguf"
    clean = write_synthetic_model(path.with_name("clean.gguf"), size_bytes="2MiB", seed=8)
    (f16, *_) = [t for t in clean.tensors if GGML_TYPES[t.type_id].name == "F16"]
    return write_synthetic_model(
        path, size_bytes="2MiB", seed=8, corruptions=[Corruption(f16.name, "inf_element", 3)]
    )


@pytest.mark.parametrize("rig", ["sim", "stand-in"])
def test_closed_gpu_model_leaves_nothing_for_a_collection(
    rig: str,
    model: SynthModel,
    bad_model: SynthModel,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    overrides: dict[str, Any] = {"n_gpu_layers": -1, "mode": "none"}
    if rig == "sim":
        overrides["sim_gpus"] = ["name=g0,free=1GiB"]
    else:
        request.getfixturevalue("stand_in")
        overrides["main_gpu"] = 0
        overrides["split_mode"] = "none"
    memory_held_by_views()  # forget what earlier tests left to say
    with aiogguf.load_sync(model.path, **overrides) as loaded:
        assert loaded.report.uploads
    # Closed, and no array of it kept: nothing for a collection to free.
    assert not memory_held_by_views()
    collected = _counting_gc(monkeypatch)
    with pytest.raises(TensorValidationError), aiogguf.load_sync(bad_model.path, **overrides):
        pytest.fail("a model with a bad tensor must not be returned")
    assert collected == []
    # An array kept past its model's close holds device memory until it dies.
    with aiogguf.load_sync(model.path, **overrides) as loaded:
        name = next(t.name for t in loaded.plan.tensors if t.device != "CPU")
        kept = loaded.tensors[name]
    assert memory_held_by_views()
    with pytest.raises(TensorValidationError), aiogguf.load_sync(bad_model.path, **overrides):
        pass
    assert collected == [1]
    del kept
    assert not memory_held_by_views()


# --- kernels on the array's own device -----------------------------------------------------


def test_stand_in_refuses_a_kernel_on_an_array_of_another_device(stand_in: Any) -> None:
    cuda = stand_in.cuda
    with cuda.Device(1):
        mem = cuda.Memory(64)
        array = stand_in.ndarray((64,), dtype=np.uint8, memptr=cuda.MemoryPointer(mem, 0))
    assert array.device.id == 1
    array.view(np.uint16)[:2]  # no kernel: fine anywhere
    with pytest.raises(ValueError, match=r"resides \(1\) is different from the current device"):
        stand_in.bitwise_and(array, 3)
    with pytest.raises(ValueError, match="different from the current device"):
        stand_in.count_nonzero(array)
    with cuda.Device(1):
        assert int(stand_in.count_nonzero(stand_in.bitwise_and(array, 0))) == 0


def test_byte_swapped_tensors_on_a_second_gpu_are_checked_with_it_current(
    stand_in: Any, tmp_path: Path
) -> None:
    """Big-endian tensors are checked whole after the swap, as device arrays, on check
    threads whose current device is 0: without making the array's device current, every
    check of a tensor on CUDA1 raises."""
    m = write_synthetic_model(tmp_path / "be.gguf", size_bytes="1MiB", big_endian=True, seed=2)
    with aiogguf.load_sync(
        m.path, mode="none", n_gpu_layers=-1, split_mode="none", main_gpu=1, check_tensors=True
    ) as loaded:
        on_gpu = [t for t in loaded.plan.tensors if t.device == "CUDA1"]
        assert len(on_gpu) > len(loaded.plan.tensors) // 2
        assert loaded.report.validated == len(loaded.plan.tensors)
        for t in m.tensors:
            dtype = np.dtype(GGML_TYPES[t.type_id].element_dtype or "u2")
            with open(m.path, "rb") as f:
                f.seek(t.file_offset)
                on_disk = np.frombuffer(f.read(t.nbytes), np.uint8)
            swapped = on_disk.reshape(-1, dtype.itemsize)[:, ::-1].tobytes()
            assert bytes(loaded.raw(t.name)) == swapped, t.name
