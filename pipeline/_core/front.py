"""The blocking front of one load, on the load's own thread: parse, index, plan, open,
lay out and allocate, cut the jobs and start the host reads, up to the first byte
read (a single-file model in one call: each call is a round trip through the loop).

It hands the engine two records: a ``Layout`` (nothing in it open or running) and a
``ReadSide`` (the checks, the reader, and the host reads, started). What it opens,
allocates, lends and starts belongs to the load's ``LoadResources`` as soon as it
exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiogguf._config import Config, usable_cores
from aiogguf._core.headers import read_whole_model
from aiogguf._core.load_resources import LoadResources
from aiogguf._core.progress import LoadProgress
from aiogguf._devices import enumerate_devices
from aiogguf._events import ProgressHub
from aiogguf._jobs import (
    BufferLayout,
    Passed,
    PieceSink,
    ReadJob,
    StageTimes,
    TensorSlot,
    TensorSpans,
    layout_buffers,
    split_jobs,
    tensor_slots,
)
from aiogguf._records import ParsedFile, Plan, WeightIndex
from aiogguf.integrity._checker import IntegrityChecker
from aiogguf.integrity._llama_check import LlamaCheck, LlamaSink
from aiogguf.integrity._sink import (
    IntegritySink,
    block_grid,
    both,
    find_manifest,
    load_sink,
    open_manifest,
    shares_mapped_reads,
)
from aiogguf.io._devices.base import Device
from aiogguf.io.byteswap import needs_swap
from aiogguf.io.files import DataFile
from aiogguf.io.workers import raise_if_stopped
from aiogguf.remote._sources import RemoteName, remote_disks, remote_pieces
from aiogguf.stages.allocate import allocate_host_images
from aiogguf.stages.plan import make_plan
from aiogguf.stages.read import (
    ByteSwap,
    HostReads,
    Reader,
    ThreadPlan,
    find_disks,
    open_data_files,
    plan_threads,
)
from aiogguf.stages.validate import Validation

__all__ = ["Front", "Layout", "ReadSide"]


@dataclass(frozen=True, slots=True)
class Layout:
    """How one load lies out, made on the load's thread before its first read: the
    devices and plan (``planned``: when, on the load's clock), the buffer layouts,
    where each tensor sits (``slots``, ``spans``), when the host images were allocated,
    the thread plan (each file's disk and its readers, the transfer and check threads,
    the jobs' size), the jobs, and the files the transfer threads read from too. A
    record: nothing in it is open or running (that is the ``LoadResources``')."""

    devices: tuple[Device, ...]
    plan: Plan
    planned: float
    layouts: tuple[BufferLayout, ...]
    slots: dict[str, TensorSlot]
    spans: TensorSpans
    host_times: StageTimes
    threads: ThreadPlan
    jobs: list[list[ReadJob]]  # host jobs, per file
    device_jobs: list[ReadJob]
    staged_files: tuple[int, ...]
    checker: IntegrityChecker | LlamaCheck | None  # the manifest's, when one is checked


@dataclass(frozen=True, slots=True)
class ReadSide:
    """The read side of one load, its host reads already started on the load's thread:
    the checks, the reader, the reads (owned by the ``LoadResources``, which stops
    them), and ``LoadProgress``, where their landed jobs go."""

    validation: Validation
    reader: Reader
    reads: HostReads
    progress: LoadProgress
    integrity: IntegritySink | LlamaSink | None


@dataclass(frozen=True, slots=True)
class Front:
    """The blocking front of one load, run on the load's thread, up to the first byte
    read: it plans with ``config`` for ``devices`` (None: discover them), times itself
    with ``clock`` and ends by starting the host reads, whose landed jobs go to a
    ``LoadProgress`` that reports to ``hub``. It reads through ``resources.opened``, and the
    files it opens, the host images it allocates, the threads it lends and the reads it
    starts are ``resources``' as soon as each is made: its close frees them all."""

    resources: LoadResources
    config: Config
    devices: Sequence[Device] | None
    clock: Callable[[], float]
    hub: ProgressHub
    remote: RemoteName | None  # a URL: its files are ``HttpSource``s (``aiogguf.remote._sources``)
    passed: Passed | None = None  # told each batch of tensors ready to hand on

    def parse_and_plan(
        self, path: str
    ) -> tuple[ParsedFile, tuple[WeightIndex, float, Layout, ReadSide] | None]:
        """Blocking: a single-file model parsed, indexed and ``plan_and_open``-ed in one
        call: each call is a round trip through the loop, and in a fresh process the
        round trips cost as much as the work. Returns the header and (index, when it was
        indexed, the layout, the read side); for a split set only the first file's
        header, and nothing is opened."""
        whole: tuple[ParsedFile, WeightIndex | None]
        if self.remote:  # every split too: each opened and parsed on this thread
            whole = self.remote.read_model(path, self.config, self.resources.keep_file)
        else:
            whole = read_whole_model(path, self.resources.opened)
        first, index = whole
        if index is None:
            return first, None
        indexed = self.clock()
        return first, (index, indexed, *self.plan_and_open(index))

    def plan_and_open(self, index: WeightIndex) -> tuple[Layout, ReadSide]:
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
                direct=plan.traits.direct,
                alignment=config.pipeline.alignment,
                keep=resources.keep_file,
            )
        checker = None
        if (manifest := find_manifest(config.load.manifest, index.files[0].path)) is not None:
            checker = open_manifest(manifest, index, resources.files, resources.opened)
        layout = self._lay_out(index, found, plan, self.clock(), checker)
        if self.remote:  # what no read lands, a hub file's digest fetches
            self.remote.expect_reads(resources.files, [*layout.jobs, layout.device_jobs])
        raise_if_stopped()  # a cancelled load starts no read
        return layout, self._start_reads(index, layout)

    def _lay_out(
        self,
        index: WeightIndex,
        devices: tuple[Device, ...],
        plan: Plan,
        planned: float,
        checker: IntegrityChecker | LlamaCheck | None,
    ) -> Layout:
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
            mapped=plan.traits.mapped,
            writable=swapped,
            alignment=alignment,
            prefetch=config.load.prefetch,
            lock=plan.traits.locked,
            huge_pages=config.pipeline.huge_pages,
        )
        hosted = [lay for lay in layouts if lay.plan.host]
        ended = clock()
        host_times = StageTimes(
            began, ended, ended - began, len(hosted), sum(lay.nbytes for lay in hosted)
        )
        remote = self.remote  # no disk to find: a reader limit of its own
        disks = remote_disks(resources.files, config) if remote else find_disks(files, config)
        threads = plan_threads(disks, layouts, config, plan.traits, cores=usable_cores())
        pipeline = config.pipeline
        jobs, device_jobs = split_jobs(
            index,
            layouts,
            pipeline.chunk_size,
            host_bytes=threads.job_bytes,
            slot_bytes=pipeline.staging_bytes() if len(hosted) < len(layouts) else None,
            aligned=plan.traits.direct,
            # With a manifest, a hash block lies inside one job but at a range's edges
            # (not for swapped O_DIRECT reads: the reads of two jobs overlap, and one
            # would write file bytes over those the other has swapped).
            blocks=block_grid(checker) if not (swapped and plan.traits.direct) else None,
            alignment=alignment,
        )
        staged = tuple(sorted({job.file_index for job in device_jobs}))
        return Layout(
            devices,
            plan,
            planned,
            layouts,
            slots,
            spans,
            host_times,
            threads,
            jobs,
            device_jobs,
            staged,
            checker,
        )

    def _start_reads(self, index: WeightIndex, layout: Layout) -> ReadSide:
        """The read side of the load (checks, reader, reader threads), and its host reads
        started: their images exist, and the reads then run while the loop sets up the
        rest (device buffers, transfers) instead of after it."""
        config, resources, clock = self.config, self.resources, self.clock
        plan, layouts, jobs = layout.plan, layout.layouts, layout.jobs
        thread_plan = layout.threads
        files = resources.files
        # Big-endian bytes are swapped as they land.
        swapped = needs_swap(index.byte_order)
        threads = resources.lend(thread_plan.readers, "aiogguf-reader")
        workers = config.pipeline.validate_workers
        # With checks off nothing runs on check threads: the readers' stand in.
        check = config.load.check_tensors
        check_threads = (
            resources.lend(thread_plan.check_threads, "aiogguf-check")
            if thread_plan.check_threads
            else threads
        )
        # A manifest's hashing reads a mapped image's file anyway: its checks share the reads.
        mapped_pieces = shares_mapped_reads(layout.checker, mapped=plan.traits.mapped)
        validation = Validation(
            index,
            layouts,
            layout.slots,
            layout.spans,
            resources.images,
            files,
            mode=plan.traits,
            enabled=check,
            swapped=swapped,
            mapped_pieces=mapped_pieces,
            workers=workers,
            threads=check_threads,
            clock=clock,
            passed=self.passed,
        )
        # Landed pieces go to the piece checks, when some tensor is checked by pieces.
        pieces: PieceSink | None = validation.check_piece if validation.by_pieces else None
        integrity = None
        if layout.checker is not None:
            integrity = load_sink(
                layout.checker,
                index,
                files,
                resources.images,
                layouts,
                layout.slots,
                swapped=swapped,
                feed=pieces if mapped_pieces and not swapped else None,
            )
            # Swapped bytes are not the file's: the sink reads the file instead.
            if not swapped and integrity.takes_pieces:
                pieces = integrity if pieces is None else both(pieces, integrity)
        reader = Reader(
            files,
            resources.images,
            direct=[f if isinstance(f, DataFile) and f.direct_ok else None for f in files],
            clock=clock,
            swap=ByteSwap(index, layouts) if swapped else None,
            pieces=pieces,
            file_check=integrity.check_from_file if integrity is not None else None,
            lock=plan.traits.locked,
            piece_bytes=remote_pieces(files),
            # A local read into pages backed first costs the kernel less than one that
            # faults them in as it lands; a remote file's request would wait for the
            # backing, where its faults overlap the network's waits.
            back_first=[isinstance(f, DataFile) for f in files],
            # A core the readers leave idle checks each landed job while its reader
            # reads the next, instead of the reader checking in turn.
            apart=[isinstance(f, DataFile) and thread_plan.checks_apart for f in files],
            # A manifest's blocks hashed as each local read lands, in the core's cache
            # (a remote file's reads are its requests, which stay whole).
            stream=[
                integrity.stream
                if isinstance(integrity, IntegritySink) and not swapped and isinstance(f, DataFile)
                else None
                for f in files
            ],
            # A host tensor's check finished by the thread that checked its last bytes.
            checked=validation.job_checked if validation.by_pieces else None,
        )
        reads = HostReads(reader, clock=clock, threads=threads, check_threads=check_threads)
        # Where landed jobs go, attached before the first read starts.
        progress = LoadProgress(
            self.hub,
            plan,
            layouts,
            layout.spans,
            jobs=sum(len(file_jobs) for file_jobs in jobs) + len(layout.device_jobs),
            checked=check,
            passed=self.passed,
        )
        resources.hold_reads(reads, progress.close)
        # The files the transfer threads read from too are checked by the engine.
        staged = layout.staged_files
        verify = [None if i in staged else f.check_unchanged for i, f in enumerate(files)]
        reads.start(jobs, thread_plan.disks, verify=verify, landed=progress.host_landed)
        return ReadSide(validation, reader, reads, progress, integrity)
