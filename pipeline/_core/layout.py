"""How one load lies out and its reads start, on the load's thread before its first
read: its devices and plan (``plan_load``), its buffers laid out and host images
allocated, each file's disk, and the read jobs cut (``lay_out``: work that grows with
the model, a model of hundreds of GiB has 10^4 jobs, off the loop); then the read side:
the checks, the watchers of landed bytes, the reader and its threads, and where landed
jobs go (``start_reads``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiogguf._config import Config, usable_cores
from aiogguf._core.assemble import Assembly, ManifestCheck
from aiogguf._core.load_resources import LoadResources
from aiogguf._core.progress import LoadProgress
from aiogguf._devices import enumerate_devices
from aiogguf._events import ProgressHub
from aiogguf._jobs import (
    BufferLayout,
    LandedWatcher,
    Passed,
    ReadJob,
    StageTimes,
    TensorCountdown,
    TensorSlot,
    TensorSpans,
    Watcher,
    layout_buffers,
    split_jobs,
    tensor_slots,
)
from aiogguf._records import Plan, WeightIndex
from aiogguf.io._devices.base import Device
from aiogguf.io.byteswap import needs_swap
from aiogguf.stages.allocate import allocate_host_images
from aiogguf.stages.plan import make_plan
from aiogguf.stages.read import (
    ByteSwap,
    HostReads,
    Reader,
    ReadOptions,
    ThreadPlan,
    find_disks,
    plan_threads,
)
from aiogguf.stages.validate import Validation

__all__ = ["Layout", "Planner", "ReadSide", "lay_out", "plan_load", "start_reads"]

# Who makes a load's plan from its index, devices and config (default ``make_plan``). A
# plan may place only part of the index: the tensors it leaves out are neither
# allocated nor read, and the model holds only those it places.
Planner = Callable[[WeightIndex, Sequence[Device], Config], Plan]


@dataclass(frozen=True, slots=True)
class Layout:
    """How one load lies out, made on the load's thread before its first read: the
    devices and plan (``planned``: when, on the load's clock), the buffer layouts,
    where each tensor sits (``slots``, ``spans``), when the host images were allocated,
    each file's disk, the jobs, the files the transfer threads read from too, and
    whether the file's bytes are byte-swapped as they land (``swapped``: a big-endian
    file). A record: nothing in it is open or running (that is the ``LoadResources``')."""

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
    swapped: bool


def plan_load(
    index: WeightIndex,
    devices: Sequence[Device] | None,
    config: Config,
    planner: Planner | None = None,
) -> tuple[tuple[Device, ...], Plan]:
    """Blocking: the load's devices (None: discover them; the first discovery imports
    CuPy and starts CUDA) and its plan (placement rules are matched against every
    tensor name), made by ``planner`` (None: ``make_plan``)."""
    found = tuple(devices) if devices is not None else enumerate_devices(config)
    return found, (planner or make_plan)(index, found, config)


def lay_out(
    index: WeightIndex,
    devices: tuple[Device, ...],
    plan: Plan,
    planned: float,
    *,
    config: Config,
    resources: LoadResources,
    clock: Callable[[], float],
    blocks: list[tuple[int, int]] | None,
) -> Layout:
    """Blocking: the buffers of ``plan`` laid out, its host images allocated (owned by
    ``resources``), each file's disk found (a ``stat``) and the read jobs cut;
    ``blocks``: a manifest's block grid per file (``split_jobs``)."""
    files = resources.files
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
        resources.mappable_files,
        resources.place,
        mapped=plan.traits.mapped,
        writable=swapped,
        alignment=alignment,
        prefetch=config.load.prefetch,
        lock=plan.traits.locked,
        huge_pages=config.pipeline.huge_pages,
        shareable=config.load.shareable,
    )
    hosted = [lay for lay in layouts if lay.plan.host]
    ended = clock()
    host_times = StageTimes(
        began, ended, ended - began, len(hosted), sum(lay.nbytes for lay in hosted)
    )
    disks = find_disks(files, config)
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
        blocks=blocks if not (swapped and plan.traits.direct) else None,
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
        swapped,
    )


@dataclass(frozen=True, slots=True)
class ReadSide:
    """The read side of one load, its host reads already started on the load's thread:
    the checks, the reader, the reads (owned by the ``LoadResources``, which stops
    them), ``LoadProgress``, where their landed jobs go, the load's one count of each
    tensor's bytes still to come, and the manifest's check, when one has its say in the
    verdict."""

    validation: Validation
    reader: Reader
    reads: HostReads
    progress: LoadProgress
    countdown: TensorCountdown
    integrity: ManifestCheck | None


def start_reads(
    index: WeightIndex,
    layout: Layout,
    *,
    config: Config,
    assembly: Assembly,
    resources: LoadResources,
    clock: Callable[[], float],
    hub: ProgressHub,
    passed: Passed | None,
) -> ReadSide:
    """The read side of the load (checks, watchers, reader, reader threads), and its
    host reads started: their images exist, and the reads then run while the loop sets
    up the rest (device buffers, transfers) instead of after it."""
    plan, layouts, jobs = layout.plan, layout.layouts, layout.jobs
    thread_plan = layout.threads
    files = resources.files
    swapped = layout.swapped  # big-endian bytes are swapped as they land
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
    mapped_pieces = assembly.shares_mapped_reads(mapped=plan.traits.mapped)
    countdown = TensorCountdown(layout.spans)
    validation = Validation(
        index,
        layouts,
        layout.slots,
        countdown,
        resources.images,
        files,
        mode=plan.traits,
        enabled=check,
        swapped=swapped,
        mapped_pieces=mapped_pieces,
        workers=workers,
        threads=check_threads,
        clock=clock,
        passed=passed,
    )
    # Who watches the bytes land, in order: the tensor checks (when some tensor is
    # checked by pieces; a host tensor's check finished by the thread that checked its
    # last bytes), then what the load's manifest brings.
    watchers: list[LandedWatcher] = []
    pieces = validation.check_piece if validation.by_pieces else None
    if pieces is not None:
        watchers.append(Watcher(piece=pieces, checked=validation.job_checked))
    watchers += assembly.watchers(
        index,
        resources,
        layouts,
        layout.slots,
        swapped=swapped,
        feed=pieces if mapped_pieces and not swapped else None,
    )
    options = ReadOptions(
        swap=ByteSwap(index, layouts) if swapped else None,
        lock=plan.traits.locked,
        spare_core=thread_plan.checks_apart,
    )
    reader = Reader(files, resources.images, watchers, clock=clock, options=options)
    reads = HostReads(reader, clock=clock, threads=threads, check_threads=check_threads)
    # Where landed jobs go, attached before the first read starts.
    progress = LoadProgress(
        hub,
        plan,
        layouts,
        countdown,
        jobs=sum(len(file_jobs) for file_jobs in jobs) + len(layout.device_jobs),
        checked=check,
        passed=passed,
    )
    resources.hold_reads(reads, progress.close)
    # The files the transfer threads read from too are checked by the engine.
    staged = layout.staged_files
    verify = [None if i in staged else f.check_unchanged for i, f in enumerate(files)]
    reads.start(jobs, thread_plan.disks, verify=verify, landed=progress.host_landed)
    return ReadSide(validation, reader, reads, progress, countdown, assembly.manifest)
