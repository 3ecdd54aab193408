"""Full offload through the engine, on simulated GPUs that carry a real GPU's costs: the
staging pool is shared by the loads of a process, ``warm_up`` fills it, a cancelled load
leaves nothing beyond it, and the event loop never runs device discovery.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import gguf
import pytest
from upload_helpers import buffers_in_use

import aiogguf
from aiogguf._config import Config
from aiogguf._devices import enumerate_devices
from aiogguf.io._devices import cupy_backend
from aiogguf.io._devices.pool import staging_pool, staging_pools
from aiogguf.io._devices.sim import SimDevice, SimDeviceBuffer
from aiogguf.testing.synth import write_synthetic_model

MiB = 1024**2
# Small slots so that a 6 MiB model makes many jobs per transfer thread.
OFFLOAD = {"n_gpu_layers": -1, "staging_buffer_size": "256KiB", "readers": 2}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("offload") / "m.gguf"
    return write_synthetic_model(path, size_bytes="6MiB", seed=9, n_layer=4).path


def _sim(config: Config) -> SimDevice:
    found = [d for d in enumerate_devices(config) if isinstance(d, SimDevice)]
    assert len(found) == 1
    return found[0]


def _assert_bytes(model: aiogguf.Model, path: Path) -> None:
    for tensor in gguf.GGUFReader(path).tensors:
        assert bytes(model.raw(tensor.name)) == tensor.data.tobytes(), tensor.name


def test_second_load_allocates_and_pins_nothing(model_path: Path) -> None:
    """Issue 23's must-show, on the sim: the second load of a model takes its device
    memory from the arena the first one's close filled, and its slots from the pool, so
    it allocates and pins nothing and makes no device-wide synchronisation."""
    overrides: dict[str, Any] = {**OFFLOAD, "sim_gpus": ["1GiB"]}
    sim = _sim(Config().with_overrides(sim_gpus=["1GiB"]))
    pinned, allocated, syncs = [], [], []
    for _ in range(2):
        before = sim.syncs.count
        with aiogguf.load_sync(model_path, **overrides) as model:
            (upload,) = model.report.uploads
            assert upload.device == "g0"
            on_device = sum(t.nbytes for t in model.plan.tensors if t.device == "g0")
            # Jobs carry the padding between tensors too; token embeddings stay on the CPU.
            assert on_device <= upload.bytes_copied < model.report.nbytes
            assert upload.copies >= upload.bytes_copied // (256 * 1024)
            pinned.append(upload.pinned_bytes_allocated)
            allocated.append(upload.device_bytes_allocated)
            syncs.append(sim.syncs.count - before)
            _assert_bytes(model, model_path)
    # Two threads, two slots each, pinned by the first load and reused by the second.
    assert pinned == [4 * 256 * 1024, 0]
    # The first load allocated its buffers (each a cudaMalloc: a device-wide
    # synchronisation); closing the model gave them to the arena, not back to the device.
    on_device = sum(b.nbytes for b in model.report.buffers if b.device == "g0")
    assert allocated[0] >= on_device > 0
    assert allocated[1] == 0
    assert syncs[0] >= 1
    assert syncs[1] == 0
    assert staging_pool(sim).stats().slots == 4
    assert buffers_in_use(sim) == 0
    aiogguf.release_device_memory_sync()
    assert sim.live.buffers == 0


def test_warm_up_fills_the_pool_so_the_first_load_pins_nothing(model_path: Path) -> None:
    overrides: dict[str, Any] = {**OFFLOAD, "sim_gpus": ["1GiB"]}
    warm = aiogguf.warm_up_sync(**overrides)
    assert warm.devices == ("g0",)
    assert warm.pinned_bytes == 4 * 256 * 1024
    assert aiogguf.warm_up_sync(**overrides).pinned_bytes == 0  # already there
    with aiogguf.load_sync(model_path, **overrides) as model:
        assert model.report.uploads[0].pinned_bytes_allocated == 0
    aiogguf.release_staging_sync()
    assert staging_pools() == ()
    assert _sim(Config().with_overrides(sim_gpus=["1GiB"])).live.slots == 0


@pytest.mark.asyncio
async def test_warm_up_runs_off_the_loop_and_concurrent_loads_share_the_pool(
    model_path: Path,
) -> None:
    overrides: dict[str, Any] = {**OFFLOAD, "sim_gpus": ["1GiB"], "staging_pool_size": "1MiB"}
    await aiogguf.warm_up(**overrides)
    models: list[aiogguf.Model] = []

    async def one() -> None:
        async with aiogguf.load(model_path, **overrides) as model:
            _assert_bytes(model, model_path)
            models.append(model)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        tg.start_soon(one)
    assert len(models) == 2
    # Both fit in the 1 MiB cap the pool was filled to: nothing more was pinned.
    assert [m.report.uploads[0].pinned_bytes_allocated for m in models] == [0, 0]
    stats = staging_pool(_sim(Config().with_overrides(sim_gpus=["1GiB"]))).stats()
    assert stats.pinned_bytes <= MiB
    assert stats.leased_slots == 0


@pytest.mark.parametrize("seed", range(6))
def test_cancel_mid_offload_leaves_nothing_beyond_the_pool(model_path: Path, seed: int) -> None:
    # 20 MB/s copies: the load takes ~300 ms of copying, and with every slot busy the
    # transfer threads land jobs at that pace (progress comes every 50 ms); cancel
    # somewhere inside it.
    overrides: dict[str, Any] = {
        **OFFLOAD,
        "sim_gpus": [f"free=1GiB,bandwidth=20MB,max_delay_ms=0.5,id=seed{seed}"],
    }
    entered = False
    sim = _sim(Config().with_overrides(sim_gpus=overrides["sim_gpus"]))
    progressed = anyio.Event()

    def on_progress(event: aiogguf.Progress) -> None:
        if event.bytes_done > 0 and event.bytes_done > seed * 800_000:
            progressed.set()

    async def main() -> None:
        async with anyio.create_task_group() as tg:

            async def load() -> None:
                nonlocal entered
                async with aiogguf.load(model_path, progress=on_progress, **overrides):
                    entered = True
                    await anyio.sleep_forever()

            tg.start_soon(load)
            with anyio.fail_after(30):
                await progressed.wait()
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert not entered, "cancelled after the load had finished"
    assert buffers_in_use(sim) == sim.live.streams == 0
    stats = staging_pool(sim).stats()
    assert stats.leased_slots == 0
    assert sim.live.slots == stats.slots
    assert not [t for t in threading.enumerate() if t.name.startswith("aiogguf-")]


def test_device_discovery_never_runs_on_the_event_loop(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CuPy's import stand-in blocks until the loop has ticked: on the loop's own
    thread it could never return (the test would time out instead)."""
    seen: list[str] = []

    async def main() -> None:
        ticked = threading.Event()
        loop_thread = threading.current_thread()

        def slow_import() -> None:
            seen.append(threading.current_thread().name)
            assert threading.current_thread() is not loop_thread
            if not ticked.wait(10):
                raise AssertionError("the event loop did not run while CuPy was imported")
            return None  # no CuPy: a CPU load

        async def tick() -> None:
            await anyio.sleep(0.01)
            ticked.set()

        monkeypatch.setattr(cupy_backend, "import_cupy", slow_import)
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            async with aiogguf.load(model_path, n_gpu_layers=-1) as model:
                assert model.report.uploads == ()
                assert {b.device for b in model.plan.buffers} == {"CPU"}

    anyio.run(main)
    assert len(seen) == 1


def test_device_jobs_fill_whole_slots_however_little_stays_on_the_host(
    tmp_path: Path,
) -> None:
    """A full offload leaves the host a few MiB: host jobs are then cut small, to share
    them among the readers, but device jobs still fill a whole slot each (a copy per
    MiB would multiply the per-copy costs)."""
    path = write_synthetic_model(tmp_path / "m.gguf", size_bytes="48MiB", seed=5, n_layer=2).path
    with aiogguf.load_sync(
        path, n_gpu_layers=-1, sim_gpus=["1GiB"], staging_buffer_size="16MiB", readers=2
    ) as model:
        (upload,) = model.report.uploads
        host = sum(t.nbytes for t in model.plan.tensors if t.device == "CPU")
        assert host < 16 * MiB  # the host part alone would make jobs of a few MiB
        tensors = [t for t in model.plan.tensors if t.device == "g0"]
        # Every copy fills its slot but the last of each range: at most one more copy
        # per tensor group than whole slots.
        assert upload.copies <= upload.bytes_copied // (16 * MiB) + len(tensors), (
            upload.copies,
            upload.bytes_copied,
        )
        _assert_bytes(model, path)


def test_device_tensors_are_checked_in_their_slots_not_fetched_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot is checked in pieces as it fills; a unit that straddles two pieces is
    checked once both have landed, in the slot. Only the units that straddle two jobs
    are copied back from the device when their tensor is finished (a device-to-host copy
    each: on a GPU, a round trip through the driver)."""
    path = write_synthetic_model(tmp_path / "m.gguf", size_bytes="48MiB", seed=6, n_layer=2).path
    fetched = 0
    to_host = SimDeviceBuffer.to_host

    def counted(self: SimDeviceBuffer, offset: int, nbytes: int) -> memoryview:
        nonlocal fetched
        fetched += 1
        return to_host(self, offset, nbytes)

    monkeypatch.setattr(SimDeviceBuffer, "to_host", counted)
    with aiogguf.load_sync(
        path, n_gpu_layers=-1, sim_gpus=["1GiB"], staging_buffer_size="16MiB", check_tensors=True
    ) as model:
        (upload,) = model.report.uploads
        assert model.report.validated == len(model.plan.tensors)
        # 48 MiB in 512 KiB pieces would leave about a hundred straddling units.
        assert fetched <= upload.copies, (fetched, upload.copies)
