"""One thread's ``preadv`` from the page cache into fresh 4 KiB-page memory and into fresh
huge-page memory, at two sizes, in one run.

Each measurement runs in a fresh process after the same spacer and pause as
``bench/load.py`` (``aiogguf.testing.bench.settle``): it maps new anonymous memory (for
huge pages aligned to 2 MiB and advised ``MADV_HUGEPAGE`` before its first touch: what
``huge_pages = "on"`` allocates), reads the file's first ``size`` bytes into it with one
thread in 64 MiB calls, and reports the time, the system time and the page faults it
took, and how much of the memory the kernel backed with huge pages (``AnonHugePages``
of ``/proc/self/smaps_rollup``). ``4k reused`` and ``huge reused`` first back and free
as much memory of their kind in the same process, untimed: memory the kernel has just
had backed (on a VM with free page reporting, memory not yet handed back to the host;
elsewhere what every fresh memory is like). The kinds alternate, the order reversed
every run. Prints medians and ranges, the kernel's THP settings, and the machine's
load. Not part of the test run.

    python bench/host_pages.py [--path F | --size 2GiB --dir /work/bench-data]
                               [--sizes 1GiB,2GiB] [--runs 5] [--settle 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiogguf._units import format_bytes, parse_size
from aiogguf.io.buffers import HostBuffer, transparent_huge_pages
from aiogguf.io.files import open_file
from aiogguf.testing.baselines import GB, warm_file
from aiogguf.testing.bench import SETTLE_S, settle

CALL_BYTES = 64 << 20
KINDS = ("4k", "huge", "4k reused", "huge reused")


def _anon_huge_bytes() -> int:
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


# /proc/vmstat counters that say where a fault's time went: huge pages granted or
# refused, and compaction run to make them.
VMSTAT_KEYS = (
    "thp_fault_alloc",
    "thp_fault_fallback",
    "compact_stall",
    "compact_migrate_scanned",
    "compact_free_scanned",
)


def _vmstat() -> dict[str, int]:
    with open("/proc/vmstat", encoding="ascii") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k in VMSTAT_KEYS}


def measure(path: str, nbytes: int, kind: str) -> dict[str, Any]:
    """In this process: read ``path``'s first ``nbytes`` into fresh memory of ``kind``."""
    huge = kind.startswith("huge")
    if kind.endswith("reused"):
        with HostBuffer(nbytes, huge_pages=huge) as spent:
            spent.prefault()
    with open_file(path) as f, HostBuffer(nbytes, huge_pages=huge) as buf:
        view = buf.memoryview
        before = resource.getrusage(resource.RUSAGE_SELF)
        vm_before = _vmstat()
        start = time.perf_counter()
        for offset in range(0, nbytes, CALL_BYTES):
            f.read_into(view[offset : offset + CALL_BYTES], offset)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        vm_after = _vmstat()
        granted = _anon_huge_bytes()
        advised = buf.huge_pages
    return {
        "kind": kind,
        "nbytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / GB,
        "system_s": after.ru_stime - before.ru_stime,
        "faults": after.ru_minflt - before.ru_minflt,
        "anon_huge_bytes": granted,
        "advised": advised,
        # system-wide: other processes' faults count too
        "vmstat": {k: vm_after[k] - vm_before.get(k, 0) for k in vm_after},
    }


def _child(path: str, nbytes: int, kind: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-P", os.path.abspath(__file__), "--child", path, str(nbytes), kind],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.abspath(path)),
    )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _thp(name: str) -> str:
    try:
        return Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
    except OSError:
        return "(absent)"


def run(path: Path, sizes: list[int], runs: int, settle_s: float, say: Any) -> dict[str, Any]:
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}
    loads: list[str] = []
    for r in range(runs):
        for nbytes in sizes:
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                warm_file(path)
                settle(settle_s, touch_bytes=nbytes, near=path)
                s = _child(str(path), nbytes, kind)
                samples.setdefault((nbytes, kind), []).append(s)
                say(
                    f"run {r + 1}/{runs} {format_bytes(nbytes):>9} {kind:<11} "
                    f"{s['gbps']:6.2f} GB/s  system {s['system_s']:.2f} s  "
                    f"faults {s['faults']:7d}  AnonHugePages {format_bytes(s['anon_huge_bytes'])}"
                    f"  {s['vmstat']}"
                )
        loads.append(" ".join(f"{v:.2f}" for v in os.getloadavg()))
    table = []
    for nbytes in sizes:
        for kind in KINDS:
            got = samples[(nbytes, kind)]
            gbps = [s["gbps"] for s in got]
            table.append(
                {
                    "nbytes": nbytes,
                    "kind": kind,
                    "gbps": statistics.median(gbps),
                    "min_gbps": min(gbps),
                    "max_gbps": max(gbps),
                    "system_s_per_gb": statistics.median(
                        s["system_s"] / (nbytes / GB) for s in got
                    ),
                    "faults_per_gb": statistics.median(s["faults"] / (nbytes / GB) for s in got),
                    "huge_share": statistics.median(s["anon_huge_bytes"] / nbytes for s in got),
                    "runs_gbps": gbps,
                    "vmstat": [s["vmstat"] for s in got],
                }
            )
    return {
        "path": str(path),
        "runs": runs,
        "settle_s": settle_s,
        "thp_enabled": _thp("enabled"),
        "thp_defrag": _thp("defrag"),
        "thp_setting": transparent_huge_pages(),
        "load_average_after_each_run": loads,
        "table": table,
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\nTHP enabled: {result['thp_enabled']}; defrag: {result['thp_defrag']}")
    print(f"load average (1, 5, 15 min) after each run: {result['load_average_after_each_run']}")
    print(f"one thread, preadv from the page cache, median of {result['runs']} (min-max):")
    print(f"  {'size':>9} {'memory':<12}{'GB/s':>7}  {'range':<13}{'sys s/GB':>9}")
    for row in result["table"]:
        print(
            f"  {format_bytes(row['nbytes']):>9} {row['kind']:<12}{row['gbps']:7.2f}  "
            f"{row['min_gbps']:.2f}-{row['max_gbps']:.2f}".ljust(44)
            + f"{row['system_s_per_gb']:9.2f}  faults/GB {row['faults_per_gb']:8.0f}  "
            f"huge {row['huge_share']:.0%}"
        )


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="read this file (else the synthetic model)")
    parser.add_argument("--size", default="2GiB", help="synthetic model size (default 2GiB)")
    parser.add_argument("--dir", default="/work/bench-data")
    parser.add_argument("--sizes", default="1GiB,2GiB", help="bytes read (comma list)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--settle", type=float, default=SETTLE_S)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    if args.path:
        path = Path(args.path)
    else:
        from aiogguf.testing.synth_cache import ensure_bench_model

        path, _ = ensure_bench_model(args.dir, args.size)
    file_bytes = path.stat().st_size
    sizes = [min(parse_size(s), file_bytes) for s in args.sizes.split(",") if s.strip()]
    result = run(path, sizes, args.runs, args.settle, say)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
