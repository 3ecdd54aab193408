"""What a load did and how fast: per stage, per buffer, per file, per device upload.

``build_report`` turns the statistics the stages kept into a ``LoadReport``: records
in, report out. It knows no stage; the engine hands it plain numbers and records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from aiogguf._jobs import StageTimes
from aiogguf._records import Plan

__all__ = [
    "BufferReport",
    "DiskReport",
    "FileReads",
    "FileReport",
    "LoadReport",
    "StageReport",
    "UploadCounts",
    "UploadReport",
    "build_report",
]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StageReport:
    """``busy_s`` sums the time the stage's workers spent working (it can exceed the
    wall time when workers overlap); ``wall_s`` spans its first start to its last end."""

    name: str
    wall_s: float
    busy_s: float
    items: int
    nbytes: int
    start_s: float = 0.0  # seconds since the load began
    end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class BufferReport:
    device: str
    buffer_type: str
    lazy: bool
    nbytes: int
    n_tensors: int


@dataclass(frozen=True, slots=True)
class FileReport:
    """One file's reads: ``start_s``/``end_s`` are seconds since the load began, so
    files read at once (shards on several disks) show overlapping intervals."""

    path: str
    nbytes: int
    reads: int
    start_s: float
    end_s: float
    direct: bool
    disk: str = ""  # the [[pipeline.path]] prefix, else the filesystem device

    @property
    def gbps(self) -> float:
        return _gbps(self.nbytes, self.end_s - self.start_s)


@dataclass(frozen=True, slots=True)
class DiskReport:
    """The files read from one disk, together."""

    disk: str
    files: int
    nbytes: int
    start_s: float
    end_s: float

    @property
    def gbps(self) -> float:
        return _gbps(self.nbytes, self.end_s - self.start_s)


@dataclass(frozen=True, slots=True)
class UploadReport:
    """One device's uploads: ``slots`` staging slots of ``slot_bytes`` leased from the
    device's pool, ``pinned_bytes_allocated`` of them pinned by this load (0 when the
    pool already held them), ``device_bytes_allocated`` of device memory allocated by
    this load (0 when the device's arena held it: a second load of the same model),
    ``copies`` host-to-device copies of ``bytes_copied`` bytes,
    ``slot_waits`` times a slot's last copy had not completed when it was to be reused
    (``wait_s`` waited in all), ``fill_s`` spent reading into slots (summed over the
    transfer threads)."""

    device: str
    slots: int
    slot_bytes: int
    pinned_bytes_allocated: int
    bytes_copied: int
    copies: int
    slot_waits: int
    wait_s: float
    fill_s: float
    device_bytes_allocated: int = 0


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a load did: its mode, time and bytes, each stage's times, its buffers,
    files and uploads, and the tensors checked."""

    path: str
    mode: str
    total_s: float
    nbytes: int  # tensor bytes loaded (lazy tensors excluded)
    n_tensors: int
    stages: tuple[StageReport, ...]
    buffers: tuple[BufferReport, ...]
    files: tuple[FileReport, ...]
    validated: int  # tensors checked
    warnings: tuple[str, ...] = field(default=())
    uploads: tuple[UploadReport, ...] = field(default=())  # one per device uploaded to
    blocks_hashed: int = 0  # blocks checked against a hash manifest (load.manifest)
    tensors_hashed: int = 0  # tensors checked against a llama-gguf-hash manifest

    @property
    def gbps(self) -> float:
        return _gbps(self.nbytes, self.total_s)

    @property
    def disks(self) -> tuple[DiskReport, ...]:
        """Per-disk totals, in order of first appearance."""
        groups: dict[str, list[FileReport]] = {}
        for f in self.files:
            groups.setdefault(f.disk, []).append(f)
        return tuple(
            DiskReport(
                disk,
                len(fs),
                sum(f.nbytes for f in fs),
                min(f.start_s for f in fs),
                max(f.end_s for f in fs),
            )
            for disk, fs in groups.items()
        )

    def stage(self, name: str) -> StageReport:
        """The report of the stage ``name``; ``KeyError`` if the load had none."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)


class FileReads(Protocol):
    """One file's read counters, as the read stage keeps them."""

    @property
    def nbytes(self) -> int: ...
    @property
    def reads(self) -> int: ...
    @property
    def first_start(self) -> float | None: ...
    @property
    def last_end(self) -> float: ...


class UploadCounts(Protocol):
    """One device's upload counters, as the upload stage keeps them."""

    @property
    def device(self) -> str: ...
    @property
    def slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def pinned_bytes_allocated(self) -> int: ...
    @property
    def device_bytes_allocated(self) -> int: ...
    @property
    def bytes_copied(self) -> int: ...
    @property
    def copies(self) -> int: ...
    @property
    def slot_waits(self) -> int: ...
    @property
    def wait_s(self) -> float: ...
    @property
    def fill_s(self) -> float: ...


def _stage(name: str, times: StageTimes) -> StageReport:
    return StageReport(
        name, times.wall_s, times.busy_s, times.items, times.nbytes, times.start_s, times.end_s
    )


def build_report(
    plan: Plan,
    *,
    path: str,
    total_s: float,
    stages: Sequence[tuple[str, StageTimes]],
    files: Sequence[tuple[str, FileReads, bool, str]],
    uploads: Sequence[UploadCounts] = (),
    validated: int = 0,
    warnings: Sequence[str] = (),
    blocks_hashed: int = 0,
    tensors_hashed: int = 0,
) -> LoadReport:
    """The report of a finished load.

    ``plan``: the load's plan (mode, buffers, the tensors loaded).
    ``path``: the model's first file.
    ``total_s``: the load's duration.
    ``stages``: each stage's name and times, in pipeline order.
    ``files``: per file: its path, read counters, whether reads bypassed the page
        cache, and the disk it was read from.
    ``uploads``: one entry per device uploaded to.
    ``validated``: tensors checked.
    ``warnings``: what the load warned about.
    ``blocks_hashed``: blocks checked against a hash manifest.
    ``tensors_hashed``: tensors checked against a ``llama-gguf-hash`` manifest.
    """
    loaded = [t for t in plan.tensors if not t.lazy]
    return LoadReport(
        path=path,
        mode=plan.mode,
        total_s=total_s,
        nbytes=sum(t.nbytes for t in loaded),
        n_tensors=len(loaded),
        stages=tuple(_stage(name, times) for name, times in stages),
        buffers=tuple(
            BufferReport(b.device, b.buffer_type, b.lazy, b.nbytes, len(b.tensors))
            for b in plan.buffers
        ),
        files=tuple(
            FileReport(
                path=file_path,
                nbytes=stats.nbytes,
                reads=stats.reads,
                start_s=stats.first_start or 0.0,
                end_s=stats.last_end,
                direct=direct,
                disk=disk,
            )
            for file_path, stats, direct, disk in files
        ),
        validated=validated,
        blocks_hashed=blocks_hashed,
        tensors_hashed=tensors_hashed,
        warnings=tuple(warnings),
        uploads=tuple(
            UploadReport(
                device=u.device,
                slots=u.slots,
                slot_bytes=u.slot_bytes,
                pinned_bytes_allocated=u.pinned_bytes_allocated,
                device_bytes_allocated=u.device_bytes_allocated,
                bytes_copied=u.bytes_copied,
                copies=u.copies,
                slot_waits=u.slot_waits,
                wait_s=u.wait_s,
                fill_s=u.fill_s,
            )
            for u in uploads
        ),
    )
