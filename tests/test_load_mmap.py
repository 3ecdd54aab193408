"""``mode="mmap"``: only host-resident tensors' file ranges are mapped (lazy ones too);
the ranges of tensors offloaded to (simulated) GPUs never are. Checked in
``/proc/self/maps`` during the load (from the progress callback) and while the model is
open; after close nothing of the file is mapped."""

from __future__ import annotations

import errno
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

import aiogguf
from aiogguf._events import Progress
from aiogguf._images import MappedImage
from aiogguf.io import _libc
from aiogguf.io.buffers import PAGE_BYTES
from aiogguf.io.mapping import may_lock_past_limit, memlock_limit
from aiogguf.testing.synth import SynthModel, write_synthetic_model

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class Extent:
    """A mapping of the file: file bytes ``[start, end)``."""

    start: int
    end: int
    perms: str


def mapped_extents(path: Path) -> list[Extent]:
    """Every mapping of ``path`` in this process, as file offset ranges."""
    st = os.stat(path)
    out: list[Extent] = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or int(parts[4]) != st.st_ino:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            offset = int(parts[2], 16)
            out.append(Extent(offset, offset + hi - lo, parts[1]))
    return out


def _down(x: int) -> int:
    return x - x % PAGE_BYTES


def _up(x: int) -> int:
    return -(-x // PAGE_BYTES) * PAGE_BYTES


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def check_extents(model: aiogguf.Model, extents: list[Extent]) -> None:
    """Every extent lies inside a page-aligned host range; no offloaded tensor byte
    outside the pages it shares with host ranges is mapped."""
    host = [
        (_down(r.start), _up(r.end))
        for b in model.plan.buffers
        if b.host
        for r in b.ranges
        if r.file_index == 0
    ]
    assert host, "the plan keeps nothing on the host"
    for e in extents:
        assert any(lo <= e.start and e.end <= hi for lo, hi in host), (e, host)
    offloaded = [n for b in model.plan.buffers if not b.host for n in b.tensors]
    assert offloaded, "the plan offloads nothing"
    for name in offloaded:
        entry = model.index[name]
        # Pages the tensor shares with host ranges may be mapped; its other pages not.
        for page in range(_down(entry.offset), _up(entry.end), PAGE_BYTES):
            if any(_overlap(page, page + PAGE_BYTES, lo, hi) for lo, hi in host):
                continue
            for e in extents:
                assert not _overlap(page, page + PAGE_BYTES, e.start, e.end), (name, page, e)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("mmap") / "m.gguf"
    return write_synthetic_model(path, size_bytes="8MiB", seed=9, n_layer=6)


@pytest.mark.asyncio
@pytest.mark.parametrize("lazy", ["off", "auto"])
async def test_only_host_ranges_are_mapped(model_file: SynthModel, lazy: str) -> None:
    path = model_file.path
    assert mapped_extents(path) == []
    during: list[list[Extent]] = []

    def on_progress(event: Progress) -> None:
        during.append(mapped_extents(path))

    async def poll(stop: anyio.Event) -> None:
        """Snapshot the maps while the load runs (its reads yield to the loop)."""
        while not stop.is_set():
            during.append(mapped_extents(path))
            await anyio.sleep(0.002)

    handle = aiogguf.load(
        path,
        mode="mmap",
        sim_gpus=["1GiB", "1GiB"],
        n_gpu_layers=4,
        lazy=lazy,
        lazy_min_bytes="256KiB",
        chunk_size="64KiB",
        progress=on_progress,
    )
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(poll, stop)
        model = await handle.__aenter__()
        stop.set()
    try:
        assert model.report.mode == "mmap"
        devices = {b.device for b in model.plan.buffers if not b.host}
        assert len(devices) == 2, model.plan.buffers
        if lazy == "auto":
            assert any(b.lazy and b.host for b in model.plan.buffers), model.plan.buffers
        now = mapped_extents(path)
        assert now, "an mmap load maps its host ranges"
        # Mapped bytes ~ host bytes: never the whole file.
        host_ranges = [r for b in model.plan.buffers if b.host for r in b.ranges]
        mapped = sum(e.end - e.start for e in now)
        assert mapped <= sum(r.nbytes for r in host_ranges) + 2 * PAGE_BYTES * len(host_ranges)
        check_extents(model, now)
        snapshots = [ext for ext in during if ext]
        assert len(snapshots) >= 2, len(during)
        for ext in snapshots:
            check_extents(model, ext)
        # Every tensor reads back as the file's bytes, offloaded and lazy alike.
        data = path.read_bytes()
        for t in model_file.tensors:
            want = data[t.file_offset : t.file_offset + t.nbytes]
            assert bytes(model.raw(t.name)) == want, t.name
    finally:
        await handle.__aexit__(None, None, None)
    assert mapped_extents(path) == []


def test_host_only_mmap_maps_only_tensor_data(model_file: SynthModel) -> None:
    """Without GPUs the mapping starts at the data, not at the header."""
    with aiogguf.load_sync(model_file.path, mode="mmap", n_gpu_layers=0) as model:
        extents = mapped_extents(model_file.path)
        first = min(t.file_offset for t in model_file.tensors)
        assert extents
        assert min(e.start for e in extents) >= _down(first)
        check_host = [(_down(r.start), _up(r.end)) for b in model.plan.buffers for r in b.ranges]
        for e in extents:
            assert any(lo <= e.start and e.end <= hi for lo, hi in check_host)
    assert mapped_extents(model_file.path) == []


def _vm_locked_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


def _host_range_bytes(model: aiogguf.Model) -> int:
    return sum(_up(r.end) - _down(r.start) for b in model.plan.buffers for r in b.ranges)


@pytest.mark.skipif(
    not may_lock_past_limit() and memlock_limit() is not None,
    reason="needs CAP_IPC_LOCK or an unlimited RLIMIT_MEMLOCK to lock a model",
)
def test_mlock_locks_every_host_range_and_close_unlocks(model_file: SynthModel) -> None:
    """Mode ``mlock`` locks each job's pages as it reads them: every host range is
    locked when the load returns, with no warning, and nothing is locked after close."""
    before = _vm_locked_bytes()
    with aiogguf.load_sync(model_file.path, mode="mlock", n_gpu_layers=0) as model:
        assert not model.report.warnings
        locked = _vm_locked_bytes() - before
        # Whole pages of every range; neighbouring ranges may share a page.
        ranges = sum(len(b.ranges) for b in model.plan.buffers)
        assert _host_range_bytes(model) - PAGE_BYTES * ranges <= locked
        assert locked <= _host_range_bytes(model)
        data = model_file.path.read_bytes()
        for t in model_file.tensors:
            assert bytes(model.raw(t.name)) == data[t.file_offset : t.file_offset + t.nbytes]
    assert _vm_locked_bytes() == before


def test_mlock_locks_each_range_on_fault_and_populates_it_whole(
    model_file: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode ``mlock`` asks once per mapped range for its pages to be locked as they are
    faulted in, then populates the jobs as mode ``mmap`` does: no ``mlock`` per job
    (which would take the memory map for writing and wait for every populate under
    way), and every page is resident and locked when the load returns."""
    calls: dict[str, list[int]] = {"mlock": [], "mlock2": []}
    real_mlock, real_mlock2 = _libc.mlock, _libc.mlock2

    def mlock(address: int, length: int) -> None:
        calls["mlock"].append(length)
        real_mlock(address, length)

    def mlock2(address: int, length: int, flags: int) -> None:
        calls["mlock2"].append(flags)
        real_mlock2(address, length, flags)

    monkeypatch.setattr(_libc, "mlock", mlock)
    monkeypatch.setattr(_libc, "mlock2", mlock2)
    with aiogguf.load_sync(
        model_file.path, mode="mlock", n_gpu_layers=0, readers=2, chunk_size="1MiB"
    ) as model:
        ranges = sum(len(b.ranges) for b in model.plan.buffers)
        assert calls == {"mlock": [], "mlock2": [_libc.MLOCK_ONFAULT] * ranges}
        for image in model._images:
            assert isinstance(image, MappedImage)
            for mapping in image.mappings:
                size = mapping.map_end - mapping.map_start  # address maps map_start
                resident = _libc.mincore(mapping.address, -(-size // PAGE_BYTES) * PAGE_BYTES)
                assert all(page & 1 for page in resident)
                assert mapping.is_locked(mapping.file_start, mapping.file_end)


def test_a_refused_lock_is_one_warning_and_the_load_goes_on(
    model_file: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over ``RLIMIT_MEMLOCK`` the kernel refuses: locking on fault when the ranges are
    mapped, then the first job's lock (on fault too: a plain ``mlock`` of a copy-on-write
    mapping would copy its pages). The load warns once, stops asking, and still makes
    every page resident."""
    calls: list[int] = []
    on_fault: list[int] = []

    def refuse(address: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    def refuse_on_fault(address: int, length: int, flags: int) -> None:
        on_fault.append(flags)
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(_libc, "mlock", refuse)
    monkeypatch.setattr(_libc, "mlock2", refuse_on_fault)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with aiogguf.load_sync(
            model_file.path, mode="mlock", n_gpu_layers=0, readers=1, chunk_size="1MiB"
        ) as model:
            unlocked = [w for w in model.report.warnings if "rest unlocked" in w]
            assert len(unlocked) == 1
            assert "RLIMIT_MEMLOCK" in unlocked[0]
            assert calls == []
            # One refusal per stage: the rest of the load does not ask again.
            assert on_fault == [_libc.MLOCK_ONFAULT] * 2
            data = model_file.path.read_bytes()
            for t in model_file.tensors:
                assert bytes(model.raw(t.name)) == data[t.file_offset : t.file_offset + t.nbytes]
    said = [str(w.message) for w in caught if w.category is aiogguf.LoadWarning]
    assert [m for m in said if "rest unlocked" in m] == unlocked


def test_mapped_jobs_are_not_cut_at_the_read_chunk(model_file: SynthModel) -> None:
    """A mapped job is one populate call: with checks off, ``chunk_size`` (a read's size)
    does not cut it, while the same setting cuts a buffered load into many reads. With
    checks on, mapped tensors are checked as their jobs land: ``chunk_size`` holds."""
    items = {}
    for mode, checks in (("none", False), ("mmap", False), ("mmap", True)):
        with aiogguf.load_sync(
            model_file.path, mode=mode, n_gpu_layers=0, check_tensors=checks, chunk_size="1MiB"
        ) as model:
            assert model.report.nbytes > 6 * 2**20
            items[mode, checks] = model.report.stage("read").items
    assert items["none", False] >= 6, items
    # The 8 MiB model spread over its readers: one job per reader and range at most.
    assert items["mmap", False] < items["none", False] / 2, items
    assert items["mmap", True] == items["none", False], items
