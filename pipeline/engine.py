"""The engine: wires the stages of one load together through records, protocols and
callbacks; no stage calls another.

::

    parse+index ─▶ plan ─▶ allocate ─┬▶ jobs[file 0] ─▶ readers ─┐
                                     ├▶ jobs[file 1] ─▶ readers ─┼▶ landed (callback) ─┐
                                     ├▶ …                         ┘                    │
                                     └▶ device jobs ─▶ transfer threads ─▶ (copied) ──┤
                                            validate ◀─ ready (tensor names) ◀────────┘

Device-bound jobs go to the upload stage as one list: its transfer threads read, copy
and check them without a trip through the event loop per job, and tell the loop only
what has landed. Host jobs likewise: each reader thread takes its file's next job as
soon as it is done with the last, and the one that finishes a file last checks that
the file did not change. Parsing, index building, device discovery (CuPy's import,
CUDA's start-up), planning, opening the files, laying out the buffers, allocating the
host ones, cutting the jobs and starting the host reads run on the load's own thread,
for a single-file model in one call (``_Front``): the loop's thread only awaits, and
the reads run while it sets up the rest.

How the stages are joined: the front hands on records (one ``_Layout``: the ``Plan``,
``BufferLayout``s, ``TensorSlot``s, ``ReadJob``s that ``aiogguf.jobs`` cuts). The reader
hands each landed piece to a ``PieceSink`` (the validate stage's piece checks, when some
tensor is checked by pieces) and the upload stage fills each staging slot with a
``SlotFill`` (the reader's ``fill_slot``): the engine wires both. Each landed host job
goes, by a callback on the loop's thread attached before the reads start, to
``_Progress``, which counts it and puts the tensors it completed on one memory object
stream to the checks (``Validation.tensors_ready``). That stream has room for every job,
so it never pushes back (nor does the read stage's own, on which ``O_DIRECT`` jobs wait
for the check threads): what bounds memory is the buffers the plan allocates, the
staging slots (a transfer thread waits for a free one) and the whole-tensor checks in
flight (``submit`` waits for a free one).

The engine only wires. Each stage's own work lives in its module: descriptors, disk
limits, byte order and locks in ``read``; images and mapping advice in ``allocate``;
both ways of checking a tensor behind ``validate.Validation`` (the rules in
``aiogguf.checks``); and ``report.build_report`` turns what the stages counted into
the report.

Every task lives in one task group; a failure anywhere cancels the rest and surfaces
as that one exception. Everything the load opens, allocates, lends or starts is owned by
one ``LoadResources`` until the model takes the images. If the load fails or is
cancelled, the task group's cancellation stops the transfers and reads (each thread call
is still waited for), and the resources' one close stops any reads still running (a
load that failed before its streaming half) and then releases it all (threads,
mappings, host and device buffers, files) before the exception propagates.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiogguf.config import Config
from aiogguf.devices import enumerate_devices
from aiogguf.errors import (
    GGUFError,
    LoadError,
    LoadWarning,
    from_os_error,
)
from aiogguf.events import ProgressHub, Stage
from aiogguf.headers import open_index, read_whole_model
from aiogguf.images import DeviceImage
from aiogguf.integrity import IntegrityChecker
from aiogguf.integrity_sink import (
    IntegritySink,
    block_grid,
    both,
    find_manifest,
    open_manifest,
    verdict,
)
from aiogguf.io.byteswap import needs_swap
from aiogguf.io.devices.base import Device, DeviceBuffer
from aiogguf.io.files import DataFile
from aiogguf.io.opener import FileOpener
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import raise_if_stopped, reserve_threads
from aiogguf.jobs import (
    BufferLayout,
    PieceSink,
    ReadJob,
    SlotFill,
    StageTimes,
    TensorSlot,
    TensorSpans,
    job_bytes,
    layout_buffers,
    split_jobs,
    tensor_slots,
)
from aiogguf.load_resources import LoadResources
from aiogguf.model import Model
from aiogguf.records import ParsedFile, Plan, WeightIndex
from aiogguf.remote import is_remote, read_remote_model, remote_config, remote_disks
from aiogguf.report import LoadReport, build_report
from aiogguf.stages.allocate import Allocation, allocate_host_images
from aiogguf.stages.plan import MAPPED_MODES, make_plan
from aiogguf.stages.read import (
    ByteSwap,
    Disks,
    HostReads,
    Reader,
    direct_refusals,
    find_disks,
    open_data_files,
)
from aiogguf.stages.upload import DeviceUploadStats, Uploader
from aiogguf.stages.validate import Validation

__all__ = ["load_thread_count", "one_error", "run_load"]


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


class _Progress:
    """Counts landed bytes and finished tensors, reports them as progress events, and
    puts the names of the tensors whose bytes have all landed on ``ready`` for the checks
    (on the loop's thread only; made before the reads start, silent until ``go_live``).

    Tensor names travel in lists, one per landed host job and one for the device tensors
    (a send per tensor would be a loop iteration per tensor), with room for all
    (``jobs``, plus the device tensors' list): host jobs put theirs from a loop callback
    (``host_landed``), which cannot wait."""

    def __init__(
        self,
        hub: ProgressHub,
        plan: Plan,
        layouts: Sequence[BufferLayout],
        spans: TensorSpans,
        *,
        jobs: int,
        checked: bool,
    ) -> None:
        self._hub = hub
        self._layouts = layouts
        self._spans = spans
        self._checked = checked
        self._live = False
        ready: _Names = anyio.create_memory_object_stream(jobs + 1)
        self.ready_send, self.ready_receive = ready
        loaded = [t for t in plan.tensors if not t.lazy]
        self.bytes_total = sum(t.nbytes for t in loaded)
        self.tensors_total = len(loaded)
        self.bytes_done = 0
        self.tensors_done = 0
        # Bytes of each tensor still to land.
        self._remaining = spans.sizes()
        self.device_landed: list[str] = []  # device tensors whose bytes all landed

    def landed(self, job: ReadJob) -> list[str]:
        """Count a landed job; the host tensors it completed. Device tensors it completed
        are kept in ``device_landed``: they are ready once their copies have completed."""
        self.bytes_done += job.useful_end - job.useful_start
        on_device = not self._layouts[job.buffer_index].plan.host
        done: list[str] = []
        for lo, hi, name in self._spans.overlapping(
            job.buffer_index, job.file_index, job.useful_start, job.useful_end
        ):
            self._remaining[name] -= hi - lo
            if not self._remaining[name]:
                (self.device_landed if on_device else done).append(name)
        self.emit(Stage.READ)
        return done

    def host_landed(self, job: ReadJob) -> None:
        """Where the host reads hand each landed job (on the loop's thread)."""
        names = self.landed(job)
        if not names:
            return
        if not self._checked:
            self.tensors_checked(len(names))
            return
        # Broken only once the load is failing anyway.
        with contextlib.suppress(anyio.BrokenResourceError):
            self.ready_send.send_nowait(names)

    def tensors_checked(self, count: int) -> None:
        self.tensors_done += count
        self.emit(Stage.READ)

    def go_live(self) -> None:
        """Report from now on: the plan's event is out (jobs that landed before it were
        counted in silence)."""
        self._live = True
        self.emit(Stage.READ)

    def close(self) -> None:
        """Close both ends of ``ready`` (harmless when the load has)."""
        self.ready_send.close()
        self.ready_receive.close()

    def emit(self, stage: Stage) -> None:
        """Report the counts so far (throttled, except the final event)."""
        if not self._live:
            return
        self._hub.emit(
            stage,
            self.bytes_done,
            self.bytes_total,
            self.tensors_done,
            self.tensors_total,
            force=stage is Stage.DONE,
        )


class _Load:
    """One load in flight. Only ``run()`` is public; the rest is the wiring: what each
    stage does lives in its module, what the load did is put together by ``report``.

    It gets the load's ``_Layout`` (a record), its read side (started already) and its
    ``LoadResources``, which hold everything open until the caller closes them."""

    def __init__(
        self,
        index: WeightIndex,
        layout: _Layout,
        reading: _ReadSide,
        resources: LoadResources,
        config: Config,
        hub: ProgressHub,
        *,
        metadata_stages: Sequence[tuple[str, StageTimes]] = (),
    ) -> None:
        self.index = index
        self.layout = layout
        self.reading = reading
        self.resources = resources
        self.config = config
        self.hub = hub
        # Host images exist already; device ones are allocated by ``run``.
        self.allocation = Allocation(
            layout.layouts,
            resources.images,
            resources.place,
            clock=hub.elapsed,
            host_times=layout.host_times,
        )
        self.warnings: list[str] = list(layout.plan.warnings)
        self.stages: list[tuple[str, StageTimes]] = list(metadata_stages)

    # --- the whole load ---------------------------------------------------------------

    async def run(self) -> Model:
        """Load every tensor; what it holds stays with ``resources`` (closed by the caller)
        but for the images, which the model takes."""
        resources, layout, plan = self.resources, self.layout, self.layout.plan
        files = resources.files
        for warning in direct_refusals(resources.local_files, plan.mode):
            self._warn(warning)
        reading = self.reading
        validation, reader, progress = reading.validation, reading.reader, reading.progress
        uploader: Uploader | None = None
        if any(not lay.plan.host for lay in layout.layouts):
            # Transfer threads: as many as the busiest disk allows readers (a transfer
            # thread reads as much as it copies).
            devices = {d.name: d for d in layout.devices}
            uploader = await resources.open_uploader(
                devices, self.config, threads=layout.disks.busiest
            )
        # A stage that fails cancels the others; the caller sees its error, unwrapped.
        with one_error():
            async with validation:
                await self._stream(uploader)
        if reader.lock_refusal is not None:
            self._warn(
                f"{reader.lock_refusal}; the whole load needs {progress.bytes_total} "
                "bytes locked; it goes on with the rest unlocked"
            )
        uploads = uploader.stats if uploader is not None else ()
        # A file truncated, rewritten, replaced or deleted while it was read makes a
        # model whose bytes no longer match its file (and, mapped, one that a later
        # read of a cut-off page would kill): the load fails instead. The readers
        # checked the files that only they read; those the transfer threads read too
        # are checked here.
        if staged := [files[i] for i in layout.staged_files]:
            await resources.thread.run_sync(_check_unchanged, staged)
        for f, was_direct in zip(files, reader.direct, strict=True):
            if was_direct and not f.direct_ok:
                self._warn(f"{f.path}: {f.direct_refusal}; the rest was read with mode 'none'")
        path = self.index.files[0].path
        found = None
        if reading.integrity is not None:
            # The blocks no landed piece held whole, then the verdict.
            found = await resources.thread.run_sync(reading.integrity.error, path)
        failures, error = verdict(found, validation.failures, path)
        if error is not None and not self.config.load.keep_invalid:
            raise error
        progress.emit(Stage.DONE)
        report = _report(self, uploads)
        images = resources.take_images()  # the model owns them now
        return Model(self.index, plan, images, layout.slots, report, failures=failures)

    async def _stream(self, uploader: Uploader | None) -> None:
        """The streaming half: the host reads (started already), device buffers,
        transfers and checks, all at once."""
        pipeline = self.config.pipeline
        device_jobs = self.layout.device_jobs
        if uploader is not None:
            assert uploader.slot_bytes == pipeline.staging_bytes(), "device jobs fill a slot each"
        reading = self.reading
        progress = reading.progress
        ready_send = progress.ready_send
        progress.go_live()
        async with anyio.create_task_group() as tg:
            if uploader is not None:
                tg.start_soon(self.allocation.run, uploader.allocate)
            if device_jobs:
                assert uploader is not None
                tg.start_soon(self._transfer, uploader, device_jobs, ready_send.clone())
            tg.start_soon(self._host, reading.reads, ready_send)
            tg.start_soon(self._validate_loop, progress.ready_receive)

    @staticmethod
    async def _host(reads: HostReads, ready: MemoryObjectSendStream[list[str]]) -> None:
        async with ready:
            await reads.finish()

    # --- read and upload --------------------------------------------------------------

    async def _transfer(
        self,
        uploader: Uploader,
        jobs: Sequence[ReadJob],
        ready: MemoryObjectSendStream[list[str]],
    ) -> None:
        """Every device job through the upload stage's transfer threads; then the device
        tensors are ready (every copy has completed when ``transfer`` returns)."""
        reader, progress = self.reading.reader, self.reading.progress
        async with ready:
            targets: list[tuple[ReadJob, DeviceBuffer]] = []
            for job in jobs:
                image = await self.allocation.ready(job.buffer_index)
                assert isinstance(image, DeviceImage)
                targets.append((job, image.buffer))

            def landed(job: ReadJob) -> None:
                now = self.hub.elapsed()
                reader.count(job, now, now)
                progress.landed(job)

            # Device jobs are read (and checked) before they land: the read stage starts
            # now, before the validate stage's first check.
            began = self.hub.elapsed()
            for file_index in {job.file_index for job in jobs}:
                reader.started(file_index, began)
            # The reader fills each slot, handing its pieces to the piece sink as they land.
            fill: SlotFill = reader.fill_slot
            await uploader.transfer(targets, fill, landed=landed)
            if progress.device_landed:
                await ready.send(list(progress.device_landed))

    # --- completion and validation ----------------------------------------------------

    async def _validate_loop(self, ready: MemoryObjectReceiveStream[list[str]]) -> None:
        validation, progress = self.reading.validation, self.reading.progress
        async with ready:
            async for names in _batches(ready):
                await validation.tensors_ready(names)
                progress.tensors_checked(len(names))

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        warnings.warn(message, LoadWarning, stacklevel=2)


def _report(load: _Load, uploads: Sequence[DeviceUploadStats]) -> LoadReport:
    """The finished load's report, from what each stage counted."""
    reader, validation = load.reading.reader, load.reading.validation
    plan, disks = load.layout.plan, load.layout.disks.names
    stages = [
        *load.stages,
        ("allocate", load.allocation.times()),
        ("read", reader.times(fill_s=sum(u.fill_s for u in uploads))),
    ]
    if validation.enabled:
        stages.append(("validate", validation.times()))
    files = load.index.files
    return build_report(
        plan,
        path=files[0].path,
        total_s=load.hub.elapsed(),
        stages=stages,
        files=[
            (parsed.path, stats, plan.mode == "direct" and direct, disk)
            for parsed, stats, direct, disk in zip(
                files, reader.stats, reader.direct, disks, strict=True
            )
        ],
        uploads=uploads,
        validated=validation.checked,
        blocks_hashed=load.reading.integrity.hashed if load.reading.integrity else 0,
        warnings=load.warnings,
    )


def load_thread_count(config: Config, *, uploads: bool = True) -> int:
    """How many threads a load of ``config`` holds at once, at most: its own, readers,
    check threads and (``uploads``) transfer threads."""
    pipeline = config.pipeline
    readers = pipeline.reader_count(direct=config.load.mode == "direct")
    checks = pipeline.validate_workers if config.load.check_tensors else 0
    return 1 + readers + checks + (readers if uploads else 0)


async def _batches(stream: MemoryObjectReceiveStream[list[str]]) -> AsyncIterator[list[str]]:
    """Each list with every list that arrived meanwhile: one batch per wake-up."""
    async for first in stream:
        batch = list(first)
        with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):
            while True:
                batch.extend(stream.receive_nowait())
        yield batch


def _check_unchanged(files: Sequence[ByteSource]) -> None:
    """Blocking: raise ``LoadError`` for the first file that changed during the load."""
    for f in files:
        f.check_unchanged()


# Not ``create_memory_object_stream[list[str]]``: a subscript is built at run time, and
# the first one in a process costs as much as the rest of a small load's setup.
_Names = tuple[MemoryObjectSendStream[list[str]], MemoryObjectReceiveStream[list[str]]]


@dataclass(frozen=True, slots=True)
class _Layout:
    """How one load lies out, made on the load's thread before its first read: the
    devices and plan (``planned``: when, on the load's clock), the buffer layouts,
    where each tensor sits (``slots``, ``spans``), when the host images were allocated,
    each file's disk, the jobs, and the files the transfer threads read from too. A
    record: nothing in it is open or running (that is the ``LoadResources``')."""

    devices: tuple[Device, ...]
    plan: Plan
    planned: float
    layouts: tuple[BufferLayout, ...]
    slots: dict[str, TensorSlot]
    spans: TensorSpans
    host_times: StageTimes
    disks: Disks
    jobs: list[list[ReadJob]]  # host jobs, per file
    device_jobs: list[ReadJob]
    staged_files: tuple[int, ...]
    checker: IntegrityChecker | None  # the manifest's, when one is checked


@dataclass(frozen=True, slots=True)
class _ReadSide:
    """The read side of one load, its host reads already started on the load's thread:
    the checks, the reader, the reads (owned by the ``LoadResources``, which stops
    them), and ``_Progress``, where their landed jobs go."""

    validation: Validation
    reader: Reader
    reads: HostReads
    progress: _Progress
    integrity: IntegritySink | None


@dataclass(frozen=True, slots=True)
class _Front:
    """The blocking front of one load, run on the load's thread, up to the first byte
    read: it plans with ``config`` for ``devices`` (None: discover them), times itself
    with ``clock`` and ends by starting the host reads, whose landed jobs go to a
    ``_Progress`` that reports to ``hub``. It reads through ``resources.opened``, and the
    files it opens, the host images it allocates, the threads it lends and the reads it
    starts are ``resources``' as soon as each is made: its close frees them all."""

    resources: LoadResources
    config: Config
    devices: Sequence[Device] | None
    clock: Callable[[], float]
    hub: ProgressHub
    remote: bool  # a URL: its one file is an ``HttpSource`` (``aiogguf.remote``)
    opener: FileOpener | None = None  # opens a URL too when it is a ``RemoteOpener``

    def parse_and_plan(
        self, path: str
    ) -> tuple[ParsedFile, tuple[WeightIndex, float, _Layout, _ReadSide] | None]:
        """Blocking: a single-file model parsed, indexed and ``plan_and_open``-ed in one
        call: each call is a round trip through the loop, and in a fresh process the
        round trips cost as much as the work. Returns the header and (index, when it was
        indexed, the layout, the read side); for a split set only the first file's
        header, and nothing is opened."""
        whole: tuple[ParsedFile, WeightIndex | None]
        if self.remote:  # every split too: each opened and parsed on this thread
            whole = read_remote_model(path, self.config, self.resources.keep_file, self.opener)
        else:
            whole = read_whole_model(path, self.resources.opened)
        first, index = whole
        if index is None:
            return first, None
        indexed = self.clock()
        return first, (index, indexed, *self.plan_and_open(index))

    def plan_and_open(self, index: WeightIndex) -> tuple[_Layout, _ReadSide]:
        """Blocking: the load's devices (the first discovery imports CuPy and starts
        CUDA) and its plan (placement rules are matched against every tensor name); then
        the files to read, opened in the plan's mode, the layout (``_lay_out``) and the
        host reads started (``_start_reads``)."""
        config = self.config
        found = tuple(self.devices) if self.devices is not None else enumerate_devices(config)
        plan = make_plan(index, found, config)
        raise_if_stopped()
        resources = self.resources
        if not self.remote:  # the remote file was opened to be parsed
            open_data_files(
                index,
                resources.opened,
                mode=plan.mode,
                alignment=config.pipeline.alignment,
                keep=resources.keep_file,
            )
        checker = None
        if (manifest := find_manifest(config.load.manifest, index.files[0].path)) is not None:
            checker = open_manifest(manifest, index, resources.files, resources.opened)
        layout = self._lay_out(index, found, plan, self.clock(), checker)
        raise_if_stopped()  # a cancelled load starts no read
        return layout, self._start_reads(index, layout)

    def _lay_out(
        self,
        index: WeightIndex,
        devices: tuple[Device, ...],
        plan: Plan,
        planned: float,
        checker: IntegrityChecker | None,
    ) -> _Layout:
        """Blocking: the buffers of ``plan`` laid out, its host images allocated, each
        file's disk found (a ``stat``) and the read jobs cut: work that grows with the
        model (a model of hundreds of GiB has 10^4 jobs), off the loop."""
        config, resources, clock = self.config, self.resources, self.clock
        files = resources.local_files
        alignment = config.pipeline.alignment
        swapped = needs_swap(index.byte_order)
        if swapped:
            ByteSwap.raise_if_unconvertible(index, plan)  # before any buffer or thread is taken
        layouts = layout_buffers(plan, alignment)
        slots = tensor_slots(index, layouts)
        spans = TensorSpans(index, layouts)
        began = clock()
        resources.make_room(len(layouts))
        allocate_host_images(
            layouts,
            files,
            resources.place,
            mapped=plan.mode in MAPPED_MODES,
            writable=swapped,
            alignment=alignment,
            prefetch=config.load.prefetch,
            lock=plan.mode == "mlock",
            huge_pages=config.pipeline.huge_pages,
        )
        hosted = [lay for lay in layouts if lay.plan.host]
        ended = clock()
        host_times = StageTimes(
            began, ended, ended - began, len(hosted), sum(lay.nbytes for lay in hosted)
        )
        remote = self.remote  # no disk to find: a reader limit of its own
        disks = remote_disks(resources.files, config) if remote else find_disks(files, config)
        pipeline = config.pipeline
        jobs, device_jobs = split_jobs(
            index,
            layouts,
            pipeline.chunk_size,
            host_bytes=job_bytes(
                pipeline.chunk_size,
                layouts,
                disks.total_readers,
                alignment,
                # With checks on, a mapped tensor is checked once its job has landed: the
                # reads' own size lets the checks start sooner.
                mapped=plan.mode in MAPPED_MODES and not config.load.check_tensors,
            ),
            slot_bytes=pipeline.staging_bytes() if len(hosted) < len(layouts) else None,
            aligned=plan.mode == "direct",
            # With a manifest, a hash block lies inside one job but at a range's edges
            # (not for swapped O_DIRECT reads: the reads of two jobs overlap, and one
            # would write file bytes over those the other has swapped).
            blocks=block_grid(checker)
            if checker is not None and not (swapped and plan.mode == "direct")
            else None,
            alignment=alignment,
        )
        staged = tuple(sorted({job.file_index for job in device_jobs}))
        return _Layout(
            devices,
            plan,
            planned,
            layouts,
            slots,
            spans,
            host_times,
            disks,
            jobs,
            device_jobs,
            staged,
            checker,
        )

    def _start_reads(self, index: WeightIndex, layout: _Layout) -> _ReadSide:
        """The read side of the load (checks, reader, reader threads), and its host reads
        started: their images exist, and the reads then run while the loop sets up the
        rest (device buffers, transfers) instead of after it."""
        config, resources, clock = self.config, self.resources, self.clock
        plan, layouts, disks, jobs = layout.plan, layout.layouts, layout.disks, layout.jobs
        files = resources.files
        # Big-endian bytes are swapped as they land.
        swapped = needs_swap(index.byte_order)
        threads = resources.lend(disks.total_readers, "aiogguf-reader")
        workers = config.pipeline.validate_workers
        # With checks off nothing runs on check threads: the readers' stand in.
        check = config.load.check_tensors
        check_threads = resources.lend(workers, "aiogguf-check") if check else threads
        validation = Validation(
            index,
            layouts,
            layout.slots,
            layout.spans,
            resources.images,
            files,
            mode=plan.mode,
            enabled=check,
            swapped=swapped,
            workers=workers,
            threads=check_threads,
            clock=clock,
        )
        # Landed pieces go to the piece checks, when some tensor is checked by pieces.
        pieces: PieceSink | None = validation.check_piece if validation.by_pieces else None
        integrity = None
        if layout.checker is not None:
            integrity = IntegritySink(
                layout.checker, files, resources.images, layouts, layout.slots, swapped=swapped
            )
            if not swapped:  # else the sink sees swapped bytes: it reads the file instead
                pieces = integrity if pieces is None else both(pieces, integrity)
        reader = Reader(
            files,
            resources.images,
            direct=[f if isinstance(f, DataFile) and f.direct_ok else None for f in files],
            clock=clock,
            swap=ByteSwap(index, layouts) if swapped else None,
            pieces=pieces,
            file_check=integrity.check_from_file if integrity is not None else None,
            lock=plan.mode == "mlock",
        )
        reads = HostReads(reader, clock=clock, threads=threads, check_threads=check_threads)
        # Where landed jobs go, attached before the first read starts.
        progress = _Progress(
            self.hub,
            plan,
            layouts,
            layout.spans,
            jobs=sum(len(file_jobs) for file_jobs in jobs),
            checked=check,
        )
        resources.hold_reads(reads, progress.close)
        # The files the transfer threads read from too are checked by the engine.
        staged = layout.staged_files
        verify = [None if i in staged else f.check_unchanged for i, f in enumerate(files)]
        reads.start(jobs, disks, verify=verify, landed=progress.host_landed)
        return _ReadSide(validation, reader, reads, progress, integrity)


@contextmanager
def _load_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """The load's error boundary."""
    try:
        yield
    except MemoryError as exc:
        # Host memory refused (a buffer, a staging slot) is a failed load like a refused
        # mapping, which already is a LoadError: one error, and one exit status, for
        # running out of memory in every mode.
        raise LoadError(path, None, f"out of host memory: {exc}") from exc
    except OSError as exc:
        # The stages word their OSErrors with path and offset (``errors.os_errors``);
        # one that escapes them still reaches the caller as a LoadError, never raw.
        raise from_os_error(exc, path, None, "I/O failed") from exc


async def run_load(
    path: str | os.PathLike[str],
    config: Config,
    hub: ProgressHub,
    stack: AsyncExitStack,
    *,
    devices: Sequence[Device] | None = None,
    opener: FileOpener | None = None,
) -> Model:
    """Parse, index, plan and load ``path``. What the load holds is one
    ``LoadResources`` on ``stack``, which the caller closes (told why, on failure); the
    returned model has taken the images. ``opener`` opens every file of the load, once
    (default: any path)."""
    with _load_errors(path):
        t0 = hub.elapsed()
        hub.emit(Stage.PARSE, 0, 0, 0, 0, f"parsing {os.fspath(path)}", force=True)
        # The load's threads, ready for it (a process that has loaded before has them),
        # or started now, in order (transfer threads are started when the plan asks for
        # them). Its own thread, for its one-off blocking calls (parse, index, plan,
        # open, allocate, close), is taken last (by the resources), so that it is the
        # last to start: the front is pure Python, and while it runs, a thread that
        # waits to start waits for the GIL too.
        reserve_threads(load_thread_count(config, uploads=False))
        # Each file is opened once, by the parse stage (``resources.opened``); the engine
        # reads through the same descriptors (its DataFiles hold duplicates).
        remote = is_remote(os.fspath(path))
        if remote:
            config = remote_config(os.fspath(path), config, opener)
        resources = await stack.enter_async_context(LoadResources(opener))
        threads = resources.thread
        front = _Front(resources, config, devices, hub.elapsed, hub, remote, opener)
        first, whole = await threads.run_sync(front.parse_and_plan, os.fspath(path))
        if whole is not None:
            index, t1, layout, reading = whole
        else:
            index = await open_index(path, threads=threads, files=resources.opened, first=first)
            t1 = hub.elapsed()
            layout, reading = await threads.run_sync(front.plan_and_open, index)
        t2 = layout.planned
        plan = layout.plan
        load = _Load(
            index,
            layout,
            reading,
            resources,
            config,
            hub,
            metadata_stages=[
                ("parse+index", StageTimes(t0, t1, t1 - t0, len(index.files), 0)),
                ("plan", StageTimes(t1, t2, t2 - t1, len(plan.tensors), 0)),
            ],
        )
        hub.emit(
            Stage.PLAN,
            0,
            reading.progress.bytes_total,
            0,
            reading.progress.tensors_total,
            f"{len(plan.buffers)} buffers",
            force=True,
        )
        return await load.run()
