"""DataFile: exact positional reads, short reads, EOF errors, O_DIRECT and its fallback."""

from __future__ import annotations

import errno
import itertools
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiogguf.errors import ClosedResourceError, LoadError
from aiogguf.io.buffers import HostBuffer, ResourceState
from aiogguf.io.files import (
    DIRECT_ALIGNMENT,
    DataFile,
    FileAdvice,
    align_down,
    align_up,
    merge_range,
    open_file,
)
from aiogguf.io.pagecache import drop_from_cache, resident_bytes

SIZE = (1 << 20) + 12345  # deliberately not a multiple of the alignment


class _Payload(bytes):
    """The file's bytes, with a short repr (hypothesis prints fixture arguments)."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("files") / "data.bin"
    payload = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    return path, _Payload(payload)


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, SIZE + 100), length=st.integers(0, 70000))
def test_read_into_matches_file_bytes_or_names_eof(
    data_file: tuple[Path, bytes], offset: int, length: int
) -> None:
    path, payload = data_file
    dest = bytearray(length)
    with open_file(path, direct=False) as f:
        if offset + length <= SIZE or length == 0:  # reading nothing never fails
            f.read_into(dest, offset)
            assert bytes(dest) == payload[offset : offset + length]
        else:
            with pytest.raises(LoadError) as info:
                f.read_into(dest, offset)
            assert info.value.path == str(path)
            assert info.value.offset == offset
            assert f"file ended at byte {max(offset, SIZE)}" in str(info.value)
            assert f"expected {length} bytes" in str(info.value)


def test_read_into_numpy_destination_of_any_dtype(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    dest = np.empty(1000, dtype=np.float32)
    with open_file(path) as f:
        f.read_into(dest, 8)
    assert dest.tobytes() == payload[8:4008]


def test_short_reads_and_eintr_are_retried(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, payload = data_file
    real_preadv = os.preadv
    calls: list[int] = []

    def stingy_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        calls.append(offset)
        if len(calls) == 2:
            raise InterruptedError(errno.EINTR, "interrupted")
        return real_preadv(fd, [memoryview(buffers[0])[:777]], offset)

    monkeypatch.setattr(os, "preadv", stingy_preadv)
    dest = bytearray(10_000)
    with open_file(path) as f:
        f.read_into(dest, 5)
    assert bytes(dest) == payload[5:10_005]
    assert len(calls) == 1 + -(-10_000 // 777)  # every short read continued, plus one EINTR


def test_os_error_becomes_load_error_with_path_and_offset(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = data_file

    def failing_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    with open_file(path) as f:
        monkeypatch.setattr(os, "preadv", failing_preadv)
        with pytest.raises(LoadError, match="at offset 4096: read of 10 bytes failed") as info:
            f.read_into(bytearray(10), 4096)
    assert info.value.path == str(path)
    assert isinstance(info.value.__cause__, OSError)


def test_open_missing_file_is_load_error(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="cannot open"):
        open_file(tmp_path / "nope.gguf")


def test_read_only_destination_is_refused(data_file: tuple[Path, bytes]) -> None:
    with open_file(data_file[0]) as f, pytest.raises(ValueError, match="read-only"):
        f.read_into(b"abc", 0)


def test_direct_read_of_whole_file_including_unaligned_tail(
    data_file: tuple[Path, bytes],
) -> None:
    path, payload = data_file
    chunk = 256 * 1024
    with open_file(path, direct=True) as f, HostBuffer(align_up(SIZE, chunk)) as buf:
        assert f.direct_ok == (f.direct_refusal is None)
        got = 0
        for offset in range(0, SIZE, chunk):
            got += f.read_direct_into(buf.memoryview[offset : offset + chunk], offset)
        assert got == SIZE
        assert bytes(buf.memoryview[:SIZE]) == payload
        # The last block alone: an aligned read that EOF cuts short.
        tail_start = align_down(SIZE, DIRECT_ALIGNMENT)
        n = f.read_direct_into(buf.memoryview, tail_start, DIRECT_ALIGNMENT)
        assert n == SIZE - tail_start
        # Entirely past EOF: nothing to read, nothing expected.
        assert f.read_direct_into(buf.memoryview, align_up(SIZE, DIRECT_ALIGNMENT), 4096) == 0


def test_direct_read_checks_alignment(data_file: tuple[Path, bytes]) -> None:
    with open_file(data_file[0], direct=True) as f, HostBuffer(3 * DIRECT_ALIGNMENT) as buf:
        with pytest.raises(ValueError, match="offset=1,"):
            f.read_direct_into(buf.memoryview, 1, 4096)
        with pytest.raises(ValueError, match="length=100,"):
            f.read_direct_into(buf.memoryview, 0, 100)
        with pytest.raises(ValueError, match="address%4096=8"):
            f.read_direct_into(buf.memoryview[8 : 8 + 4096], 0)
        with pytest.raises(ValueError, match="does not fit"):
            f.read_direct_into(buf.memoryview, 0, 4 * DIRECT_ALIGNMENT)


def _refuse_direct_open(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def open_without_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct)


def test_refusal_at_open_falls_back_and_reports(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, payload = data_file
    _refuse_direct_open(monkeypatch)
    with open_file(path, direct=True) as f, HostBuffer(8192) as buf:
        assert f.direct_requested
        assert not f.direct_ok
        assert f.direct_refusal is not None
        assert "refuses O_DIRECT at open" in f.direct_refusal
        assert f.read_direct_into(buf.memoryview, 4096) == 8192
        assert bytes(buf.memoryview) == payload[4096 : 4096 + 8192]


def test_refusal_at_first_read_falls_back_and_reports(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, payload = data_file
    real_preadv = os.preadv
    direct_fds: set[int] = set()
    real_open = os.open

    def tracking_open(p: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(p, flags, *args, **kwargs)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "preadv", refusing_preadv)
    with open_file(path, direct=True) as f, HostBuffer(4096) as buf:
        assert not f.direct_ok
        assert f.direct_refusal is not None
        assert "refuses O_DIRECT reads" in f.direct_refusal
        f.read_direct_into(buf.memoryview, 0)
        assert bytes(buf.memoryview) == payload[:4096]


def test_refusal_after_probe_switches_to_buffered(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, payload = data_file
    with open_file(path, direct=True) as f, HostBuffer(4096) as buf:
        if not f.direct_ok:
            pytest.skip(f"O_DIRECT refused here: {f.direct_refusal}")
        direct_fd = f._direct_fd
        real_preadv = os.preadv

        def refusing_preadv(fd: int, buffers: list[Any], offset: int) -> int:
            if fd == direct_fd:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", refusing_preadv)
        assert f.read_direct_into(buf.memoryview, 8192) == 4096
        assert bytes(buf.memoryview) == payload[8192 : 8192 + 4096]
        assert not f.direct_ok
        assert f.direct_refusal is not None
        assert "was refused" in f.direct_refusal


def test_direct_read_bypasses_the_page_cache(disk_dir: Path) -> None:
    path = disk_dir / "direct64.bin"
    nbytes = 64 << 20
    payload = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    with open(path, "wb") as out:
        out.write(payload.data)
        out.flush()
        os.fsync(out.fileno())
    try:
        assert drop_from_cache(path)
        chunk = 8 << 20
        with open_file(path, direct=True) as f, HostBuffer(nbytes) as buf:
            if not f.direct_ok:
                pytest.skip(f"O_DIRECT refused on {disk_dir}: {f.direct_refusal}")
            for offset in range(0, nbytes, chunk):
                f.read_direct_into(buf.memoryview[offset : offset + chunk], offset)
            assert np.array_equal(buf.as_array(), payload)
            assert resident_bytes(path) < (1 << 20)
            # Control: a buffered read does fill the cache, so the measurement is real.
            f.read_into(buf.memoryview, 0)
            assert resident_bytes(path) > nbytes * 0.9
    finally:
        path.unlink()


def test_close_is_idempotent_and_use_after_close_is_clear(
    data_file: tuple[Path, bytes],
) -> None:
    f = open_file(data_file[0], direct=True)
    fd = f.fileno()
    f.close()
    f.close()
    assert f.state is ResourceState.CLOSED
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    with pytest.raises(ClosedResourceError):
        f.read_into(bytearray(1), 0)
    with pytest.raises(ClosedResourceError):
        f.fileno()


def test_close_during_a_read_waits_for_the_reader(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, payload = data_file
    entered, proceed = threading.Event(), threading.Event()
    real_preadv = os.preadv

    def slow_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        entered.set()
        assert proceed.wait(10)
        return real_preadv(fd, buffers, offset)

    f = open_file(path)
    fd = f.fileno()
    monkeypatch.setattr(os, "preadv", slow_preadv)
    dest = bytearray(100)
    reader = threading.Thread(target=f.read_into, args=(dest, 50))
    reader.start()
    assert entered.wait(10)
    f.close()
    os.fstat(fd)  # still open: the reader is using it
    proceed.set()
    reader.join(10)
    assert bytes(dest) == payload[50:150]
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_resource_warning_when_collected_unclosed(data_file: tuple[Path, bytes]) -> None:
    with pytest.warns(ResourceWarning, match="unclosed <DataFile"):
        DataFile(data_file[0], direct=False)  # dropped at once: refcounting, no cycle


def test_fadvise_hints(data_file: tuple[Path, bytes]) -> None:
    with open_file(data_file[0]) as f:
        for advice in FileAdvice:
            f.fadvise(advice)
        f.fadvise(FileAdvice.WILLNEED, 4096, 8192)
        with pytest.raises(LoadError, match="posix_fadvise"):
            f.fadvise(FileAdvice.DONTNEED, 0, -5)


@given(value=st.integers(0, 1 << 50), shift=st.integers(0, 22))
def test_align_helpers(value: int, shift: int) -> None:
    alignment = 1 << shift
    down, up = align_down(value, alignment), align_up(value, alignment)
    assert down % alignment == 0
    assert up % alignment == 0
    assert down <= value <= up
    assert up - down in (0, alignment)
    assert (up == down) == (value % alignment == 0)


def test_direct_read_need_end(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    with open_file(path, direct=True) as f, HostBuffer(2 * DIRECT_ALIGNMENT) as buf:
        tail = align_down(SIZE, DIRECT_ALIGNMENT)
        # Asking for bytes past the end of the file is an error naming where it ended.
        with pytest.raises(LoadError, match=f"file ended at byte {SIZE}"):
            f.read_direct_into(buf.memoryview, tail, need_end=SIZE + 1)
        assert f.read_direct_into(buf.memoryview, tail, need_end=SIZE) == SIZE - tail
        assert bytes(buf.memoryview[: SIZE - tail]) == payload[tail:]


def test_merge_range_keeps_ranges_sorted_disjoint_and_covering_the_same_bytes() -> None:
    ranges: list[tuple[int, int]] = []
    covered: set[int] = set()
    for lo, hi in [(10, 20), (30, 40), (20, 25), (0, 5), (4, 31), (50, 50), (60, 70)]:
        ranges = merge_range(ranges, lo, hi)
        covered |= set(range(lo, hi))
        assert ranges == sorted(ranges)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges))
        assert {i for a, b in ranges for i in range(a, b)} == covered
    assert ranges == [(0, 40), (60, 70)]
