"""A split model spread over several disks (directories) against the same model in one
file: each disk gets its own readers, so the shards are read at once.

Writes (or reuses) a model split in ``--disks`` shards, each moved to its own directory
and linked back next to the first (the layout of a model spread over an NVMe array), and
the same model unsplit; then loads both ``--runs`` times per mode, interleaved, and prints
medians, the ratio of the array to the single file, and each disk's read interval (they
overlap when the disks are read at once). Not part of the test run.

    python bench/nvme_array.py [--size 1GiB] [--disks 3] [--readers 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import aiogguf
from aiogguf._config import Config
from aiogguf._report import LoadReport
from aiogguf._units import parse_size
from aiogguf.testing.baselines import drop_or_warm
from aiogguf.testing.synth_cache import ensure_synthetic_model


def spread(first: Path, paths: list[Path], root: Path) -> list[Path]:
    """Move shards 2… to their own directories, linked back beside the first."""
    disks = [first.parent]
    for i, shard in enumerate(paths[1:], start=1):
        disk = root / f"disk{i}"
        disk.mkdir(exist_ok=True)
        target = disk / shard.name
        if not shard.is_symlink():
            shard.rename(target)
            shard.symlink_to(target)
        disks.append(disk)
    return disks


def load(path: Path, config: Config, mode: str, files: list[Path]) -> LoadReport:
    for f in files:
        drop_or_warm(f.resolve(), cold=mode == "direct")
    with aiogguf.load_sync(path, config, mode=mode, check_tensors=False) as model:
        return model.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--disks", type=int, default=3)
    parser.add_argument("--dir", default="/work/bench-data")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--readers", type=int, default=2, help="readers per disk")
    args = parser.parse_args()
    size = parse_size(args.size)
    root = Path(args.dir) / f"array-{args.size}-{args.disks}"
    (root / "disk0").mkdir(parents=True, exist_ok=True)
    split, _ = ensure_synthetic_model(
        root / "disk0" / "m.gguf", size_bytes=size, split_count=args.disks
    )
    single, _ = ensure_synthetic_model(root / "single.gguf", size_bytes=size)
    disks = spread(split.paths[0], list(split.paths), root)
    array_config = Config.from_mapping(
        {"pipeline": {"path": [{"prefix": str(d), "readers": args.readers} for d in disks]}}
    )
    for mode in ("none", "direct"):
        rates: dict[str, list[float]] = {"single": [], "array": []}
        last: LoadReport | None = None
        for _ in range(args.runs):
            rates["single"].append(load(single.path, Config(), mode, list(single.paths)).gbps)
            last = load(split.paths[0], array_config, mode, list(split.paths))
            rates["array"].append(last.gbps)
        one, many = statistics.median(rates["single"]), statistics.median(rates["array"])
        print(
            f"{mode:<6} single file {one:5.2f} GB/s   {args.disks} disks {many:5.2f} GB/s   "
            f"ratio {many / one:4.2f}"
        )
        assert last is not None
        for d in last.disks:
            print(f"         {d.disk:<40} {d.start_s:6.3f} - {d.end_s:6.3f} s  {d.gbps:5.2f} GB/s")


if __name__ == "__main__":
    main()
