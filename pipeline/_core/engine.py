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
for a single-file model in one call (``aiogguf._core.front``): the loop's thread only awaits, and
the reads run while it sets up the rest.

How the stages are joined: the front hands on records (one ``Layout``: the ``Plan``,
``BufferLayout``s, ``TensorSlot``s, ``ReadJob``s that ``aiogguf._jobs`` cuts). The reader
hands each landed piece to a ``PieceSink`` (the validate stage's piece checks, when some
tensor is checked by pieces) and the upload stage fills each staging slot with a
``SlotFill`` (the reader's ``fill_slot``): the engine wires both. Each landed host job
goes, by a callback on the loop's thread attached before the reads start, to
``aiogguf._core.progress``, which counts it and puts the tensors it completed on one memory object
stream to the checks (``Validation.tensors_ready``). That stream has room for every job,
so it never pushes back (nor does the read stage's own, on which ``O_DIRECT`` jobs wait
for the check threads): what bounds memory is the buffers the plan allocates, the
staging slots (a transfer thread waits for a free one) and the whole-tensor checks in
flight (``submit`` waits for a free one).

The tensors that are ready (landed, copied to their device, checked) go by name to
the load's ``aiogguf._core.ready.ReadyTensors``, from the same callbacks on the loop's thread:
that is what ``handle.tensors_as_ready()`` hands on while the load goes on.

The engine only wires. Each stage's own work lives in its module: descriptors, disk
limits, byte order and locks in ``read``; images and mapping advice in ``allocate``;
both ways of checking a tensor behind ``validate.Validation`` (the rules in
``aiogguf._checks``); and ``report.build_report`` turns what the stages counted into
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
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from aiogguf._config import Config
from aiogguf._core.assemble import Assembly, is_remote, open_index
from aiogguf._core.front import Front, Layout, ReadSide
from aiogguf._core.layout import Planner
from aiogguf._core.load_resources import LoadResources
from aiogguf._core.ready import ArrayOf, ReadyTensors
from aiogguf._events import ProgressHub, Stage
from aiogguf._images import DeviceImage, Image
from aiogguf._jobs import ReadJob, SlotFill, StageTimes, TensorSlot
from aiogguf._model import Model, tensor_array
from aiogguf._records import WeightIndex
from aiogguf._report import LoadReport, build_report
from aiogguf.errors import (
    GGUFError,
    IntegrityError,
    LoadError,
    LoadWarning,
    TensorFailure,
    TensorValidationError,
    from_os_error,
    shown_path,
)
from aiogguf.io._devices.base import Device, DeviceBuffer
from aiogguf.io.opener import FileOpener
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import reserve_threads
from aiogguf.stages.allocate import Allocation
from aiogguf.stages.read import HostReads, direct_refusals, most_readers
from aiogguf.stages.upload import DeviceUploadStats, Uploader

__all__ = ["load_thread_count", "one_error", "run_load", "verdict"]


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
    """One load in flight. Only ``run()`` is public; the rest is the wiring: what each
    stage does lives in its module, what the load did is put together by ``report``.

    It gets the load's ``Layout`` (a record), its read side (started already) and its
    ``LoadResources``, which hold everything open until the caller closes them."""

    def __init__(
        self,
        index: WeightIndex,
        layout: Layout,
        reading: ReadSide,
        resources: LoadResources,
        assembly: Assembly,
        hub: ProgressHub,
        *,
        metadata_stages: Sequence[tuple[str, StageTimes]] = (),
        ready: ReadyTensors | None = None,
    ) -> None:
        self.index = index
        self.layout = layout
        self.reading = reading
        self.resources = resources
        self.assembly = assembly
        self.config = assembly.config
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
        self.ready = ready

    # --- the whole load ---------------------------------------------------------------

    async def run(self) -> Model:
        """Load every tensor; what it holds stays with ``resources`` (closed by the caller)
        but for the images, which the model takes."""
        resources, layout, plan = self.resources, self.layout, self.layout.plan
        files = resources.files
        for warning in direct_refusals(files, direct=plan.traits.direct):
            self._warn(warning)
        reading = self.reading
        validation, reader, progress = reading.validation, reading.reader, reading.progress
        uploader: Uploader | None = None
        if any(not lay.plan.host for lay in layout.layouts):
            # Transfer threads per device: the thread plan's.
            devices = {d.name: d for d in layout.devices}
            uploader = await resources.open_uploader(
                devices, self.config, threads=layout.threads.transfer_threads
            )
        if self.ready is not None:
            # With a manifest, a tensor's last blocks may be hashed only at the end.
            arrays = _arrays(self.index, layout.slots, resources.images)
            self.ready.open(arrays, self.index.__getitem__, hold=reading.integrity is not None)
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
        # checked the files that only they read, once they left them; those the transfer
        # threads read too are checked here, and in a mapped mode every file, since the
        # checks of mapped tensors read it on the check threads after the readers left.
        mapped_checks = validation.enabled and plan.traits.mapped
        recheck = [f for i, f in enumerate(files) if mapped_checks or i in layout.staged_files]
        if recheck:
            await resources.thread.run_sync(_check_unchanged, recheck)
        if self.assembly.settles:  # a hub file's digest, then its cache entry
            await resources.thread.run_sync(self.assembly.finish, resources)
        for f, was_direct in zip(files, reader.direct, strict=True):
            if was_direct and not f.direct_ok:
                self._warn(
                    f"{shown_path(f.path)}: {f.direct_refusal}; the rest was read with mode 'none'"
                )
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
        model = Model(self.index, plan, images, layout.slots, report, failures=failures)
        if self.ready is not None:
            self.ready.finish(
                model,
                failed={f.name for f in failures},
                last=[t.name for t in plan.tensors if t.lazy],
            )
        return model

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
        """Every device job through the upload stage's transfer threads; each device
        tensor goes to the checks once the copies that hold it have completed (all have
        when ``transfer`` returns)."""
        reader, progress = self.reading.reader, self.reading.progress
        async with ready:
            # Each buffer awaited once, not each job: a wait on a set event is still a
            # trip through the loop, and a load has dozens of jobs per buffer.
            buffers: dict[int, DeviceBuffer] = {}
            targets: list[tuple[ReadJob, DeviceBuffer]] = []
            for job in jobs:
                buffer = buffers.get(job.buffer_index)
                if buffer is None:
                    image = await self.allocation.ready(job.buffer_index)
                    assert isinstance(image, DeviceImage)
                    buffer = buffers[job.buffer_index] = image.buffer
                targets.append((job, buffer))

            def landed(job: ReadJob) -> None:
                now = self.hub.elapsed()
                reader.count(job, now, now)
                progress.landed(job)

            def copied(jobs: Sequence[ReadJob]) -> None:
                progress.device_copied(jobs, ready)  # before ``transfer`` returns

            # Each completed copy is followed only for a stream of ready tensors asked for
            # by now: it costs a loop callback per job and a round of checks per batch,
            # where a load that nobody streams checks its device tensors once, at the end.
            streamed = self.ready is not None and self.ready.wanted
            if streamed:
                self.reading.countdown.follow_copies()

            # Device jobs are read (and checked) before they land: the read stage starts
            # now, before the validate stage's first check.
            began = self.hub.elapsed()
            for file_index in {job.file_index for job in jobs}:
                reader.started(file_index, began)
            # The reader fills each slot, handing its pieces to the piece sink as they land.
            fill: SlotFill = reader.fill_slot
            await uploader.transfer(
                targets, fill, landed=landed, copied=copied if streamed else None
            )
            if not streamed and progress.device_landed:
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
    plan, disks = load.layout.plan, load.layout.threads.disks.names
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
            (parsed.path, stats, plan.traits.direct and direct, disk)
            for parsed, stats, direct, disk in zip(
                files, reader.stats, reader.direct, disks, strict=True
            )
        ],
        uploads=uploads,
        validated=validation.checked,
        blocks_hashed=load.reading.integrity.hashed if load.reading.integrity else 0,
        tensors_hashed=load.reading.integrity.tensors_hashed if load.reading.integrity else 0,
        warnings=load.warnings,
    )


def verdict(
    found: IntegrityError | None, failures: tuple[TensorFailure, ...], path: str
) -> tuple[tuple[TensorFailure, ...], TensorValidationError | None]:
    """Every bad tensor of a load, the manifest's first (``found``: its check's error),
    and the one error that names them all (None: none)."""
    if found is None:
        return failures, TensorValidationError(failures, path) if failures else None
    failures = (*found.failures, *failures)
    return failures, IntegrityError(failures, path)


def load_thread_count(config: Config, *, uploads: bool = True, remote: bool = False) -> int:
    """How many threads a load of ``config`` holds at once, at most: its own, readers
    (``remote``: one per connection), check threads and (``uploads``) transfer threads."""
    pipeline = config.pipeline
    readers = pipeline.remote_in_flight if remote else most_readers(config)
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


def _arrays(
    index: WeightIndex, slots: Mapping[str, TensorSlot], images: Sequence[Image | None]
) -> ArrayOf:
    """A loading tensor's array by name, over its image (which exists once its bytes
    have landed)."""

    def array(name: str, *, private: bool = False) -> Any:
        slot = slots[name]
        image = images[slot.buffer_index]
        assert image is not None, f"{name} is ready before its buffer exists"
        return tensor_array(image, slot, index[name], private=private)

    return array


def _check_unchanged(files: Sequence[ByteSource]) -> None:
    """Blocking: raise ``LoadError`` for the first file that changed during the load."""
    for f in files:
        f.check_unchanged()


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
    ready: ReadyTensors | None = None,
    planner: Planner | None = None,
) -> Model:
    """Parse, index, plan and load ``path``. What the load holds is one
    ``LoadResources`` on ``stack``, which the caller closes (told why, on failure); the
    returned model has taken the images. ``opener`` opens every file of the load, once
    (default: any path); ``planner`` makes the plan (None: ``make_plan``)."""
    with _load_errors(path):
        t0 = hub.elapsed()
        hub.emit(Stage.PARSE, 0, 0, 0, 0, f"parsing {os.fspath(path)}", force=True)
        # The load's threads, ready for it (a process that has loaded before has them),
        # or started now, in order (transfer threads are started when the plan asks for
        # them). Its own thread, for its one-off blocking calls (parse, index, plan,
        # open, allocate, close), is taken last (by the resources), so that it is the
        # last to start: the front is pure Python, and while it runs, a thread that
        # waits to start waits for the GIL too.
        remote = is_remote(os.fspath(path))
        reserve_threads(load_thread_count(config, uploads=False, remote=remote))
        # Each file is opened once, by the parse stage (``resources.opened``); the engine
        # reads through the same descriptors (its DataFiles hold duplicates).
        resources = await stack.enter_async_context(LoadResources(opener))
        threads = resources.thread
        # Where the bytes come from and who watches them land; the remote wing is
        # imported by the load's thread (an hf:// file the hub's cache has is local).
        assembly = Assembly(config, opener)
        if remote:
            path = await threads.run_sync(assembly.route, os.fspath(path))
        passed = ready.add if ready is not None else None
        front = Front(resources, assembly, devices, hub.elapsed, hub, passed, planner)
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
            assembly,
            hub,
            metadata_stages=[
                ("parse+index", StageTimes(t0, t1, t1 - t0, len(index.files), 0)),
                ("plan", StageTimes(t1, t2, t2 - t1, len(plan.tensors), 0)),
            ],
            ready=ready,
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
