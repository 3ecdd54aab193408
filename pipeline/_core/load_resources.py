"""What one load holds, owned by one object and freed by one close, in order.

A load opens its files, allocates images (host ones on its own thread, device ones
through the upload stage), lends threads (its own, readers, check threads, transfer
threads) and starts host reads that write into the images. ``LoadResources`` owns all
of it from the moment each is made until the model takes the images
(``take_images``). The stages get what they need read-only (``files``, ``images``) or
through a method of the owner (``place`` for a new image, ``keep_file`` for a newly
opened file); nothing else holds a list of them.

``aclose`` (the exit of ``async with``) runs once, in an order in which nothing is freed
while something still writes into it:

1. the uploader exits: told why the load ended, it frees a failed load's device
   buffers, else hands them on with the images;
2. the host reads are stopped and awaited, and where they hand landed jobs is closed;
3. the lent threads go back to the pool (every call they ran has returned);
4. the images the model did not take are freed, on the load's thread;
5. the files are closed; the load's thread goes back, and the table of descriptors the
   parse stage opened is closed last.

A step that fails does not stop the later ones: the first error is raised once all have
run, the others ride along as notes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anyio.lowlevel

from aiogguf._config import Config
from aiogguf._images import Image
from aiogguf.io._devices.base import Device
from aiogguf.io.files import DataFile
from aiogguf.io.opener import FileOpener, OpenFiles
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.allocate import close_images
from aiogguf.stages.read import HostReads
from aiogguf.stages.upload import Uploader

__all__ = ["LoadResources"]


class LoadResources:
    """The files, images, threads, host reads and uploader of one load.

    Made on the loop (``async with``, which also takes the load's own thread,
    ``thread``); its methods may then be called from the load's thread too, except
    ``open_uploader`` and ``aclose``. ``opener`` opens every file of the load, once
    (``opened``; default: any path)."""

    def __init__(self, opener: FileOpener | None = None) -> None:
        self.opened = OpenFiles(opener)
        self._token = anyio.lowlevel.current_token()
        self._files: list[ByteSource] = []
        self._images: list[Image | None] = []
        self._lent: list[LoadThreads] = []
        self._reads: list[tuple[HostReads, Callable[[], None]]] = []
        self._uploader: Uploader | None = None
        # The load's own thread, for its one-off blocking calls (parse, index, plan,
        # open, allocate, close): taken by ``__aenter__``, given back last.
        self.thread = LoadThreads(1, name="aiogguf-load")

    async def __aenter__(self) -> LoadResources:
        self.thread.enter(self._token)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """``aclose``, told why the load ended (the exception, if any)."""
        exc = exc_info[1]
        await self.aclose(exc if isinstance(exc, BaseException) else None)

    # --- what the load takes --------------------------------------------------------

    @property
    def files(self) -> Sequence[ByteSource]:
        """The load's open files, one per file of the model, in order."""
        return self._files

    @property
    def mappable_files(self) -> Sequence[DataFile]:
        """The files of ``files`` that can be mapped (``ByteSource.mappable``): all of
        them, or none in a load of a URL."""
        return [m for f in self._files if (m := f.mappable) is not None]

    def keep_file(self, file: ByteSource) -> None:
        """Own ``file``, just opened (the next file of the model)."""
        self._files.append(file)

    @property
    def images(self) -> Sequence[Image | None]:
        """The load's images by buffer (None: not allocated yet, or taken); read-only,
        and live: an image placed later shows here."""
        return self._images

    def make_room(self, count: int) -> None:
        """Room for ``count`` images, one per buffer of the plan, before the first."""
        assert not any(self._images), "the images' room is made before any exists"
        self._images[:] = [None] * count

    def place(self, index: int, image: Image) -> None:
        """Own ``image``, buffer ``index``'s, just allocated."""
        assert self._images[index] is None, f"buffer {index} has an image already"
        self._images[index] = image

    def take_images(self) -> list[Image | None]:
        """Hand every image to the caller (the model), which closes them from now on."""
        images = list(self._images)
        self._images[:] = [None] * len(images)
        return images

    def lend(self, count: int, name: str) -> LoadThreads:
        """``count`` threads named ``name`` for the load (from any thread), their calls
        awaited on the load's loop; given back by ``aclose``."""
        threads = LoadThreads(count, name=name).enter(self._token)
        self._lent.append(threads)
        return threads

    def hold_reads(self, reads: HostReads, close_landing: Callable[[], None]) -> None:
        """Own ``reads`` before they start: ``aclose`` stops and awaits them (unless the
        load has), then runs ``close_landing`` (closes where their landed jobs go)."""
        self._reads.append((reads, close_landing))

    async def open_uploader(
        self, devices: Mapping[str, Device], config: Config, *, threads: int
    ) -> Uploader:
        """The load's uploader, on ``threads`` transfer threads of its own (on the loop)."""
        assert self._uploader is None, "one uploader per load"
        uploader = Uploader(devices, config, threads=self.lend(threads, "aiogguf-transfer"))
        await uploader.__aenter__()
        self._uploader = uploader
        return uploader

    # --- the one close ----------------------------------------------------------------

    async def aclose(self, exc: BaseException | None = None) -> None:
        """Free what the load still holds, in order (the module docstring); ``exc``: why
        the load ended (None: it succeeded). Idempotent."""
        errors: list[BaseException] = []
        try:
            await self._close_uploader(exc)
        except BaseException as error:  # the later steps still free their part
            errors.append(error)
        try:
            await self._stop_reads()
        except BaseException as error:
            errors.append(error)
        for threads in self._lent:
            threads.leave()
        self._lent = []
        try:
            if any(image is not None for image in self._images):
                # No thread call when there is none to free (a load that succeeded).
                await self.thread.run_sync(close_images, self._images)
        except BaseException as error:
            errors.append(error)
        files, self._files = self._files, []
        for f in files:
            f.close()
        self.thread.leave()
        self.opened.close()
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"also, while closing: {type(other).__name__}: {other}")
            raise errors[0]

    async def _close_uploader(self, exc: BaseException | None) -> None:
        uploader, self._uploader = self._uploader, None
        if uploader is not None:
            if exc is None:
                await uploader.__aexit__(None, None, None)
            else:
                await uploader.__aexit__(type(exc), exc, exc.__traceback__)

    async def _stop_reads(self) -> None:
        reads, self._reads = self._reads, []
        for host_reads, close_landing in reads:
            try:
                await host_reads.abandon()
            finally:
                close_landing()
