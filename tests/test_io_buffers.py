"""HostBuffer / ExternalBuffer: alignment, lifecycle, close with live views."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import numpy as np
import pytest

from aiogguf.io import buffers as buffers_module
from aiogguf.io.buffers import (
    PAGE_BYTES,
    ByteRegion,
    ClosedResourceError,
    ExternalBuffer,
    HostBuffer,
    ResourceState,
    buffer_address,
    memory_held_by_views,
)


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 << 20])
def test_host_buffer_is_page_aligned_zeroed_and_exact(nbytes: int) -> None:
    with HostBuffer(nbytes) as buf:
        assert buf.address % mmap.PAGESIZE == 0
        assert buf.address % PAGE_BYTES == 0
        assert buf.nbytes == nbytes
        assert len(buf.memoryview) == nbytes
        assert not buf.memoryview.readonly
        assert buf.capacity_bytes % PAGE_BYTES == 0
        assert buf.capacity_bytes >= max(nbytes, 1)
        array = buf.as_array()
        assert array.dtype == np.uint8
        assert array.shape == (nbytes,)
        assert not array.any()
        if nbytes:
            assert buffer_address(buf.memoryview) == buf.address
            array[-1] = 7
            assert buf.memoryview[-1] == 7
        del array
        assert isinstance(buf, ByteRegion)


@pytest.mark.parametrize("alignment", [512, 8192, 64 << 10, 2 << 20])
def test_host_buffer_honours_alignments_above_the_page(alignment: int) -> None:
    # mmap alone gives 4 KiB alignment and 8 KiB only by luck (a direct load with
    # alignment = 8192 failed on it now and then); several buffers make luck unlikely.
    buffers = [HostBuffer(3 * PAGE_BYTES + 5, alignment=alignment) for _ in range(8)]
    try:
        for buf in buffers:
            assert buf.address % max(alignment, PAGE_BYTES) == 0
            assert buffer_address(buf.memoryview) == buf.address
            assert buffer_address(buf.as_array()) == buf.address
            buf.prefault()
            buf.as_array()[:] = 9
            assert bytes(buf.memoryview[-3:]) == b"\x09\x09\x09"
    finally:
        for buf in buffers:
            buf.close()
    assert all(buf.memory_released for buf in buffers)


@pytest.mark.parametrize("alignment", [0, 3, 4096 + 512])
def test_host_buffer_refuses_bad_alignments(alignment: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        HostBuffer(10, alignment=alignment)


def test_prefault_keeps_contents_and_works() -> None:
    with HostBuffer(5 * PAGE_BYTES + 3, prefault=True) as buf:
        buf.as_array()[:] = 1
        buf.prefault()  # on already-written memory it must not zero anything
        assert int(buf.as_array().sum()) == buf.nbytes


def test_populate_backs_exactly_the_pages_of_the_range_and_keeps_contents() -> None:
    from aiogguf.io import _libc

    with HostBuffer(16 * PAGE_BYTES) as buf:
        assert not any(b & 1 for b in _libc.mincore(buf.address, buf.capacity_bytes))
        buf.memoryview[5 * PAGE_BYTES] = 7  # a page backed already, written
        buf.populate(4 * PAGE_BYTES + 100, 8 * PAGE_BYTES)  # from inside page 4
        resident = [
            i for i, b in enumerate(_libc.mincore(buf.address, buf.capacity_bytes)) if b & 1
        ]
        if buffers_module._populate_write_works:  # a kernel before 5.14 backs nothing
            assert resident == [4, 5, 6, 7]
        assert buf.memoryview[5 * PAGE_BYTES] == 7
        assert int(buf.as_array().sum()) == 7
        buf.populate(12 * PAGE_BYTES, 100 * PAGE_BYTES)  # past the end: cut to it
        buf.populate(8 * PAGE_BYTES, 8 * PAGE_BYTES)  # empty: nothing


def test_populate_on_a_kernel_without_it_leaves_the_pages_to_the_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import errno

    from aiogguf.io import _libc

    calls: list[int] = []

    def refused(address: int, length: int, advice: int) -> None:
        calls.append(advice)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(buffers_module, "_populate_write_works", True)
    monkeypatch.setattr(_libc, "madvise", refused)
    with HostBuffer(4 * PAGE_BYTES) as buf:
        buf.populate(0, buf.nbytes)
        buf.populate(0, buf.nbytes)  # not asked again
        assert calls == [_libc.MADV_POPULATE_WRITE]
        assert not any(b & 1 for b in _libc.mincore(buf.address, buf.capacity_bytes))
        buf.memoryview[:] = b"x" * buf.nbytes  # the writes fault the pages in
    assert not buffers_module._populate_write_works


def test_close_is_idempotent_and_use_after_close_is_clear() -> None:
    buf = HostBuffer(100)
    assert buf.state is ResourceState.OPEN
    buf.close()
    buf.close()
    assert buf.state is ResourceState.CLOSED
    assert buf.memory_released
    with pytest.raises(ClosedResourceError, match=r"HostBuffer.*closed"):
        buf.memoryview  # noqa: B018
    with pytest.raises(ClosedResourceError):
        buf.address  # noqa: B018
    with pytest.raises(ClosedResourceError):
        buf.as_array()
    with pytest.raises(ClosedResourceError):
        buf.prefault()
    assert issubclass(ClosedResourceError, ValueError)


def test_close_with_live_views_defers_the_unmap() -> None:
    buf = HostBuffer(3 * PAGE_BYTES)
    array = buf.as_array()
    piece = buf.memoryview[10:20]
    array[10] = 42
    buf.close()
    # Our object is closed, but the memory must stay valid for the views still held.
    assert buf.state is ResourceState.CLOSED
    assert not buf.memory_released
    assert array[10] == 42
    assert piece[0] == 42
    del array
    assert not buf.memory_released
    piece.release()
    del piece
    gc.collect()
    assert buf.memory_released


def test_resource_warning_when_collected_unclosed() -> None:
    with pytest.warns(ResourceWarning, match="unclosed <HostBuffer nbytes=10"):
        HostBuffer(10)  # dropped at once: refcounting, no cycle


def test_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        HostBuffer(-1)


def test_external_buffer_wraps_foreign_memory_and_releases_once() -> None:
    backing = bytearray(b"abcdef")
    calls: list[int] = []
    ext = ExternalBuffer(backing, release=lambda: calls.append(1), name="pinned")
    assert isinstance(ext, ByteRegion)
    assert ext.nbytes == 6
    assert ext.address == buffer_address(backing)
    ext.as_array()[0] = ord("z")
    assert backing[0] == ord("z")
    ext.close()
    ext.close()
    assert calls == [1]
    with pytest.raises(ClosedResourceError, match="pinned"):
        ext.memoryview  # noqa: B018


def test_external_buffer_refuses_read_only_memory() -> None:
    with pytest.raises(ValueError, match="read-only"):
        ExternalBuffer(b"abc")


def test_external_buffer_resource_warning() -> None:
    with pytest.warns(ResourceWarning, match="unclosed <ExternalBuffer"):
        ExternalBuffer(bytearray(4))  # dropped at once: refcounting, no cycle


def test_buffer_address_rejects_non_contiguous() -> None:
    array = np.zeros((4, 4), dtype=np.uint8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        buffer_address(array)


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry of its own: what earlier tests keep viewed is none of the test's."""
    monkeypatch.setattr(buffers_module, "_HELD_BY_VIEWS", buffers_module._HeldByViews())


@pytest.mark.usefixtures("fresh_registry")
def test_memory_kept_by_views_after_close_is_known() -> None:
    """A failed load collects garbage only when some closed memory is still viewed:
    ``memory_held_by_views`` says so until the last view goes."""
    assert not memory_held_by_views()
    buf = HostBuffer(PAGE_BYTES)
    buf.close()
    assert not memory_held_by_views()  # no view: unmapped at once
    buf = HostBuffer(PAGE_BYTES)
    array = buf.as_array()
    buf.close()
    assert memory_held_by_views()
    del array
    assert buf.memory_released
    assert not memory_held_by_views()


@pytest.mark.usefixtures("fresh_registry")
def test_a_failed_load_that_holds_no_memory_does_not_collect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full collection holds the GIL for as long as the heap is big: a load refused
    before any memory was allocated (here, a file that is not GGUF) skips it."""
    import aiogguf
    import aiogguf._api

    collections: list[int] = []
    monkeypatch.setattr(aiogguf._api.gc, "collect", lambda *a: collections.append(1) or 0)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(aiogguf.GGUFFormatError), aiogguf.load_sync(bad):
        pass
    assert collections == []


def test_back_pages_writes_each_page_where_the_kernel_cannot_populate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before Linux 5.14 ``MADV_POPULATE_WRITE`` is refused: one write per page backs
    the memory instead (fresh memory: the bytes written are its zeros)."""
    from aiogguf.io import _libc
    from aiogguf.io.buffers import back_pages

    def refuse(address: int, length: int, advice: int) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(_libc, "madvise", refuse)
    with HostBuffer(3 * PAGE_BYTES) as buf:
        pages = buf.as_array()
        pages[:] = 7
        back_pages(pages)
        assert (pages[::PAGE_BYTES] == 0).all()
        assert int(pages.sum()) == 7 * (3 * PAGE_BYTES - 3)
