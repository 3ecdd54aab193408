"""The assembler: where one load's bytes come from and who watches them land, made
from its config on the load's thread. It is the only module of the core that imports a
wing, and only when the load needs it: a URL or ``hf://`` name imports
``aiogguf.remote`` (its files are ``HttpSource``s), a manifest ``aiogguf.integrity``
(its block hashes watch the bytes land). A local load without a manifest imports and
runs neither.

It also reads a local model's headers: every file parsed (the parse stage) and indexed
(the index stage), for a load, a dry run or a hash (``read_whole_model``,
``open_index``): the stages do one job each, and this joins them.

The core reads every file through the ``ByteSource`` seam (``aiogguf.io.source``: the
source says whether it maps, takes ``O_DIRECT``, is local, how large a checked piece
is, where its reads queue) and hands landed bytes to ``LandedWatcher``s
(``aiogguf._jobs``): it never asks which kind of source or watcher it has.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from aiogguf._addresses import is_remote
from aiogguf._config import Config, manifest_beside
from aiogguf._core.load_resources import LoadResources
from aiogguf._jobs import BufferLayout, LandedWatcher, PieceSink, ReadJob, TensorSlot
from aiogguf._records import ParsedFile, WeightIndex
from aiogguf.errors import IntegrityError
from aiogguf.io.opener import FileOpener, OpenFiles
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import is_split, parse_model, read_header
from aiogguf.stages.read import open_data_files

if TYPE_CHECKING:
    from aiogguf.integrity._checker import IntegrityChecker
    from aiogguf.integrity._llama_check import LlamaCheck
    from aiogguf.remote._sources import RemoteName

__all__ = [
    "Assembly",
    "ManifestCheck",
    "find_manifest",
    "is_remote",
    "open_index",
    "read_whole_model",
]

AUTO = "auto"


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


class ManifestCheck(Protocol):
    """A manifest's check of a load, which has its say in the verdict once the reads
    are done."""

    @property
    def hashed(self) -> int:
        """Blocks hashed so far."""
        ...

    @property
    def tensors_hashed(self) -> int:
        """Tensors hashed whole so far."""
        ...

    def error(self, path: str | None) -> IntegrityError | None:
        """Blocking, once the reads are done: the ``IntegrityError`` naming every bad
        tensor (None: all good)."""
        ...


def find_manifest(setting: str | None, model_path: str) -> str | None:
    """The manifest a load checks against: ``setting`` (``load.manifest``) as a path,
    or for ``"auto"`` the one beside the model's first file when it exists (a ``stat``)."""
    if setting is None:
        return None
    if setting != AUTO:
        return setting
    beside = manifest_beside(model_path)
    return beside if os.path.isfile(beside) else None


class Assembly:
    """The sources and watchers of one load of ``config``, whose files ``opener`` opens
    (None: any path). Made on the loop (it imports nothing); its methods run on the
    load's thread, in the order of the load: ``route`` (a remote name), ``read_model``,
    ``open_files``, ``open_manifest``, ``watchers``, ``expect_reads``; ``finish`` once
    every read has landed."""

    def __init__(self, config: Config, opener: FileOpener | None) -> None:
        self.config = config
        self._opener = opener
        self._remote: RemoteName | None = None
        self._checker: IntegrityChecker | LlamaCheck | None = None
        self.manifest: ManifestCheck | None = None  # made by ``watchers``

    def route(self, path: str) -> str:
        """Blocking (an ``hf://`` name asks the hub which commit it names): where a
        remote name is read; the hub cache's file for one it has (a local load). The
        config becomes the route's (mode ``auto`` is ``none`` for a URL)."""
        from aiogguf.remote._sources import route_remote

        route = route_remote(path, self.config, self._opener)
        self.config, self._remote = route.config, route.remote
        return route.path

    def read_model(
        self, path: str, resources: LoadResources
    ) -> tuple[ParsedFile, WeightIndex | None]:
        """Blocking: the first file's header and the model's index (None for a local
        split set: the engine parses the others); the files opened to parse are
        ``resources``'."""
        if self._remote is not None:  # every split too: each opened and parsed here
            return self._remote.read_model(path, self.config, resources.keep_file)
        return read_whole_model(path, resources.opened)

    def open_files(self, index: WeightIndex, resources: LoadResources, *, direct: bool) -> None:
        """Blocking: the files to read, opened for the plan's mode (``direct``: with an
        ``O_DIRECT`` twin; a remote file was opened to be parsed)."""
        if self._remote is None:
            open_data_files(
                index,
                resources.opened,
                direct=direct,
                alignment=self.config.pipeline.alignment,
                keep=resources.keep_file,
            )

    def open_manifest(self, index: WeightIndex, resources: LoadResources) -> None:
        """Blocking: the load's manifest, if it has one, read and matched to the model."""
        found = find_manifest(self.config.load.manifest, index.files[0].path)
        if found is not None:
            from aiogguf.integrity._sink import open_manifest

            self._checker = open_manifest(found, index, resources.files, resources.opened)

    @property
    def checked(self) -> bool:
        """Whether a manifest checks the load (its verdict comes at the end)."""
        return self._checker is not None

    def block_grid(self) -> list[tuple[int, int]] | None:
        """Per file, where its data section starts and the block size: a manifest's
        block of hashes lies inside one job (None: no block digests)."""
        if self._checker is None:
            return None
        from aiogguf.integrity._sink import block_grid

        return block_grid(self._checker)

    def shares_mapped_reads(self, *, mapped: bool) -> bool:
        """Whether the checks of mapped tensors (``mapped``: the mode maps host images)
        take their pieces from the manifest's reads of the file."""
        if self._checker is None:
            return False
        from aiogguf.integrity._sink import shares_mapped_reads

        return shares_mapped_reads(self._checker, mapped=mapped)

    def watchers(
        self,
        index: WeightIndex,
        resources: LoadResources,
        layouts: Sequence[BufferLayout],
        slots: dict[str, TensorSlot],
        *,
        swapped: bool,
        feed: PieceSink | None,
    ) -> list[LandedWatcher]:
        """Blocking: the watchers the load's sources and manifest bring, after the
        tensor checks (``feed``: theirs, for a manifest's reads of a mapped file)."""
        if self._checker is None:
            return []
        from aiogguf.integrity._sink import watch

        sink, watcher = watch(
            self._checker,
            index,
            resources.files,
            resources.images,
            layouts,
            slots,
            swapped=swapped,
            feed=feed,
        )
        self.manifest = sink
        return [watcher]

    def expect_reads(self, resources: LoadResources, jobs: Sequence[Sequence[ReadJob]]) -> None:
        """Tell a hub file which of its bytes the reads will land (``jobs``: every host
        and device job): its digest fetches the others itself."""
        if self._remote is not None:
            self._remote.expect_reads(resources.files, jobs)

    @property
    def settles(self) -> bool:
        """Whether ``finish`` has anything to do (a thread call less when not)."""
        return self._remote is not None

    def finish(self, resources: LoadResources) -> None:
        """Blocking, once every read has landed: each hub file's digest checked
        (``IntegrityError``) and its cache entry committed."""
        if self._remote is not None:
            from aiogguf.remote._sources import finish_remote

            finish_remote(resources.files)
