"""The engine: wires the stages of one load together with bounded queues.

::

    parse+index ─▶ plan ─▶ allocate ─┬▶ jobs[file 0] ─▶ readers ─┐
                                     ├▶ jobs[file 1] ─▶ readers ─┼▶ landed ─▶ tracker ─┐
                                     └▶ …                         ┘                    │
                                            validate ◀─ ready (tensor names) ◀────────┘

Every task lives in one task group; a failure anywhere cancels the rest and surfaces
as that one exception. Everything allocated is owned by a ``Resources`` stack until the
model takes it; if the load fails or is cancelled, the stack releases it all (files,
mappings, host and device buffers) before the exception propagates.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from functools import partial
from types import ModuleType
from typing import Any

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiogguf.config import Config
from aiogguf.errors import (
    BigEndianError,
    GGUFError,
    LoadError,
    TensorFailure,
    TensorValidationError,
)
from aiogguf.events import ProgressHub, Stage
from aiogguf.io.byteswap import can_convert, needs_swap, to_native
from aiogguf.io.devices.base import Device
from aiogguf.io.devices.registry import enumerate_devices
from aiogguf.io.files import DataFile, FileAdvice, align_up, open_file
from aiogguf.io.mapping import MapAdvice, numa_nodes
from aiogguf.io.workers import LoadThreads
from aiogguf.jobs import BufferLayout, ReadJob, TensorSlot
from aiogguf.model import Model
from aiogguf.records import Plan, TensorEntry, WeightIndex
from aiogguf.report import BufferReport, FileReport, LoadReport, StageReport
from aiogguf.stages.allocate import (
    DeviceImage,
    HostImage,
    Image,
    MappedImage,
    allocate_host,
    allocate_mapped,
    layout_buffers,
    load_order,
    read_jobs,
    tensor_slots,
)
from aiogguf.stages.index import open_index
from aiogguf.stages.plan import make_plan
from aiogguf.stages.read import Reader
from aiogguf.stages.upload import Uploader
from aiogguf.stages.validate import FileBytes, PieceCheck, ValidationCollector

__all__ = ["LoadWarning", "run_load"]


class LoadWarning(UserWarning):
    """Something about a load the user should know (a fallback, a low limit)."""


class _Spans:
    """Each buffer's tensors by file offset, for finding the tensors a read touched.
    Built once, read-only afterwards: reader threads may use it."""

    def __init__(self, index: WeightIndex, layouts: Sequence[BufferLayout]) -> None:
        self._spans: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
        for layout in layouts:
            if layout.plan.lazy:
                continue
            for rs in layout.slots:
                spans = self._spans.setdefault((layout.index, rs.range.file_index), [])
                spans.extend((index[n].offset, index[n].end, n) for n in rs.range.tensors)
        for spans in self._spans.values():
            spans.sort()

    def names(self) -> Iterator[str]:
        return (name for spans in self._spans.values() for _, _, name in spans)

    def overlapping(
        self, buffer_index: int, file_index: int, start: int, end: int
    ) -> Iterator[tuple[int, int, str]]:
        """``(lo, hi, name)``: the part ``[lo, hi)`` of each tensor inside ``[start, end)``."""
        spans = self._spans.get((buffer_index, file_index), [])
        i = max(bisect.bisect_right(spans, start, key=lambda e: e[0]) - 1, 0)
        while i < len(spans) and spans[i][0] < end:
            t_start, t_end, name = spans[i]
            lo, hi = max(t_start, start), min(t_end, end)
            if lo < hi:
                yield lo, hi, name
            i += 1


@contextmanager
def one_error() -> Iterator[None]:
    """Surface a failed task group as its first real error, not as an exception group:
    the caller of a load gets one clear exception (the others ride along as notes)."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        cancelled = anyio.get_cancelled_exc_class()
        real = [e for e in leaves if not isinstance(e, cancelled)]
        if not real:
            raise
        # A stage that failed closed its streams: a neighbour that then sent to it got
        # BrokenResourceError. That is an echo of the failure, not news.
        echoes = [e for e in real if isinstance(e, anyio.BrokenResourceError)]
        if len(echoes) < len(real):
            real = [e for e in real if e not in echoes]
        first = next((e for e in real if isinstance(e, GGUFError)), real[0])
        for other in real:
            if other is not first:
                first.add_note(f"also: {type(other).__name__}: {other}")
        raise first from None


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


class _Load:
    """One load in flight. Only ``run()`` is public; the rest is the wiring."""

    def __init__(
        self,
        index: WeightIndex,
        plan: Plan,
        devices: Sequence[Device],
        config: Config,
        hub: ProgressHub,
        shared_limiter: anyio.CapacityLimiter | None = None,
    ) -> None:
        self.shared_limiter = shared_limiter
        self.index = index
        self.plan = plan
        self.devices = {d.name: d for d in devices}
        self.config = config
        self.hub = hub
        self.mode = plan.mode
        self.alignment = config.pipeline.alignment
        self.layouts = layout_buffers(plan, self.alignment)
        self.slots: dict[str, TensorSlot] = tensor_slots(index, self.layouts)
        self.spans = _Spans(index, self.layouts)
        self.images: list[Image | None] = [None] * len(self.layouts)
        self.ready_events = [anyio.Event() for _ in self.layouts]
        self.warnings: list[str] = list(plan.warnings)
        self.stage_busy: dict[str, float] = {}
        self.validated = 0
        self.disks: list[str] = []  # per file: the disk it is read from
        self.files: list[DataFile] = []
        self.swap = needs_swap(index.byte_order)
        self._lock_refused = False
        self._prefault_threads: LoadThreads | None = None  # direct mode: backs pages ahead
        # Host tensors read by preadv/O_DIRECT are checked piece by piece as they land
        # (see Reader); mapped and device tensors by the validation stage, whole.
        self.piece_checks = self._piece_checks()
        self.piece_failures: list[TensorFailure] = []
        self._piece_lock = threading.Lock()
        self.piece_busy_s = 0.0
        self.piece_bytes = 0
        loaded = [t for t in plan.tensors if not t.lazy]
        self.bytes_total = sum(t.nbytes for t in loaded)
        self.tensors_total = len(loaded)
        self.bytes_done = 0
        self.tensors_done = 0

    # --- the whole load ---------------------------------------------------------------

    async def run(self, stack: AsyncExitStack) -> Model:
        """Load every tensor; resources go on ``stack`` (closed by the caller on failure)."""
        self._check_byte_order()
        files = self.files = await self._open_files(stack)
        # Registered before the uploader: on failure the uploader first waits for its
        # copies in flight, and only then are the buffers they write into freed.
        stack.push_async_callback(anyio.to_thread.run_sync, self._close_images_on_failure)
        uploader: Uploader | None = None
        if any(not lay.plan.host for lay in self.layouts):
            uploader = await stack.enter_async_context(
                Uploader(self.devices, self.config, self.mode)
            )
        limiters = self._disk_limiters(files)
        threads = await stack.enter_async_context(
            LoadThreads(int(sum(lim.total_tokens for lim in set(limiters))))
        )
        if self.mode == "direct" and self.config.load.prefetch:
            # One thread for all files: backing pages is CPU work, not I/O.
            self._prefault_threads = await stack.enter_async_context(
                LoadThreads(1, name="aiogguf-prefault")
            )
        workers = self.config.pipeline.validate_workers
        check_threads = await stack.enter_async_context(LoadThreads(workers, name="aiogguf-check"))
        reader = Reader(
            files,
            self.images,
            limiters,
            uploader,
            direct=[f.direct_ok for f in files],
            clock=self.hub.elapsed,
            swap=self._swap_job if self.swap else None,
            shared=self.shared_limiter,
            check=self._check_piece if self.piece_checks else None,
            threads=threads,
            check_threads=check_threads,
        )
        check = self.config.load.check_tensors
        t_read = self.hub.elapsed()
        validator = ValidationCollector(workers, threads=check_threads)
        # A stage that fails cancels the others; the caller sees its error, unwrapped.
        with one_error():
            async with validator:
                queue = self.config.pipeline.queue_depth
                landed_send, landed_recv = anyio.create_memory_object_stream[ReadJob](queue)
                ready_send, ready_recv = anyio.create_memory_object_stream[str](queue)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._allocate_all, files, uploader)
                    jobs = self._jobs(uploader)
                    for file_index, file_jobs in enumerate(jobs):
                        send, recv = anyio.create_memory_object_stream[ReadJob](queue)
                        tg.start_soon(self._emit, file_jobs, send)
                        n_tasks = int(limiters[file_index].total_tokens)
                        if reader.checks_apart(file_index):
                            # Tasks waiting on a check hold no read slot: the slots
                            # need tasks of their own to stay busy.
                            n_tasks += workers
                        async with recv:
                            for _ in range(n_tasks):
                                tg.start_soon(
                                    self._read_loop, reader, recv.clone(), landed_send.clone()
                                )
                    landed_send.close()
                    tg.start_soon(self._track, landed_recv, ready_send, uploader)
                    tg.start_soon(self._validate_loop, ready_recv, validator if check else None)
        read_s = self.hub.elapsed() - t_read
        # A file truncated, rewritten, replaced or deleted while it was read makes a
        # model whose bytes no longer match its file (and, mapped, one that a later
        # read of a cut-off page would kill): the load fails instead.
        for f, was_direct in zip(files, reader.direct, strict=True):
            await anyio.to_thread.run_sync(f.check_unchanged)
            if was_direct and not f.direct_ok:
                self._warn(f"{f.path}: {f.direct_refusal}; the rest was read with mode 'none'")
        failures = self._failures(validator)
        if check:
            self.validated = validator.submitted + len(self.piece_checks)
            if failures and not self.config.load.keep_invalid:
                raise TensorValidationError(failures, self.index.files[0].path)
        self._progress(Stage.DONE)
        report = self._report(reader, read_s, validator if check else None)
        images = list(self.images)
        self.images[:] = [None] * len(self.images)  # the model owns them now
        return Model(self.index, self.plan, images, self.slots, report, failures=failures)

    # --- open, allocate ---------------------------------------------------------------

    def _check_byte_order(self) -> None:
        if not self.swap:
            return
        for t in self.plan.tensors:
            entry = self.index[t.name]
            if not can_convert(entry.type):
                raise BigEndianError(
                    self.index.files[entry.file_index].path,
                    entry.offset,
                    f"big-endian GGUF: byte order of type {entry.type.name} cannot be "
                    f"converted (tensor '{entry.name}')",
                )

    async def _open_files(self, stack: AsyncExitStack) -> list[DataFile]:
        direct = self.mode == "direct"
        files: list[DataFile] = []
        for parsed in self.index.files:
            f = await anyio.to_thread.run_sync(
                partial(open_file, parsed.path, direct=direct, alignment=self.alignment)
            )
            stack.callback(f.close)
            files.append(f)
            if direct and not f.direct_ok:
                self._warn(f"{parsed.path}: {f.direct_refusal}; reading with mode 'none' instead")
        if self.mode in ("mmap", "mlock"):
            for f in files:
                await anyio.to_thread.run_sync(f.fadvise, FileAdvice.SEQUENTIAL)
        return files

    def _piece_checks(self) -> dict[str, PieceCheck]:
        if not self.config.load.check_tensors or self.swap or self.mode not in ("none", "direct"):
            return {}
        return {
            name: PieceCheck(name, self.index[name].type, self.index[name].nbytes)
            for layout in self.layouts
            if layout.plan.host and not layout.plan.lazy
            for name in layout.plan.tensors
        }

    def _disk_limiters(self, files: Sequence[DataFile]) -> list[anyio.CapacityLimiter]:
        """One reader limiter per disk, shared by the files on it: a disk is a
        ``[[pipeline.path]]`` prefix, else the filesystem device the file lives on."""
        by_disk: dict[str, anyio.CapacityLimiter] = {}
        limiters: list[anyio.CapacityLimiter] = []
        self.disks = []
        for f in files:
            disk = self._disk_of(f)
            if disk not in by_disk:
                by_disk[disk] = anyio.CapacityLimiter(self.config.pipeline.readers_for(f.path))
            limiters.append(by_disk[disk])
            self.disks.append(disk)
        return limiters

    def _disk_of(self, f: DataFile) -> str:
        limit = self.config.pipeline.path_limit(f.path)
        if limit is not None:
            return limit.prefix
        dev = os.stat(f.fileno()).st_dev
        return f"dev {os.major(dev)}:{os.minor(dev)}"

    async def _allocate_all(self, files: Sequence[DataFile], uploader: Uploader | None) -> None:
        """Allocate buffers in load order; readers of buffer k start once k is ready."""
        mapped_mode = self.mode in ("mmap", "mlock")
        numa = numa_nodes() > 1
        start = self.hub.elapsed()
        for k in self._allocation_order():
            layout = self.layouts[k]
            image: Image
            if not layout.plan.host:
                assert uploader is not None
                buffer = await uploader.allocate(layout.plan.device, max(layout.nbytes, 1))
                image = DeviceImage(layout, buffer)
            elif mapped_mode and (layout.plan.lazy or not self.swap):
                # Big-endian files are copied even in the mapped modes (lazy ranges stay
                # mapped: nothing reads them during the load): swapping in place writes
                # every page of a private mapping, so a mapping would save no memory, and
                # the swap's own writes would be exposed to SIGBUS if the file were cut.
                mapped_image = await anyio.to_thread.run_sync(
                    partial(allocate_mapped, layout, files, writable=self.swap)
                )
                # Owned at once: cancelled at the next await, it must still be unmapped.
                self.images[k] = mapped_image
                await anyio.to_thread.run_sync(self._advise, mapped_image, numa)
                image = mapped_image
            else:
                image = await anyio.to_thread.run_sync(allocate_host, layout, self.alignment)
            self.images[k] = image
            self.ready_events[k].set()
        self.stage_busy["allocate"] = self.hub.elapsed() - start

    def _allocation_order(self) -> list[int]:
        staged = [lay.index for lay in self.layouts if not lay.plan.host]
        host = [lay.index for lay in self.layouts if lay.plan.host]
        return staged + host

    def _advise(self, image: MappedImage, numa: bool) -> None:
        """Lazy ranges are read on demand (random); on a NUMA machine nothing is
        prefetched, so pages land on the node that first touches them."""
        random = image.layout.plan.lazy or numa
        if not random and not self.config.load.prefetch:
            return
        advice = MapAdvice.RANDOM if random else MapAdvice.WILLNEED
        for rs, mapping in zip(image.layout.slots, image.mappings, strict=True):
            mapping.advise(advice, rs.range.start, rs.range.end)

    def _close_images_on_failure(self) -> None:
        for i, image in enumerate(self.images):
            if image is not None:
                image.close()
                self.images[i] = None

    # --- jobs and reading -------------------------------------------------------------

    def _jobs(self, uploader: Uploader | None) -> list[list[ReadJob]]:
        """Jobs per file, in load order. Lazy ranges are only mapped, never read."""
        ordered = [item for item in load_order(self.index, self.layouts) if not item[0].plan.lazy]
        chunk = align_up(self.config.pipeline.chunk_size, self.alignment)
        aligned = self.mode == "direct"
        per_file: list[list[ReadJob]] = [[] for _ in self.index.files]
        staged = [item for item in ordered if not item[0].plan.host]
        hosted = [item for item in ordered if item[0].plan.host]
        if staged:
            assert uploader is not None
            slot = uploader.staging_bytes - uploader.staging_bytes % self.alignment
            for job in read_jobs(staged, min(chunk, slot), aligned=aligned):
                per_file[job.file_index].append(job)
        for job in read_jobs(hosted, chunk, aligned=aligned):
            per_file[job.file_index].append(job)
        return per_file

    async def _emit(self, jobs: Sequence[ReadJob], send: MemoryObjectSendStream[ReadJob]) -> None:
        """Hand out one file's jobs in load order, each once its buffer exists. In
        ``direct`` mode the CPU waits for the disk anyway: a helper backs the destination
        pages of the jobs not handed out yet, so that their reads take no page faults.
        It never holds a job back: a reader that catches up faults its own pages (two
        readers then back memory side by side, faster than the one helper)."""
        handed = 0  # jobs handed out so far

        async def prefault_ahead() -> None:
            i = 0
            while (i := max(i, handed)) < len(jobs):
                job = jobs[i]
                await self.ready_events[job.buffer_index].wait()
                image = self.images[job.buffer_index]
                if isinstance(image, HostImage):
                    assert self._prefault_threads is not None
                    await self._prefault_threads.run_sync(image.prefault, job)
                i += 1

        async with send, anyio.create_task_group() as tg:
            if self._prefault_threads is not None:
                tg.start_soon(prefault_ahead)
            for job in jobs:
                await self.ready_events[job.buffer_index].wait()
                await send.send(job)
                handed += 1
            tg.cancel_scope.cancel()  # nothing is left to back ahead of the readers

    async def _read_loop(
        self,
        reader: Reader,
        jobs: MemoryObjectReceiveStream[ReadJob],
        landed: MemoryObjectSendStream[ReadJob],
    ) -> None:
        async with jobs, landed:
            async for job in jobs:
                await reader.read(job)
                await landed.send(job)

    def _swap_job(self, job: ReadJob, view: memoryview) -> None:
        """Byte-swap, in place, the elements of every tensor that ``job`` carries."""
        data = np.frombuffer(view, dtype=np.uint8)
        layout = self.layouts[job.buffer_index]
        for rs in layout.slots:
            r = rs.range
            if r.file_index != job.file_index or r.end <= job.useful_start:
                continue
            if r.start >= job.useful_end:
                break
            for name in r.tensors:
                entry = self.index[name]
                lo, hi = max(entry.offset, job.useful_start), min(entry.end, job.useful_end)
                if lo < hi:
                    to_native(
                        entry.type,
                        data[lo - job.file_offset : hi - job.file_offset],
                        path=self.index.files[entry.file_index].path,
                        name=name,
                    )

    # --- completion and validation ----------------------------------------------------

    async def _track(
        self,
        landed: MemoryObjectReceiveStream[ReadJob],
        ready: MemoryObjectSendStream[str],
        uploader: Uploader | None,
    ) -> None:
        """Turn landed jobs into ready tensors. Device tensors are ready once their
        copies completed: after the upload stage drained."""
        remaining = {name: self.index[name].nbytes for name in self.spans.names()}
        device_tensors: list[str] = []
        async with landed, ready:
            async for job in landed:
                self.bytes_done += job.useful_end - job.useful_start
                on_device = not self.layouts[job.buffer_index].plan.host
                spans = self.spans.overlapping(
                    job.buffer_index, job.file_index, job.useful_start, job.useful_end
                )
                for lo, hi, name in spans:
                    remaining[name] -= hi - lo
                    if remaining[name]:
                        continue
                    if on_device:
                        device_tensors.append(name)
                    else:
                        await ready.send(name)
                self._progress(Stage.READ)
            if uploader is not None:
                await uploader.drain()
            for name in device_tensors:
                await ready.send(name)

    async def _validate_loop(
        self,
        ready: MemoryObjectReceiveStream[str],
        validator: ValidationCollector | None,
    ) -> None:
        lock = self.mode == "mlock"
        async with ready:
            async for name in ready:
                if lock:
                    await self._lock(name)
                piece_check = self.piece_checks.get(name)
                if piece_check is not None:
                    # Its pieces were checked as they landed: only the units that
                    # straddled two pieces are left.
                    data, _ = self._tensor_data(self.index[name], self._image_of(name))
                    failure = await anyio.to_thread.run_sync(piece_check.finish, data)
                    if failure is not None:
                        self.piece_failures.append(failure)
                elif validator is not None:
                    entry = self.index[name]
                    image = self._image_of(name)
                    if isinstance(image, MappedImage):
                        # Checked through reads of the file, never through the mapping
                        # (FileBytes says why).
                        source = FileBytes(self.files[entry.file_index], entry.offset, entry.nbytes)
                        await validator.submit(name, entry.type, source)
                    else:
                        data, xp = self._tensor_data(entry, image)
                        await validator.submit(name, entry.type, data, xp=xp)
                self.tensors_done += 1
                self._progress(Stage.READ)

    def _progress(self, stage: Stage) -> None:
        """Report the counts so far (throttled, except the final event)."""
        self.hub.emit(
            stage,
            self.bytes_done,
            self.bytes_total,
            self.tensors_done,
            self.tensors_total,
            force=stage is Stage.DONE,
        )

    def _image_of(self, name: str) -> Image | None:
        return self.images[self.slots[name].buffer_index]

    def _check_piece(self, job: ReadJob, file_offset: int, piece: memoryview) -> None:
        """Reader thread: validate the tensors' bytes in a piece that has just landed."""
        began = time.perf_counter()
        data = np.frombuffer(piece, dtype=np.uint8)
        end = file_offset + len(data)
        for lo, hi, name in self.spans.overlapping(
            job.buffer_index, job.file_index, file_offset, end
        ):
            self.piece_checks[name].check_piece(
                data[lo - file_offset : hi - file_offset], lo - self.index[name].offset
            )
        with self._piece_lock:
            self.piece_busy_s += time.perf_counter() - began
            self.piece_bytes += len(data)

    def _failures(self, validator: ValidationCollector) -> tuple[TensorFailure, ...]:
        """Every bad tensor, from both ways of checking, in index order."""
        order = {t.name: i for i, t in enumerate(self.index.tensors)}
        found = [*validator.failures, *self.piece_failures]
        return tuple(sorted(found, key=lambda f: order[f.name]))

    def _tensor_data(self, entry: TensorEntry, image: Image | None) -> tuple[Any, ModuleType]:
        slot = self.slots[entry.name]
        if isinstance(image, DeviceImage):
            return image.buffer.array(slot.buffer_offset, slot.nbytes), image.buffer.xp
        assert isinstance(image, HostImage | MappedImage)
        return np.frombuffer(image.tensor_bytes(slot), dtype=np.uint8), np

    async def _lock(self, name: str) -> None:
        """mlock mode: the locked range grows tensor by tensor."""
        image = self.images[self.slots[name].buffer_index]
        if not isinstance(image, MappedImage) or image.layout.plan.lazy:
            return
        entry = self.index[name]
        mapping = image.mapping_at(entry.file_index, entry.offset)
        result = await anyio.to_thread.run_sync(mapping.lock, entry.offset, entry.end)
        if not result.ok and not self._lock_refused:
            self._lock_refused = True  # one warning per load: the rest would say the same
            needed = sum(t.nbytes for t in self.plan.tensors if not t.lazy)
            self._warn(
                f"{result.problem}; the whole load needs {needed} bytes locked; "
                "it goes on with the rest unlocked"
            )

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        warnings.warn(message, LoadWarning, stacklevel=2)

    # --- report -----------------------------------------------------------------------

    def _report(
        self, reader: Reader, read_s: float, validator: ValidationCollector | None
    ) -> LoadReport:
        files = tuple(
            FileReport(
                path=parsed.path,
                nbytes=stats.nbytes,
                reads=stats.reads,
                start_s=stats.first_start or 0.0,
                end_s=stats.last_end,
                direct=self.mode == "direct" and reader_direct,
                disk=disk,
            )
            for parsed, stats, reader_direct, disk in zip(
                self.index.files, reader.stats, reader.direct, self.disks, strict=True
            )
        )
        stages = [
            StageReport(
                "parse+index",
                self.stage_busy.get("parse", 0.0),
                self.stage_busy.get("parse", 0.0),
                len(self.index.files),
                0,
            ),
            StageReport(
                "plan",
                self.stage_busy.get("plan", 0.0),
                self.stage_busy.get("plan", 0.0),
                len(self.plan.tensors),
                0,
            ),
            StageReport(
                "allocate",
                self.stage_busy.get("allocate", 0.0),
                self.stage_busy.get("allocate", 0.0),
                len(self.layouts),
                sum(lay.nbytes for lay in self.layouts),
            ),
            StageReport(
                "read",
                read_s,
                sum(s.busy_s for s in reader.stats),
                sum(s.reads for s in reader.stats),
                sum(s.nbytes for s in reader.stats),
            ),
        ]
        if validator is not None:
            stages.append(
                StageReport(
                    "validate",
                    read_s,
                    validator.busy_s + self.piece_busy_s,
                    validator.submitted + len(self.piece_checks),
                    validator.bytes_checked + self.piece_bytes,
                )
            )
        buffers = tuple(
            BufferReport(b.device, b.buffer_type, b.lazy, b.nbytes, len(b.tensors))
            for b in self.plan.buffers
        )
        return LoadReport(
            path=self.index.files[0].path,
            mode=self.mode,
            total_s=self.hub.elapsed(),
            nbytes=self.bytes_total,
            n_tensors=self.tensors_total,
            stages=tuple(stages),
            buffers=buffers,
            files=files,
            validated=self.validated,
            warnings=tuple(self.warnings),
        )


async def run_load(
    path: str | os.PathLike[str],
    config: Config,
    hub: ProgressHub,
    stack: AsyncExitStack,
    *,
    devices: Sequence[Device] | None = None,
    limiter: anyio.CapacityLimiter | None = None,
) -> Model:
    """Parse, index, plan and load ``path``. Resources are pushed on ``stack`` until the
    returned model owns them; on failure the caller closes the stack. ``limiter``, shared
    between loads, bounds their reads in flight together."""
    t0 = hub.elapsed()
    hub.emit(Stage.PARSE, 0, 0, 0, 0, f"parsing {os.fspath(path)}", force=True)
    index = await open_index(path)
    t1 = hub.elapsed()
    devices = tuple(devices) if devices is not None else enumerate_devices(config)
    plan = make_plan(index, devices, config)
    t2 = hub.elapsed()
    load = _Load(index, plan, devices, config, hub, limiter)
    load.stage_busy["parse"] = t1 - t0
    load.stage_busy["plan"] = t2 - t1
    hub.emit(
        Stage.PLAN,
        0,
        load.bytes_total,
        0,
        load.tensors_total,
        f"{len(plan.buffers)} buffers",
        force=True,
    )
    try:
        return await load.run(stack)
    except MemoryError as exc:
        # Host memory refused (a buffer, a staging slot) is a failed load like a refused
        # mapping, which already is a LoadError: one error, and one exit status, for
        # running out of memory in every mode.
        raise LoadError(index.files[0].path, None, f"out of host memory: {exc}") from exc
