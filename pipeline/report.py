"""What a load did and how fast: per stage, per buffer, per file."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "BufferReport",
    "DiskReport",
    "FileReport",
    "LoadReport",
    "StageReport",
    "UploadReport",
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
    pool already held them), ``copies`` host-to-device copies of ``bytes_copied`` bytes,
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


@dataclass(frozen=True, slots=True)
class LoadReport:
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
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)
