"""The machine's own limits for bringing one file into memory, in GB/s (10^9 bytes/s).

A load is only fast or slow compared with these, measured on the same file in the same
run: ``preadv`` into fresh memory (what a first load into new buffers must pay: page
faults plus the copy out of the page cache), ``preadv`` into touched memory (a reload),
``O_DIRECT`` (the disk without the page cache), a plain memory copy, making a mapping
resident (mmap mode's work), and, when CuPy sees a GPU, a pinned host-to-device copy.

Each function does ``runs`` measurements and returns their median; callers that
interleave limits with loads (``aiogguf bench``, ``bench/load.py``) call them with
``runs=1`` between loads, so both see the same machine, noise included.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from aiogguf.io.buffers import PAGE_BYTES, HostBuffer
from aiogguf.io.files import align_up, open_file
from aiogguf.io.mapping import FileMapping, open_mapping
from aiogguf.io.pagecache import drop_from_cache, resident_bytes

__all__ = [
    "CHUNK_BYTES",
    "GB",
    "PageCache",
    "direct_gbps",
    "drop_or_warm",
    "evict",
    "fill_cache",
    "memcpy_gbps",
    "mmap_touch_gbps",
    "np_memmap_touch_s",
    "pinned_copy_gbps",
    "preadv_fresh_gbps",
    "preadv_touched_gbps",
    "warm_file",
]

CHUNK_BYTES = 64 << 20
GB = 1e9
# memcpy bandwidth does not depend on size beyond the caches; capping it keeps the
# limit's memory (two buffers) small next to a multi-GiB model.
_MEMCPY_MAX_BYTES = 1 << 30


def warm_file(path: str | os.PathLike[str]) -> None:
    """Bring the whole file into the page cache (skipped when it is already resident)."""
    if resident_bytes(path) >= os.path.getsize(path):
        return
    fill_cache(path)


def fill_cache(path: str | os.PathLike[str], *, small_pages: bool = False) -> None:
    """Read ``path`` into the page cache in pages of a chosen kind. It decides the kind
    only for the pages it reads in: evict the file first (``drop_from_cache``).

    The same cached bytes cost a mapping very different amounts according to the size of
    the pages that hold them (``MADV_POPULATE_READ`` maps every page of a 4 KiB-page
    cache one by one, and a large folio at once). ``small_pages=False`` reads the file in
    order, as a first read of it does: the kernel's readahead then caches it in large
    folios where the kernel and filesystem support them (small ones at the file's start,
    while the readahead window grows). ``small_pages=True`` reads it with readahead off
    (``POSIX_FADV_RANDOM``), which caches it in 4 KiB pages: the page cache of kernels
    and filesystems without large folios, or of a file read at random offsets.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if small_pages:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        block = bytearray((1 if small_pages else 16) << 20)
        offset = 0
        while n := os.preadv(fd, [block], offset):
            offset += n
    finally:
        os.close(fd)


def evict(path: str | os.PathLike[str]) -> str | None:
    """Evict ``path`` from the page cache; returns how (``"posix_fadvise"`` or
    ``"drop_caches"``, where ``/proc/sys/vm/drop_caches`` is writable), or None when
    neither emptied it."""
    if drop_from_cache(path):
        return "posix_fadvise"
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return None
    return "drop_caches" if resident_bytes(path) == 0 else None


class PageCache:
    """Puts a file's page cache in a stated state before a measurement, rather than
    taking it as found: what a mapping load costs depends on it more than on the
    loader. ``"warm"``: evicted and read back in file order (``fill_cache``: large
    folios where the kernel has them); ``"pages"``: read back with readahead off, in
    4 KiB pages; ``"cold"``: evicted.

    A warm state is made anew only when the last one made for the file was another, or
    part of the file has left the cache since: loads leave the cache as they found it,
    except cold ones (and ``O_DIRECT`` reads, which evict it: call ``forget``). Where the
    file cannot be evicted (``evictable=False``) warm measurements find it as it is.

    Raises ``RuntimeError`` when a state cannot be made.
    """

    def __init__(self, evictable: bool = True) -> None:
        self.evictable = evictable
        self._made: dict[Path, str] = {}

    def make(self, path: str | os.PathLike[str], state: str) -> None:
        """Put the page cache of ``path`` in the state ``state``."""
        p = Path(path)
        size = p.stat().st_size
        if state == "cold":
            if evict(p) is None:
                raise RuntimeError(f"{p}: could not drop it from the page cache")
        elif not self.evictable:
            warm_file(p)
        elif self._made.get(p) != state or resident_bytes(p) < size:
            if evict(p) is None:
                raise RuntimeError(f"{p}: could not evict it to cache it anew")
            fill_cache(p, small_pages=state == "pages")
            # The first mapping of freshly cached pages costs about twice what later ones
            # do: mapped once here, no timed measurement is the first.
            with open_mapping(p, 0, size, populate=True):
                pass
        self._made[p] = state

    def forget(self, path: str | os.PathLike[str]) -> None:
        """Something else changed the file's cache: make the next warm state anew."""
        self._made.pop(Path(path), None)


def drop_or_warm(path: str | os.PathLike[str], cold: bool) -> bool:
    """Cold: evict ``path`` from the page cache, True if that worked; warm: cache it all."""
    if cold:
        return drop_from_cache(path)
    warm_file(path)
    return True


def _chunks(nbytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    for offset in range(0, nbytes, chunk_bytes):
        yield offset, min(chunk_bytes, nbytes - offset)


def _parallel(
    threads: int, work: Iterator[tuple[int, int]], step: Callable[[int, int], object]
) -> None:
    """Run ``step(offset, nbytes)`` for every chunk on ``threads`` threads (the GIL is
    released by every step used here: preadv, madvise, numpy copies)."""
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                item = next(work, None)
            if item is None:
                return
            try:
                step(*item)
            except BaseException as exc:
                errors.append(exc)
                return

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def _median_gbps(
    runs: int,
    nbytes: int,
    prepare: Callable[[], object],
    run: Callable[[], None],
    cleanup: Callable[[], None] = lambda: None,
) -> float:
    """``cleanup`` runs after the clock stops: freeing GiBs of memory takes a while
    (about 0.1 s per GiB here) and a load does not pay it either."""
    rates = []
    for _ in range(max(runs, 1)):
        prepare()
        try:
            start = time.perf_counter()
            run()
            rates.append(nbytes / (time.perf_counter() - start) / GB)
        finally:
            cleanup()
    return statistics.median(rates)


def _prepare(path: Path, cold: bool) -> Callable[[], None]:
    def prepare() -> None:
        if not drop_or_warm(path, cold):
            raise RuntimeError(f"{path}: cannot drop it from the page cache (tmpfs?)")

    return prepare


def preadv_fresh_gbps(
    path: str | os.PathLike[str],
    *,
    threads: int = 2,
    cold: bool = False,
    runs: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    huge_pages: bool = False,
    backed: bool = False,
) -> float:
    """``preadv`` into a new, never-touched page-aligned buffer each run (the first-load
    limit: the memory's backing is paid inside the clock, as it is in a real load).
    ``huge_pages``: into memory advised for transparent huge pages before its first
    touch (``HostBuffer(huge_pages=True)``). ``backed``: each chunk's pages backed in
    one call before its read (``HostBuffer.populate``, as a load's reader does), not
    faulted in by the read itself."""
    p = Path(path)
    nbytes = p.stat().st_size
    warm_or_drop = _prepare(p, cold)
    bufs: list[HostBuffer] = []

    def prepare() -> None:
        warm_or_drop()
        # Mapping is instant; its pages are backed during the reads, inside the clock.
        bufs.append(HostBuffer(nbytes, huge_pages=huge_pages))

    def cleanup() -> None:
        while bufs:
            bufs.pop().close()

    with open_file(p) as f:

        def run() -> None:
            buf = bufs[-1]
            view = buf.memoryview

            def step(off: int, n: int) -> None:
                if backed:
                    buf.populate(off, off + n)
                f.read_into(view[off : off + n], off)

            _parallel(threads, _chunks(nbytes, chunk_bytes), step)

        return _median_gbps(runs, nbytes, prepare, run, cleanup)


def preadv_touched_gbps(
    path: str | os.PathLike[str],
    *,
    threads: int = 2,
    cold: bool = False,
    runs: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
) -> float:
    """``preadv`` into a buffer whose pages are already backed (the reload limit)."""
    p = Path(path)
    nbytes = p.stat().st_size
    with open_file(p) as f, HostBuffer(nbytes, prefault=True) as buf:
        view = buf.memoryview

        def run() -> None:
            _parallel(
                threads,
                _chunks(nbytes, chunk_bytes),
                lambda off, n: f.read_into(view[off : off + n], off),
            )

        return _median_gbps(runs, nbytes, _prepare(p, cold), run)


def direct_gbps(
    path: str | os.PathLike[str],
    *,
    threads: int = 2,
    runs: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
    fresh: bool = False,
    backed: bool = False,
) -> float:
    """``O_DIRECT`` reads of aligned chunks into touched memory: the disk, no cache.
    ``fresh=True``: into never-touched memory, whose backing then delays each read
    (what a direct load into new buffers pays); with ``backed``, each chunk's pages
    backed in one call before its read (as a load's reader does), else faulted in by
    the read.

    Raises ``RuntimeError`` when the filesystem refuses ``O_DIRECT``.
    """
    p = Path(path)
    nbytes = p.stat().st_size
    bufs: list[HostBuffer] = []

    def prepare() -> None:
        # The cache is dropped anyway: O_DIRECT must first write back dirty pages.
        drop_from_cache(p)
        if fresh or not bufs:
            bufs.append(HostBuffer(align_up(nbytes, chunk_bytes), prefault=not fresh))

    def cleanup() -> None:
        while fresh and bufs:
            bufs.pop().close()

    with open_file(p, direct=True) as f:
        if not f.direct_ok:
            raise RuntimeError(f"{p}: O_DIRECT refused: {f.direct_refusal}")

        def run() -> None:
            buf = bufs[-1]
            view = buf.memoryview

            def step(off: int, n: int) -> None:
                if backed:
                    buf.populate(off, off + align_up(n, 4096))
                f.read_direct_into(view[off : off + align_up(n, 4096)], off)

            _parallel(threads, _chunks(nbytes, chunk_bytes), step)

        try:
            return _median_gbps(runs, nbytes, prepare, run, cleanup)
        finally:
            while bufs:
                bufs.pop().close()


def memcpy_gbps(
    nbytes: int, *, threads: int = 2, runs: int = 1, chunk_bytes: int = CHUNK_BYTES
) -> float:
    """Copy between two touched buffers on ``threads`` threads (memory bandwidth)."""
    n = max(min(nbytes, _MEMCPY_MAX_BYTES), PAGE_BYTES)
    with HostBuffer(n, prefault=True) as src, HostBuffer(n, prefault=True) as dst:
        a, b = src.as_array(), dst.as_array()

        def run() -> None:
            # numpy drops the GIL for plain byte copies.
            _parallel(
                threads,
                _chunks(n, chunk_bytes),
                lambda off, k: np.copyto(b[off : off + k], a[off : off + k]),
            )

        return _median_gbps(runs, n, lambda: None, run)


def mmap_touch_gbps(
    path: str | os.PathLike[str],
    *,
    threads: int = 2,
    cold: bool = False,
    runs: int = 1,
    chunk_bytes: int = CHUNK_BYTES,
) -> float:
    """Map the whole file and make it resident chunk by chunk (``MADV_POPULATE_READ``
    on ``threads`` threads): the mmap mode's work, done by hand."""
    p = Path(path)
    nbytes = p.stat().st_size

    warm_or_drop = _prepare(p, cold)
    maps: list[FileMapping] = []

    def prepare() -> None:
        warm_or_drop()
        maps.append(open_mapping(p, 0, nbytes))

    def run() -> None:
        m = maps[-1]
        _parallel(threads, _chunks(nbytes, chunk_bytes), lambda off, n: m.touch(off, off + n))

    def cleanup() -> None:
        while maps:
            maps.pop().close()

    return _median_gbps(runs, nbytes, prepare, run, cleanup)


def np_memmap_touch_s(path: str | os.PathLike[str], *, cold: bool = False) -> float:
    """Seconds to map the file with ``np.memmap`` and read one byte of every page (one
    thread): what "mapped and resident" costs the simplest way."""
    p = Path(path)
    _prepare(p, cold)()
    start = time.perf_counter()
    m = np.memmap(p, dtype=np.uint8, mode="r")
    m[::PAGE_BYTES].sum(dtype=np.uint64)
    took = time.perf_counter() - start  # unmapping is not counted, as for the loads
    m._mmap.close()  # type: ignore[attr-defined]  # unmap now, not at some later GC
    del m
    return took


def pinned_copy_gbps(nbytes: int = 256 << 20, *, runs: int = 3) -> float | None:
    """Host-to-device copy from pinned memory on GPU 0 (CuPy), or None without one."""
    try:
        import cupy  # pyright: ignore[reportMissingImports]  (the optional cupy extra)
    except ImportError:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        pinned = cupy.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(pinned, dtype=np.uint8, count=nbytes)
        host[::PAGE_BYTES] = 1
        dev = cupy.empty(nbytes, dtype=np.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        dev.set(host, stream=stream)  # first copy: driver setup, not counted
        stream.synchronize()
        rates = []
        for _ in range(max(runs, 1)):
            start = time.perf_counter()
            dev.set(host, stream=stream)
            stream.synchronize()
            rates.append(nbytes / (time.perf_counter() - start) / GB)
        return statistics.median(rates)
    except Exception:  # a broken driver means "no GPU limit", not a failed benchmark
        return None
