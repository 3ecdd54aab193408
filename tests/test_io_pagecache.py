"""resident_bytes / fadvise_dontneed / drop_from_cache against a real disk and tmpfs."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import aiogguf.io.pagecache as pagecache
from aiogguf.errors import LoadError
from aiogguf.io.buffers import PAGE_BYTES
from aiogguf.io.pagecache import drop_from_cache, fadvise_dontneed, resident_bytes

SIZE = 6 * (1 << 20) + 1000
MIB2 = 2 << 20  # the kernel drops whole folios, up to 2 MiB on file systems with large folios


@pytest.fixture
def cached_file(disk_dir: Path) -> Iterator[Path]:
    path = disk_dir / "cache.bin"
    with open(path, "wb") as out:
        out.write(os.urandom(SIZE))
        out.flush()
        os.fsync(out.fileno())  # dirty pages cannot be dropped; clean ones can
    path.read_bytes()  # make every page resident
    yield path
    path.unlink()


def test_fully_cached_file_counts_exact_bytes(cached_file: Path) -> None:
    assert resident_bytes(cached_file) == SIZE
    # Partial pages count only for their part inside the range.
    assert resident_bytes(cached_file, 100, 5000) == 5000
    assert resident_bytes(cached_file, SIZE - 10) == 10
    assert resident_bytes(cached_file, 10, 10 * SIZE) == SIZE - 10
    assert resident_bytes(cached_file, SIZE + 5) == 0


def test_windows_do_not_change_the_answer(
    cached_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fadvise_dontneed(cached_file, MIB2, MIB2)
    whole = resident_bytes(cached_file, 7, SIZE - 20)
    assert whole < SIZE - 20
    monkeypatch.setattr(pagecache, "WINDOW_BYTES", 3 * PAGE_BYTES)
    assert resident_bytes(cached_file, 7, SIZE - 20) == whole


def test_dontneed_on_a_range_by_path_and_by_fd(cached_file: Path) -> None:
    fadvise_dontneed(cached_file, 0, MIB2)
    assert resident_bytes(cached_file, 0, MIB2) == 0
    assert resident_bytes(cached_file, MIB2) == SIZE - MIB2
    fd = os.open(cached_file, os.O_RDONLY)
    try:
        fadvise_dontneed(fd, 2 * MIB2)  # length 0: to the end
    finally:
        os.close(fd)
    assert resident_bytes(cached_file) == MIB2


def test_drop_from_cache_on_disk(cached_file: Path) -> None:
    assert drop_from_cache(cached_file)
    assert resident_bytes(cached_file) == 0


def test_drop_from_cache_is_false_on_tmpfs() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    with tempfile.NamedTemporaryFile(dir=shm) as handle:
        handle.write(b"y" * 20000)
        handle.flush()
        assert not drop_from_cache(handle.name)
        assert resident_bytes(handle.name) == 20000


def test_empty_file_and_missing_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.touch()
    assert resident_bytes(empty) == 0
    assert drop_from_cache(empty)
    with pytest.raises(LoadError, match="cannot open"):
        resident_bytes(tmp_path / "missing.bin")
    with pytest.raises(LoadError, match="cannot open"):
        fadvise_dontneed(tmp_path / "missing.bin")
