"""Reading a model's headers: every file parsed (the parse stage) and indexed (the index
stage), for a load, a dry run or a hash. The stages do one job each; this joins them."""

from __future__ import annotations

import os

from aiogguf._records import ParsedFile, WeightIndex
from aiogguf.io.opener import OpenFiles
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import is_split, parse_model, read_header

__all__ = ["open_index", "read_whole_model"]


def read_whole_model(path: str, files: OpenFiles) -> tuple[ParsedFile, WeightIndex | None]:
    """Blocking: parse ``path`` through ``files`` and, unless it is one split of a set,
    index it too: one call for the common case of a single-file model.

    Returns the parsed header and the index, or None for a split set (``open_index``
    with ``first=`` parses the other splits). Raises as ``open_index`` does.
    """
    first = read_header(path, files)
    return first, None if is_split(first) else build_index((first,))


async def open_index(
    path: str | os.PathLike[str],
    *,
    threads: LoadThreads | None = None,
    files: OpenFiles | None = None,
    first: ParsedFile | None = None,
) -> WeightIndex:
    """Parse a model (every split, concurrently) and index it.

    ``path``: a single-file model or the first split of a split set.
    ``threads``: the load's threads, for the parse and the index (default: a thread of
        its own).
    ``files``: the load's open files; each file is opened through it once and stays
        open there for the engine (default: opened by path and closed after parsing).
    ``first``: ``path`` already parsed through ``files`` (``read_whole_model``).
    Raises ``GGUFFormatError``: a file is malformed or truncated.
    Raises ``SplitError``: the split set is incomplete, out of order or mixed.
    Raises ``PathNotAllowedError``: the opener of ``files`` refuses a file.
    Raises ``LoadError``: a file cannot be read.
    """
    if threads is None:
        async with LoadThreads(1, name="aiogguf-parse") as own:
            return await open_index(path, threads=own, files=files, first=first)
    parsed = await parse_model(path, threads=threads, files=files, first=first)
    # Ordering and checking thousands of tensors takes milliseconds: not on the loop.
    return await threads.run_sync(build_index, parsed)
