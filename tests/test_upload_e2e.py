"""End to end through the engine: loads onto simulated GPUs (with random copy delays)
put exactly the file's bytes into every tensor, checked against ``gguf.GGUFReader``,
and leave no device memory, stream or copy thread behind (slots stay in the pool)."""

from __future__ import annotations

import threading
from pathlib import Path

import gguf
import pytest
from upload_helpers import buffers_in_use

from aiogguf.io._devices.cpu import CpuDevice
from aiogguf.io._devices.pool import staging_pools
from aiogguf.io._devices.sim import SimDevice, SimUsage
from aiogguf.testing.synth import write_synthetic_model

api = pytest.importorskip("aiogguf._api")

GiB = 1024**3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("e2e") / "m.gguf"
    return write_synthetic_model(path, size_bytes="3MiB", seed=5, n_layer=4).path


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["none", "direct", "mmap"])
@pytest.mark.parametrize("n_gpu_layers", [-1, 3])
async def test_sim_gpu_loads_hold_the_files_bytes(
    model_path: Path, mode: str, n_gpu_layers: int
) -> None:
    sims = [
        SimDevice(name, free=GiB, bandwidth=2_000_000_000, max_delay_ms=0.5, seed=i)
        for i, name in enumerate(("g0", "g1"))
    ]
    reader = gguf.GGUFReader(model_path)
    async with api.load(
        model_path,
        devices=[CpuDevice(), *sims],
        n_gpu_layers=n_gpu_layers,
        mode=mode,
        staging_buffers=2,
        staging_buffer_size="64KiB",
    ) as model:
        placed = {b.device for b in model.plan.buffers}
        assert placed & {"g0", "g1"}, placed
        assert all(d.live.buffers > 0 for d in sims if d.name in placed)
        for tensor in reader.tensors:
            assert bytes(model.raw(tensor.name)) == tensor.data.tobytes(), tensor.name
        uploads = {u.device: u for u in model.report.uploads}
        assert set(uploads) == placed & {"g0", "g1"}
        assert all(u.bytes_copied > 0 and u.copies > 0 for u in uploads.values())
    # The device memory is freed; the staging slots stay in the pools for the next load.
    assert all(buffers_in_use(d) == 0 and d.live.streams == 0 for d in sims)
    assert sum(d.live.slots for d in sims) == sum(p.stats().slots for p in staging_pools())
    assert all(p.stats().leased_slots == 0 for p in staging_pools())
    api.release_staging_sync()
    assert all(d.live == SimUsage(0, 0, 0, 0) for d in sims)
    assert not [t for t in threading.enumerate() if t.name.startswith("aiogguf-sim-copy")]
