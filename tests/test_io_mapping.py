"""FileMapping: exact mapped extents, views, touch, mlock (and its low-limit path)."""

from __future__ import annotations

import errno
import gc
import os
import resource
from pathlib import Path

import numpy as np
import pytest

import aiogguf.io.mapping as mapping_module
from aiogguf.errors import ClosedResourceError, LoadError
from aiogguf.io import _libc
from aiogguf.io.buffers import PAGE_BYTES, ResourceState
from aiogguf.io.files import align_down, align_up, open_file
from aiogguf.io.mapping import (
    FileMapping,
    LockResult,
    MapAdvice,
    may_lock_past_limit,
    memlock_limit,
    numa_nodes,
    open_mapping,
)
from aiogguf.io.pagecache import drop_from_cache, resident_bytes

SIZE = 7 * PAGE_BYTES + 100


class _Payload(bytes):
    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "model.bin"
    payload = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    return path, _Payload(payload)


def _mapped_extents(path: Path) -> list[tuple[int, int]]:
    """(file offset, length) of every /proc/self/maps line that maps ``path``."""
    extents = []
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                extents.append((int(fields[2], 16), hi - lo))
    return extents


def _vm_locked_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.mark.parametrize(
    ("start", "end"),
    [(0, 10), (PAGE_BYTES + 10, 3 * PAGE_BYTES + 20), (2 * PAGE_BYTES, 4 * PAGE_BYTES), (5, SIZE)],
)
def test_only_the_page_aligned_range_is_mapped(
    data_file: tuple[Path, bytes], start: int, end: int
) -> None:
    path, payload = data_file
    with open_mapping(path, start, end) as m:
        assert m.map_start == align_down(start, PAGE_BYTES)
        assert m.map_end == min(align_up(end, PAGE_BYTES), SIZE)
        assert m.address % PAGE_BYTES == 0
        # The kernel shows whole pages: the range rounded out to pages, nothing more.
        assert _mapped_extents(path) == [(m.map_start, align_up(m.nbytes, PAGE_BYTES))]
        assert bytes(m.view(start, end - start)) == payload[start:end]
        assert m.as_array(start, end - start).tobytes() == payload[start:end]
    assert _mapped_extents(path) == []


def test_views_are_read_only_and_bounded(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    with open_mapping(path, PAGE_BYTES, 2 * PAGE_BYTES) as m:
        view = m.view(PAGE_BYTES + 3, 5)
        assert view.readonly
        assert bytes(view) == payload[PAGE_BYTES + 3 : PAGE_BYTES + 8]
        with pytest.raises(TypeError):
            view[0] = 1
        with pytest.raises(ValueError, match="outside the mapped range"):
            m.view(0, 10)
        with pytest.raises(ValueError, match="outside the mapped range"):
            m.view(2 * PAGE_BYTES - 1, 2)
        view.release()


def test_writable_mapping_is_private_copy_on_write(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    with open_mapping(path, 0, 3 * PAGE_BYTES, writable=True) as m:
        array = m.as_array(100, 8)
        array[:] = array[::-1].copy()  # an in-place byte swap, as for big-endian files
        assert array.tobytes() == payload[100:108][::-1]
        del array
    assert path.read_bytes() == payload  # the file itself never changes


def test_bad_ranges(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with pytest.raises(LoadError, match=f"the file has only {SIZE} bytes"):
        open_mapping(path, 0, SIZE + 1)
    with pytest.raises(ValueError, match="empty or reversed"):
        open_mapping(path, 10, 10)
    with pytest.raises(LoadError, match="cannot open"):
        open_mapping(path.with_name("missing.bin"), 0, 1)


def test_close_is_idempotent_and_use_after_close_is_clear(data_file: tuple[Path, bytes]) -> None:
    m = open_mapping(data_file[0], 0, 100)
    m.close()
    m.close()
    assert m.state is ResourceState.CLOSED
    assert m.unmapped
    for call in (
        lambda: m.view(0, 1),
        lambda: m.touch(),
        lambda: m.lock(),
        lambda: m.advise(MapAdvice.RANDOM),
    ):
        with pytest.raises(ClosedResourceError, match="FileMapping"):
            call()


def test_close_with_live_views_defers_the_unmap(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    m = open_mapping(path, 0, SIZE)
    array = m.as_array(PAGE_BYTES, 16)
    m.close()
    assert m.state is ResourceState.CLOSED
    assert not m.unmapped
    assert len(_mapped_extents(path)) == 1
    assert array.tobytes() == payload[PAGE_BYTES : PAGE_BYTES + 16]  # still valid memory
    del array
    gc.collect()
    assert m.unmapped
    assert _mapped_extents(path) == []


def test_resource_warning_when_collected_unclosed(data_file: tuple[Path, bytes]) -> None:
    with pytest.warns(ResourceWarning, match="unclosed <FileMapping"):
        FileMapping(data_file[0], 0, 10)  # dropped at once: refcounting, no cycle


def test_advise_every_kind_on_sub_ranges(data_file: tuple[Path, bytes]) -> None:
    with open_mapping(data_file[0], 100, SIZE) as m:
        for advice in MapAdvice:
            m.advise(advice)
            m.advise(advice, PAGE_BYTES + 1, 2 * PAGE_BYTES + 1)
        with pytest.raises(ValueError, match="outside the mapped range"):
            m.advise(MapAdvice.WILLNEED, 0, SIZE + 1)


@pytest.mark.parametrize("use_populate", [True, False])
def test_touch_makes_the_range_resident(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, use_populate: bool
) -> None:
    monkeypatch.setattr(mapping_module, "_populate_read_works", use_populate)
    path = disk_dir / f"touch-{use_populate}.bin"
    nbytes = 8 << 20
    path.write_bytes(np.random.default_rng(4).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    try:
        assert drop_from_cache(path)
        start, end = (1 << 20) + 5, (5 << 20) + 7
        with open_mapping(path, start, end) as m:
            m.advise(MapAdvice.RANDOM)  # no read-ahead, so only touched pages count
            assert resident_bytes(path, start, end - start) < (1 << 20)
            assert m.touch(start, start + (2 << 20)) >= 2 << 20
            assert m.touch(start + (2 << 20), end) > 0
            assert resident_bytes(path, start, end - start) == end - start
        assert resident_bytes(path) < nbytes  # pages outside the range were not read
    finally:
        path.unlink()


def test_populate_reads_the_range_in(disk_dir: Path) -> None:
    path = disk_dir / "populate.bin"
    path.write_bytes(b"\x01" * (2 << 20))
    try:
        assert drop_from_cache(path)
        with open_mapping(path, 0, 1 << 20, populate=True):
            assert resident_bytes(path, 0, 1 << 20) == 1 << 20
    finally:
        path.unlink()


def test_lock_counts_pages_once_and_close_unlocks(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    before = _vm_locked_kib()
    with open_mapping(path, 0, SIZE) as m:
        first = m.lock(10, PAGE_BYTES + 10)  # two pages
        assert first.ok
        assert first.problem is None
        assert first.requested_bytes == 2 * PAGE_BYTES
        assert first.locked_bytes == 2 * PAGE_BYTES
        second = m.lock(PAGE_BYTES, 3 * PAGE_BYTES)  # overlaps one page
        assert second.locked_bytes == 3 * PAGE_BYTES
        assert m.locked_bytes == 3 * PAGE_BYTES
        assert first.limit_bytes == memlock_limit()
        assert _vm_locked_kib() - before == 3 * PAGE_BYTES // 1024
    assert _vm_locked_kib() == before


def test_lock_on_fault_locks_the_range_and_close_unlocks(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    before = _vm_locked_kib()
    with open_mapping(path, 0, SIZE) as m:
        assert not m.is_locked(0, PAGE_BYTES)
        result = m.lock(PAGE_BYTES, 3 * PAGE_BYTES, on_fault=True)
        assert result.ok
        assert result.locked_bytes == 2 * PAGE_BYTES
        assert _vm_locked_kib() - before == 2 * PAGE_BYTES // 1024
        assert m.is_locked(PAGE_BYTES + 1, 2 * PAGE_BYTES)
        assert not m.is_locked(0, 2 * PAGE_BYTES)  # the first page is not locked
        m.touch(PAGE_BYTES, 3 * PAGE_BYTES)
        assert bytes(m.view(PAGE_BYTES, 16)) == data[PAGE_BYTES : PAGE_BYTES + 16]
    assert _vm_locked_kib() == before


def test_lock_on_fault_where_the_kernel_cannot_raises_enosys(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller then locks as it reads; nothing was locked.
    monkeypatch.setattr(_libc, "_mlock2", None)
    with open_mapping(data_file[0], 0, SIZE) as m:
        with pytest.raises(OSError, match="mlock2") as raised:
            m.lock(on_fault=True)
        assert raised.value.errno == errno.ENOSYS
        assert m.locked_bytes == 0


def test_lock_over_the_limit_is_a_clear_result(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root has CAP_IPC_LOCK and ignores RLIMIT_MEMLOCK, so simulate what the kernel
    # answers an unprivileged process over its limit.
    def refuse(address: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    # A copy-on-write mapping locks through mlock2 (mlock would copy its pages).
    monkeypatch.setattr(_libc, "mlock", refuse)
    monkeypatch.setattr(_libc, "mlock2", lambda address, length, flags: refuse(address, length))
    monkeypatch.setattr(mapping_module, "memlock_limit", lambda: 64 * 1024)
    with open_mapping(data_file[0], 0, SIZE) as m:
        result = m.lock()
    assert not result.ok
    assert result.requested_bytes == align_up(SIZE, PAGE_BYTES)
    assert result.locked_bytes == 0
    assert result.limit_bytes == 64 * 1024
    assert result.problem is not None
    assert f"({align_up(SIZE, PAGE_BYTES)} bytes;" in result.problem
    assert "RLIMIT_MEMLOCK is 64" in result.problem
    assert "ulimit -l" in result.problem
    assert "LimitMEMLOCK=" in result.problem


def test_lock_other_errors_are_load_errors(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(address: int, length: int) -> None:
        raise OSError(errno.EFAULT, "Bad address")

    monkeypatch.setattr(_libc, "mlock", broken)
    monkeypatch.setattr(_libc, "mlock2", lambda address, length, flags: broken(address, length))
    with open_mapping(data_file[0], 0, 10) as m, pytest.raises(LoadError, match="mlock failed"):
        m.lock()


def test_memlock_limit_reads_the_soft_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    expected = None if soft == resource.RLIM_INFINITY else soft
    assert memlock_limit() == expected


def test_numa_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert numa_nodes() >= 1
    for name in ("node0", "node1", "nodeX", "possible"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(mapping_module, "_NODE_DIR", tmp_path)
    numa_nodes.cache_clear()  # read once per process
    assert numa_nodes() == 2
    monkeypatch.setattr(mapping_module, "_NODE_DIR", tmp_path / "absent")
    numa_nodes.cache_clear()
    assert numa_nodes() == 1
    numa_nodes.cache_clear()


def test_may_lock_past_limit_reads_the_effective_capabilities() -> None:
    with open("/proc/self/status", encoding="ascii") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    assert may_lock_past_limit() is bool(caps & (1 << 14))


def test_mapping_from_an_open_data_file_outlives_it(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    with open_file(path) as f:
        m = open_mapping(f, 10, 5000)
    with m:
        assert bytes(m.view(10, 4990)) == payload[10:5000]


def test_lock_result_is_truthy_only_when_ok() -> None:
    assert LockResult(True, 4096, 4096, None)
    assert not LockResult(False, 4096, 0, 65536, "too low")
