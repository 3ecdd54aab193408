"""A split model whose shards live on different disks (directories): each disk gets its
own readers, the shards are read at the same time, and the report says so per disk."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import aiogguf
from aiogguf._config import Config
from aiogguf.testing.synth import SynthModel, write_synthetic_model


@pytest.fixture(scope="module")
def array_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[SynthModel, list[Path]]:
    """Three shards on three "disks": the first directory holds the first shard and
    links to the two others, as a model spread over an NVMe array is laid out."""
    root = tmp_path_factory.mktemp("array")
    disks = [root / f"nvme{i}" for i in range(3)]
    for d in disks:
        d.mkdir()
    model = write_synthetic_model(disks[0] / "m.gguf", size_bytes="48MiB", split_count=3)
    for shard, disk in zip(model.paths[1:], disks[1:], strict=True):
        moved = disk / shard.name
        shard.rename(moved)
        shard.symlink_to(moved)
    return model, disks


def _config(disks: list[Path]) -> Config:
    return Config.from_mapping(
        {
            "load": {"mode": "none"},
            "pipeline": {
                "chunk_size": "1MiB",
                "path": [{"prefix": str(d), "readers": 2} for d in disks],
            },
        }
    )


def test_each_shard_is_read_from_its_own_disk(array_model: tuple[SynthModel, list[Path]]) -> None:
    model, disks = array_model
    with aiogguf.load_sync(model.path, _config(disks), n_gpu_layers=0) as loaded:
        report = loaded.report
        assert [f.disk for f in report.files] == [str(d) for d in disks]
        assert [d.disk for d in report.disks] == [str(d) for d in disks]
        assert all(d.nbytes > 0 and d.files == 1 for d in report.disks)
        assert sum(d.nbytes for d in report.disks) == report.nbytes
        # Every byte, from every disk, is the file's.
        reader_by_shard = [gguf.GGUFReader(p) for p in model.paths]
        for reader in reader_by_shard:
            for t in reader.tensors:
                expected = np.asarray(t.data).view(np.uint8).reshape(-1)
                assert bytes(loaded.raw(t.name)) == expected.tobytes(), t.name


def test_disks_are_read_at_the_same_time(array_model: tuple[SynthModel, list[Path]]) -> None:
    """The per-disk intervals overlap: no disk waits for another to finish."""
    model, disks = array_model
    with aiogguf.load_sync(
        model.path, _config(disks), check_tensors=False, n_gpu_layers=0
    ) as loaded:
        intervals = [(d.start_s, d.end_s) for d in loaded.report.disks]
    latest_start = max(start for start, _ in intervals)
    earliest_end = min(end for _, end in intervals)
    assert latest_start < earliest_end, intervals


def test_files_on_one_disk_share_its_readers(tmp_path: Path) -> None:
    """Without [[pipeline.path]], a disk is the filesystem device: all shards on it."""
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="4MiB", split_count=3)
    with aiogguf.load_sync(model.path, mode="none", n_gpu_layers=0) as loaded:
        disks = loaded.report.disks
    assert len(disks) == 1
    assert disks[0].disk.startswith("dev ")
    assert disks[0].files == 3
