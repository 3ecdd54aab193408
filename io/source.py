"""Where a load's bytes come from: what the read and validate hot paths ask of a file.

The read stage's ``Reader`` and the validate stage's ``FileBytes`` read through a
``ByteSource``: positional reads into memory the caller owns, a check that the source
did not change under the load, and a close. Two kinds: a local file opened beneath its
root (``aiogguf.io.opener``), ``DataFile``, and a file read by HTTP ranges,
``aiogguf.remote._http_source.HttpSource``.

The rest of a load still asks for a local file by name, never through this protocol:
the parse stage reads the descriptors of the file table (``OpenFiles``);
``open_data_files`` opens ``DataFile``s and advises them (``fadvise``); ``find_disks``
finds each file's disk (``fileno``, ``stat``) for its reader limit; the engine asks each
file whether ``O_DIRECT`` works (``direct_ok``, ``direct_refusal``; ``DirectSource``);
the mapped modes map it (``allocate_mapped``); ``LoadResources`` holds ``DataFile``s;
and ``resolve_mode`` makes ``auto`` ``mmap``. So the remote kind needs more than being a
``ByteSource``; ``aiogguf.remote._sources`` has it all in one place: the parse stage reads it
through ``read_header_from``, the front opens it and ``LoadResources`` holds it in place
of a ``DataFile``, its reader limit is ``remote_in_flight`` (no disk), and its mode is
``none`` (no mappings, no ``O_DIRECT``, no ``fadvise``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ByteSource", "DirectSource"]


class ByteSource(Protocol):
    """The bytes of one model file, read by position from any thread at once."""

    @property
    def path(self) -> str:
        """The file's name, in messages and errors."""
        ...

    def read_into(self, dest: Buffer, offset: int) -> None:
        """Blocking: fill all of ``dest`` with the bytes at ``[offset, offset +
        len(dest))``. Raises ``LoadError`` (naming the path and offset) if the source
        ends first or the read fails."""
        ...

    def check_unchanged(self) -> None:
        """Blocking: raise ``LoadError`` if the source is no longer what was opened
        (truncated, rewritten, replaced): the bytes a load read would not match it."""
        ...

    def close(self) -> None:
        """Release the source; reads in flight may finish. Idempotent."""
        ...


class DirectSource(ByteSource, Protocol):
    """A source whose reads can bypass the page cache (a local file in mode ``direct``)."""

    def read_direct_into(
        self, dest: Buffer, offset: int, length: int | None = None, *, need_end: int | None = None
    ) -> int:
        """Blocking: read ``length`` bytes (default all of ``dest``) at ``offset``, all
        aligned to the source's alignment, around the page cache; returns how many were
        read (fewer only at the end of the file; ``need_end`` says where the bytes the
        caller needs end)."""
        ...
