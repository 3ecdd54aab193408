"""What checking a load against its hash manifest costs (``load.manifest``).

Warm loads (the file in the page cache) of the benchmarks' synthetic model in modes
``none`` and ``mmap``, each with and without the manifest, every load in a fresh process
(``load_in_subprocess``), the four alternated within each run (their order turned round
every other run) so that a noisy neighbour hits all four alike. Per case the median
time; per mode the ratio with / without. Targets: ``none`` <= 1.1x, ``mmap`` <= 1.2x.
Checks (``check_tensors``) are on, as by default (``--no-check``: off).

Beside them, per core: xxh3_128 over a 16 MiB block in memory (what the pieces of a
``none`` load cost), and the block read from the warm file in 1 MiB ``pread`` chunks,
each hashed as it comes (what a mapped load's blocks cost).

    python bench/integrity_cost.py [--size 2GiB] [--runs 5] [--dir DIR] [--json PATH]
    python bench/integrity_cost.py --quick   # 64 MiB, one run: a dry run

Prints a table (stderr) and the JSON (stdout). Waits while /tmp/quiet exists.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from aiogguf.integrity._hashing import hash_model_sync
from aiogguf.integrity._manifest import BLOCK_BYTES, block_digest, block_hasher, manifest_json
from aiogguf.integrity._sink import FILE_CHUNK_BYTES
from aiogguf.testing.baselines import GB, warm_file
from aiogguf.testing.bench import load_in_subprocess
from aiogguf.testing.synth_cache import ensure_bench_model

MODES = ("none", "mmap")
TARGETS = {"none": 1.1, "mmap": 1.2}
QUIET = Path("/tmp/quiet")


def wait_for_quiet() -> None:
    while QUIET.exists():
        time.sleep(10)


def hash_gbps(path: Path, *, from_file: bool, seconds: float = 1.0) -> float:
    """One core: 16 MiB blocks hashed in memory (xxh3_128), or read from the file in
    chunks each hashed as it comes, as a mapped load does (``FILE_CHUNK_BYTES``)."""
    block = memoryview(bytearray(BLOCK_BYTES))
    chunk = block[:FILE_CHUNK_BYTES]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [block], 0)
        done = at = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            if not from_file:
                block_digest(block, done // BLOCK_BYTES)
            else:
                at = 0 if at + BLOCK_BYTES > size else at
                state = block_hasher(done // BLOCK_BYTES)
                for lo in range(at, at + BLOCK_BYTES, FILE_CHUNK_BYTES):
                    os.preadv(fd, [chunk], lo)
                    state.update(chunk)
                state.digest()
                at += BLOCK_BYTES
            done += BLOCK_BYTES
        return done / (time.perf_counter() - start) / GB
    finally:
        os.close(fd)


def run(size: str, runs: int, directory: Path, *, checks: bool = True) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    path, _ = ensure_bench_model(directory, size)
    manifest = directory / f"{path.name}.integrity-bench.manifest.json"
    began = time.perf_counter()
    manifest.write_text(manifest_json(hash_model_sync(path)))
    hash_s = time.perf_counter() - began
    nbytes = path.stat().st_size
    cases = [(mode, checked) for mode in MODES for checked in (False, True)]
    seconds: dict[str, list[float]] = {f"{m}{'+manifest' if c else ''}": [] for m, c in cases}
    for r in range(runs):
        for mode, checked in cases if r % 2 == 0 else reversed(cases):
            wait_for_quiet()
            warm_file(path)
            overrides: dict[str, Any] = {
                "mode": mode,
                "n_gpu_layers": 0,
                "check_tensors": checks,
            }
            if checked:
                overrides["manifest"] = os.fspath(manifest)
            sample = load_in_subprocess(path, overrides)
            seconds[f"{mode}{'+manifest' if checked else ''}"].append(sample.seconds)
            shown = f"run {r} {mode:5} manifest={checked!s:5} {sample.seconds:.3f} s"
            print(shown, file=sys.stderr)
    medians = {case: statistics.median(values) for case, values in seconds.items()}
    ratios = {mode: medians[f"{mode}+manifest"] / medians[mode] for mode in MODES}
    warm_file(path)
    return {
        "path": os.fspath(path),
        "nbytes": nbytes,
        "runs": runs,
        "check_tensors": checks,
        "cpus": os.cpu_count(),
        "seconds": seconds,
        "median_s": medians,
        "ratio": ratios,
        "targets": TARGETS,
        "met": {mode: ratios[mode] <= TARGETS[mode] for mode in MODES},
        "hash_model_gbps": nbytes / hash_s / GB,
        "xxh3_gbps_per_core": hash_gbps(path, from_file=False),
        "pread_xxh3_gbps_per_core": hash_gbps(path, from_file=True),
    }


def table(result: dict[str, Any]) -> str:
    med = result["median_s"]
    gb = result["nbytes"] / GB
    lines = [
        "| mode | without | with manifest | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        plain, checked = med[mode], med[f"{mode}+manifest"]
        lines.append(
            f"| {mode} | {plain:.3f} s ({gb / plain:.2f} GB/s) | {checked:.3f} s "
            f"({gb / checked:.2f} GB/s) | {result['ratio'][mode]:.2f}x | "
            f"<= {TARGETS[mode]}x |"
        )
    lines.append(
        f"\nxxh3_128 per core: {result['xxh3_gbps_per_core']:.1f} GB/s in memory, "
        f"{result['pread_xxh3_gbps_per_core']:.1f} GB/s read from the file as a mapped "
        "load does; "
        f"aiogguf hash: {result['hash_model_gbps']:.2f} GB/s"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp/aiogguf-integrity")
    parser.add_argument("--json", help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="64 MiB, one run")
    parser.add_argument("--no-check", action="store_true", help="check_tensors = false")
    args = parser.parse_args()
    size, runs = ("64MiB", 1) if args.quick else (args.size, args.runs)
    result = run(size, runs, Path(args.dir), checks=not args.no_check)
    print(table(result), file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
