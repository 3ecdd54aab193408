"""The index of a single local model file, parsed on the calling thread: for the
command line, which then needs neither an event loop nor the loader (``aiogguf
inspect`` starts as fast as gguf-py's ``gguf-dump``).

It is what ``aiogguf.inspect_sync`` makes of such a file (the same header parse and
index, design §1.1-1.2); a split set, whose files ``inspect`` parses concurrently, and
a remote name are left to it.
"""

from __future__ import annotations

import os

from aiogguf._addresses import is_remote
from aiogguf._records import WeightIndex
from aiogguf.io.opener import FileOpener, OpenFiles
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import is_split, read_header

__all__ = ["index_local_file"]


def index_local_file(
    path: str | os.PathLike[str], *, opener: FileOpener | None = None
) -> WeightIndex | None:
    """Blocking: parse and index ``path`` on this thread, or None when it is a remote
    name or the first split of a set (``inspect_sync`` parses those).

    Raises what ``inspect`` raises for a file: ``GGUFFormatError``, ``SplitError``,
    ``PathNotAllowedError``, ``LoadError``.
    """
    fspath = os.fspath(path)
    if is_remote(fspath):
        return None
    with OpenFiles(opener) as files:
        first = read_header(fspath, files)
    if is_split(first):
        return None
    return build_index((first,))
