"""``aiogguf inspect FILE`` against gguf-py's ``gguf-dump FILE``: the wall time of each,
in fresh processes, alternated, medians (issue 39: ``aiogguf inspect`` within 1.2x of
``gguf-dump``).

Both run as their console scripts do (``from X import main; sys.exit(main())``) on this
interpreter, output to /dev/null. Python's bytecode is compiled first for both (with
``PYTHONDONTWRITEBYTECODE`` set, as on some machines, every run would compile aiogguf
from its sources while gguf-py's wheel brought its bytecode). Also prints each command's
CPU time (user + system, the children's ``rusage``), which a busy machine disturbs less
than the wall time, and the load average before and after. Not part of the test run.

    python bench/cli_start.py [FILE] [--runs 10]
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[2] / "shared/testdata/reference/tiny-llama-Q4_K_M.gguf"
COMMANDS = {
    "aiogguf inspect": ("aiogguf_entry", ["inspect"]),
    "gguf-dump": ("gguf.scripts.gguf_dump", []),
}


def _compile(module: str) -> None:
    """Write the bytecode of ``module``'s package (quietly; a read-only install has its own)."""
    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None:
        raise SystemExit(f"{module} is not installed")
    for folder in spec.submodule_search_locations or [os.path.dirname(spec.origin or "")]:
        compileall.compile_dir(folder, quiet=2, force=False)


def run_once(module: str, args: list[str], path: str) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh process running ``module``'s ``main``."""
    code = f"import sys; from {module} import main; sys.exit(main())"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, *args, path],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(path: str, runs: int) -> dict[str, object]:
    """``runs`` alternated pairs (the order flips every run) after one unmeasured run of
    each; each command's median wall and CPU time, and the ratio of the medians."""
    env_had = os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        _compile("aiogguf")
        _compile("aiogguf_entry")
        _compile("gguf")
        for module, args in COMMANDS.values():
            run_once(module, args, path)  # writes what bytecode is missing
    finally:
        if env_had is not None:
            os.environ["PYTHONDONTWRITEBYTECODE"] = env_had
    walls: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpus: dict[str, list[float]] = {name: [] for name in COMMANDS}
    load_before = os.getloadavg()
    for i in range(runs):
        order = list(COMMANDS) if i % 2 == 0 else list(reversed(COMMANDS))
        for name in order:
            wall, cpu = run_once(*COMMANDS[name], path)
            walls[name].append(wall)
            cpus[name].append(cpu)
    median = {name: statistics.median(v) for name, v in walls.items()}
    median_cpu = {name: statistics.median(v) for name, v in cpus.items()}
    return {
        "file": path,
        "runs": runs,
        "load_average": [load_before, os.getloadavg()],
        "wall_s": walls,
        "median_wall_s": median,
        "median_cpu_s": median_cpu,
        "ratio_wall": median["aiogguf inspect"] / median["gguf-dump"],
        "ratio_cpu": median_cpu["aiogguf inspect"] / median_cpu["gguf-dump"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=str(REFERENCE))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.file, args.runs)
    if args.json:
        print(json.dumps(result))
        return
    before, after = result["load_average"]  # type: ignore[misc]
    print(
        f"{Path(args.file).name}, {args.runs} alternated runs, "
        f"load average {before[0]:.2f} → {after[0]:.2f}"
    )
    for name in COMMANDS:
        wall = result["median_wall_s"][name]  # type: ignore[index]
        cpu = result["median_cpu_s"][name]  # type: ignore[index]
        print(f"  {name:16} wall {wall * 1e3:6.1f} ms   cpu {cpu * 1e3:6.1f} ms")
    print(
        f"  aiogguf / gguf-dump: wall {result['ratio_wall']:.2f}x, "
        f"cpu {result['ratio_cpu']:.2f}x (target <= 1.2x)"
    )


if __name__ == "__main__":
    main()
