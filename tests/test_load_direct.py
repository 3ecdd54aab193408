"""``mode="direct"``: O_DIRECT reads really bypass the page cache, land the right bytes,
and fall back to plain reads (with a warning) where the filesystem refuses O_DIRECT."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import aiogguf
from aiogguf.errors import LoadWarning
from aiogguf.io.pagecache import drop_from_cache, resident_bytes
from aiogguf.testing.synth import SynthModel, write_synthetic_model

MiB = 1024**2


def _fs_type(path: Path) -> str:
    """The filesystem type of ``path`` from /proc/self/mounts (longest mount prefix)."""
    best, fstype = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, kind, *_ = line.split()
            if os.path.commonpath([str(path), mount]) == mount and len(mount) > len(best):
                best, fstype = mount, kind
    return fstype


@pytest.fixture
def cold_model(disk_dir: Path) -> SynthModel:
    m = write_synthetic_model(disk_dir / "cold.gguf", size_bytes="24MiB", seed=4)
    if not drop_from_cache(m.path):
        pytest.skip(f"{_fs_type(m.path)} keeps {m.path} in the page cache")
    return m


def test_direct_load_leaves_the_file_out_of_the_page_cache(cold_model: SynthModel) -> None:
    path = cold_model.path
    size = path.stat().st_size
    with aiogguf.load_sync(path, mode="direct", n_gpu_layers=0) as model:
        assert model.report.mode == "direct"
        assert [f.direct for f in model.report.files] == [True]
        cached = resident_bytes(path)
        # Only the header (parsed with buffered reads) may be cached, not the 24 MiB.
        header_end = min(t.file_offset for t in cold_model.tensors)
        assert cached <= header_end + 2 * MiB, (cached, size)
        assert cached < size // 8
        first = cold_model.tensors[-1]
        assert bytes(model.raw(first.name))[:64] == _file_bytes(path, first.file_offset, 64)
    assert resident_bytes(path) <= header_end + 2 * MiB


def test_buffered_load_fills_the_page_cache(cold_model: SynthModel) -> None:
    """The control: the same measurement sees a buffered load's pages."""
    path = cold_model.path
    with aiogguf.load_sync(path, mode="none", n_gpu_layers=0):
        pass
    assert resident_bytes(path) >= cold_model.tensor_bytes * 0.9


def _file_bytes(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


@pytest.mark.parametrize(
    ("chunk", "alignment"),
    [
        ("4KiB", "4KiB"),
        ("64KiB", "4KiB"),
        ("1MiB", "4KiB"),
        ("64KiB", "512B"),
        ("1MiB", "8KiB"),
        ("64KiB", "64KiB"),
    ],
)
def test_direct_unaligned_tensors_and_small_chunks(
    disk_dir: Path, chunk: str, alignment: str
) -> None:
    """Tensors at 32-byte file alignment, reads cut into aligned chunks: exact bytes,
    with the configured I/O alignment (a 512-byte block device, or larger blocks)."""
    m = write_synthetic_model(
        disk_dir / f"u{chunk}-{alignment}.gguf",
        size_bytes="2MiB",
        types="all-types",
        include_q2_0=False,
    )
    reader = gguf.GGUFReader(m.path)
    assert any(int(t.data_offset) % 4096 for t in reader.tensors)
    with aiogguf.load_sync(
        m.path, mode="direct", chunk_size=chunk, alignment=alignment, n_gpu_layers=0
    ) as model:
        # A filesystem whose blocks are larger than 512 bytes refuses the 512-byte case
        # and falls back with a warning; the bytes must be exact either way.
        assert model.report.files[0].direct or alignment == "512B"
        for t in reader.tensors:
            want = np.asarray(t.data).view(np.uint8).tobytes()
            assert bytes(model.raw(t.name)) == want, t.name


def test_direct_falls_back_with_a_warning_when_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that refuses O_DIRECT at open (tmpfs before Linux 6.6, some FUSE and
    network filesystems; simulated here): buffered reads, one warning naming the file."""
    m = write_synthetic_model(tmp_path / "t.gguf", size_bytes="1MiB", seed=1)
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with contextlib.ExitStack() as stack:
        with pytest.warns(LoadWarning, match="mode 'none'") as record:
            model = stack.enter_context(aiogguf.load_sync(m.path, mode="direct", n_gpu_layers=0))
        assert str(m.path) in str(record[0].message)
        assert model.report.mode == "direct"
        assert [f.direct for f in model.report.files] == [False]
        assert any(str(m.path) in w for w in model.report.warnings)
        for t in m.tensors:
            assert bytes(model.raw(t.name)) == _file_bytes(m.path, t.file_offset, t.nbytes)


def test_checks_run_apart_so_the_disk_gets_its_next_read(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT data arrives by DMA, not through the cache, so nothing is gained by
    checking it on the reader's thread: checks run on the check threads while the
    readers go on with the next reads. With one reader, the first check holds until a
    read has started: were checks on the reader's thread, none could start (and the
    check would give up waiting after 10 s)."""
    from aiogguf.io.files import DataFile
    from aiogguf.stages.validate import Validation

    m = write_synthetic_model(disk_dir / "apart.gguf", size_bytes="4MiB", seed=5)
    threads: dict[str, set[str]] = {"read": set(), "check": set()}
    checking = threading.Event()
    read_during_check = threading.Event()
    read_direct_into = DataFile.read_direct_into
    check_piece = Validation.check_piece

    def read(*args: Any, **kwargs: Any) -> Any:
        threads["read"].add(threading.current_thread().name)
        if checking.is_set():
            read_during_check.set()
        return read_direct_into(*args, **kwargs)

    def check(*args: Any, **kwargs: Any) -> Any:
        threads["check"].add(threading.current_thread().name)
        if not checking.is_set():
            checking.set()
            read_during_check.wait(10)
        return check_piece(*args, **kwargs)

    monkeypatch.setattr(DataFile, "read_direct_into", read)
    monkeypatch.setattr(Validation, "check_piece", check)
    with aiogguf.load_sync(
        m.path, mode="direct", chunk_size="256KiB", readers=1, n_gpu_layers=0
    ) as model:
        assert model.report.files[0].direct
        assert model.report.validated == m.n_tensors
    assert read_during_check.is_set(), "no read started while a check was running"
    assert {name.rsplit("-", 1)[0] for name in threads["check"]} == {"aiogguf-check"}
    assert {name.rsplit("-", 1)[0] for name in threads["read"]} == {"aiogguf-reader"}
