"""Where a load's bytes come from: everything the core and the stages ask of a file.

The read and validate stages read through a ``ByteSource``: positional reads into
memory the caller owns, a check that the source did not change under the load, and a
close. A source also says what a load does differently with it, so that no one asks
which kind it is: whether its reads may bypass the page cache (``direct``), whether it
can be mapped (``mappable``), whether it is this machine's storage (``local``: reads
are system calls, a disk's reader limit, pages backed before a read, landed jobs
checked apart where a core is spare, a manifest's blocks hashed as each read lands) or
the network's (each read one request, kept whole; the connections' limit), how much a
checked piece holds (``piece_bytes``) and where its reads queue (``disk``).

Two kinds: a local file opened beneath its root (``aiogguf.io.opener``), ``DataFile``,
and a file read by HTTP ranges, ``aiogguf.remote._http_source.HttpSource`` (and the
hub's ``HubSource``). The parse stage reads a local file's header through the load's
table of descriptors (``OpenFiles``), a remote one through ``read_header_from``; the
core's assembler (``aiogguf._core.assemble``) opens the sources of a load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from aiogguf.io.files import DataFile

__all__ = ["ByteSource", "DirectSource"]


class ByteSource(Protocol):
    """The bytes of one model file, read by position from any thread at once."""

    @property
    def path(self) -> str:
        """The file's name, in messages and errors."""
        ...

    def read_into(self, dest: Buffer, offset: int, *, max_call: int = 0) -> None:
        """Blocking: fill all of ``dest`` with the bytes at ``[offset, offset +
        len(dest))``, a local file in system calls of at most ``max_call`` bytes (0:
        its own). Raises ``LoadError`` (naming the path and offset) if the source ends
        first or the read fails."""
        ...

    @property
    def direct_ok(self) -> bool:
        """True while its reads really bypass the page cache (``O_DIRECT``)."""
        ...

    @property
    def direct_refusal(self) -> str | None:
        """Why a read that was asked to bypass the page cache does not (None: it does,
        or was not asked to)."""
        ...

    @property
    def direct(self) -> DirectSource | None:
        """The source's reads around the page cache, where they work (None: reads are
        buffered)."""
        ...

    @property
    def mappable(self) -> DataFile | None:
        """The local file the mapped modes map (None: nothing to map)."""
        ...

    @property
    def local(self) -> bool:
        """Whether its bytes are this machine's storage: reads are system calls at
        memory pace (else network requests, each read one request, kept whole)."""
        ...

    @property
    def piece_bytes(self) -> int | None:
        """The most a checked piece of it holds (None: the read stage's default)."""
        ...

    def disk(self) -> str:
        """Blocking (a ``stat``): where its reads queue, named (a filesystem's device,
        a remote host)."""
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
