"""Openers: files beneath roots only, no symlink out, each file opened once and read only
through that descriptor. Both ways of resolving are tested: ``openat2`` with
``RESOLVE_BENEATH`` (this kernel has it) and open-then-verify (older kernels)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiogguf.errors import LoadError, PathNotAllowedError
from aiogguf.io.buffers import HostBuffer
from aiogguf.io.files import open_file
from aiogguf.io.opener import AnyPathOpener, OpenFiles, RootedOpener


@pytest.fixture(params=["openat2", "verify"])
def rooted(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RootedOpener]:
    """An opener of ``tmp_path/served``, forced to one way of resolving."""
    served = tmp_path / "served"
    served.mkdir()
    (served / "in.gguf").write_bytes(b"inside")
    (served / "sub").mkdir()
    (tmp_path / "out.gguf").write_bytes(b"root:x:0:0:secret")
    with RootedOpener([served]) as opener:
        if request.param == "verify":
            opener._openat2 = False  # as on a kernel without openat2
        yield opener


def read_all(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def test_reads_files_beneath_the_root(rooted: RootedOpener, tmp_path: Path) -> None:
    served = tmp_path / "served"
    (served / "sub" / "rel.gguf").symlink_to("../in.gguf")  # a link that stays inside
    for path in (served / "in.gguf", served / "sub" / ".." / "in.gguf", served / "sub/rel.gguf"):
        fd = rooted.open(str(path))
        try:
            assert read_all(fd) == b"inside"
        finally:
            os.close(fd)


@pytest.mark.parametrize(
    "name",
    [
        "outside-absolute-link",  # served/x -> /…/out.gguf
        "outside-relative-link",  # served/x -> ../out.gguf
        "dangling-outside-link",  # served/x -> /…/missing: must look like the others
        "dotdot",  # served/../out.gguf, as text
        "elsewhere",  # a path beneath no root at all
    ],
)
def test_refuses_alike_whatever_lies_outside(
    rooted: RootedOpener, tmp_path: Path, name: str
) -> None:
    served = tmp_path / "served"
    link = served / "x.gguf"
    path = str(link)
    if name == "outside-absolute-link":
        link.symlink_to(tmp_path / "out.gguf")
    elif name == "outside-relative-link":
        link.symlink_to("../out.gguf")
    elif name == "dangling-outside-link":
        link.symlink_to(tmp_path / "missing.gguf")
    elif name == "dotdot":
        path = f"{served}/../out.gguf"
    else:
        path = str(tmp_path / "out.gguf")
    with pytest.raises(PathNotAllowedError) as caught:
        rooted.open(path)
    # Nothing about the file: not its bytes, size or existence; only the path asked for.
    assert str(caught.value) == f"{path}: not under a served root"


def test_missing_and_odd_files_beneath_the_root(rooted: RootedOpener, tmp_path: Path) -> None:
    served = tmp_path / "served"
    with pytest.raises(LoadError, match="No such file") as caught:
        rooted.open(str(served / "missing.gguf"))
    assert not isinstance(caught.value, PathNotAllowedError)
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    with pytest.raises(LoadError, match="not a regular file"):
        rooted.open(str(served / "sub"))
    # A FIFO would block a plain open until a writer came: refused at once instead.
    os.mkfifo(served / "fifo.gguf")
    with pytest.raises(LoadError, match="not a regular file"):
        rooted.open(str(served / "fifo.gguf"))


def test_this_kernel_resolves_with_openat2(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"x")
    with RootedOpener([tmp_path]) as opener:
        os.close(opener.open(str(tmp_path / "m.gguf")))
        assert opener._openat2 is True


def test_a_root_must_be_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    for root in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(LoadError, match="not a usable root"):
            RootedOpener([root])


def test_open_files_opens_each_path_once_and_closes_all(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    opened: list[str] = []

    class Counting(AnyPathOpener):
        def open(self, path: str) -> int:
            opened.append(path)
            return super().open(path)

    with OpenFiles(Counting()) as files:
        fd = files.open(str(tmp_path / "a"))
        assert files.open(str(tmp_path / "a")) == fd
        assert files.get(str(tmp_path / "a")) == fd
    assert opened == [str(tmp_path / "a")]
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    with pytest.raises(LoadError, match="already closed"):
        files.open(str(tmp_path / "a"))


@pytest.mark.parametrize("direct", [False, True])
def test_a_data_file_reads_the_descriptor_not_the_name(tmp_path: Path, direct: bool) -> None:
    """The path is swapped for another file after the open: reads still see the first."""
    path = tmp_path / "m.gguf"
    first = bytes(range(256)) * 32
    path.write_bytes(first)
    with OpenFiles() as files:
        fd = files.open(str(path))
        replacement = tmp_path / "other"
        replacement.write_bytes(b"\xff" * len(first))
        replacement.replace(path)
        with open_file(path, direct=direct, fd=fd) as f, HostBuffer(len(first)) as buf:
            assert f.size_bytes == len(first)
            if direct:
                # O_DIRECT (or its buffered fallback) reopens the inode, not the name.
                f.read_direct_into(buf.memoryview, 0)
            else:
                f.read_into(buf.memoryview, 0)
            assert bytes(buf.memoryview) == first


# Path pieces that walk in and out of the root: dot-dots, links inside and out, files,
# directories, a FIFO, odd bytes.
_PIECES = ["..", ".", "", "in.gguf", "sub", "up", "out-abs", "out-rel", "in-rel", "fifo", "\0"]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pieces=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6), absolute=st.booleans())
@pytest.mark.parametrize("way", ["openat2", "verify"])
def test_any_path_either_opens_a_file_inside_or_is_refused(
    tmp_path: Path, way: str, pieces: list[str], absolute: bool
) -> None:
    """Whatever the path: an fd of a regular file beneath the root, or a ``LoadError``;
    never a file outside, never another exception."""
    served = tmp_path / "served"
    if not served.exists():
        served.mkdir()
        (served / "in.gguf").write_bytes(b"inside")
        (served / "sub").mkdir()
        (served / "sub" / "up").symlink_to("..")
        (served / "up").symlink_to("..")  # served/up -> tmp_path: outside
        (served / "out-abs").symlink_to(tmp_path / "out.gguf")
        (served / "out-rel").symlink_to("../out.gguf")
        (served / "in-rel").symlink_to("sub/../in.gguf")
        os.mkfifo(served / "fifo")
        (tmp_path / "out.gguf").write_bytes(b"outside")
    relative = "/".join(pieces)
    path = f"{served}/{relative}" if absolute else relative
    with RootedOpener([served]) as opener:
        if way == "verify":
            opener._openat2 = False
        try:
            fd = opener.open(path)
        except LoadError:
            return
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
            assert real.startswith(f"{served}/"), (path, real)
            assert read_all(fd) == b"inside"
        finally:
            os.close(fd)
