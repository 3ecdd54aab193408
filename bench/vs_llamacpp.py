"""aiogguf against llama.cpp's own loader, side by side, load mode by load mode.

llama.cpp runs through llama-cpp-python's low-level bindings (the optional extra
``peer``: ``pip install -e '.[peer]'``, which builds llama.cpp from source). Only
``llama_model_load_from_file`` is timed, with ``n_gpu_layers=0`` and the load mode that
matches the case; the model is freed after the clock stops, and the process has called
``llama_backend_init`` before it starts. The aiogguf side times ``async with
aiogguf.load(...)`` up to the model, with ``n_gpu_layers=0`` too, after ``aiogguf.warm_up``
(threads, devices, a rehearsal load of a model built in memory: what a server does
before serving); the ``*_first`` cases leave ``warm_up`` out and time a process's very
first load. Which
load modes llama.cpp has is read from its ``llama_model_params`` ctypes struct at run
time (a ``load_mode`` enum in newer versions; ``use_mmap``/``use_mlock`` and maybe
``use_direct_io`` booleans in older ones) and printed.

Every load runs in a fresh process (this script with ``--worker``), after a spacer
process that backs and frees as much memory as the file and a pause (``--settle``; see
``aiogguf.testing.bench.settle``). The two loaders alternate on the same file, and every
other run the other one goes first. Warm cases read the file from a full page cache,
filled anew by a read in file order (``warm``) or with readahead off, in 4 KiB pages
(``pages``): a mapping load's time depends on the size of the cached pages, which a
file's history decides, so it is made rather than found. Cold cases drop the file first
(``posix_fadvise(DONTNEED)``, else ``/proc/sys/vm/drop_caches`` when writable); where
neither works the cold and ``pages`` cases are skipped, warm ones find the cache as it
is, and the output says so.

Prints progress to stderr, then a table and, as the last line of stdout, one JSON
object (also written to ``--json PATH``): per case, each side's median, min-max, CPU
time and page faults, and the time ratio aiogguf / llama.cpp (ratio of the medians).
Not part of the test run. Without llama-cpp-python it says how to install it and exits 2.

    python bench/vs_llamacpp.py [--size 4GiB] [--dir /work/bench-data] [--runs 5]
                                [--cases warm_none,warm_mmap,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "llama-cpp-python is not installed: this benchmark runs llama.cpp's own loader "
    "through it.\nInstall the optional extra (builds llama.cpp from source, several "
    "minutes):\n    pip install -e '.[peer]'"
)
EXIT_NO_PEER = 2
_WORKER_TIMEOUT_S = 900.0
_REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "testdata" / "reference"

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues a line).
_LOG_WARN, _LOG_ERROR = 3, 4

# Our name for each llama.cpp load mode → its llama_load_mode enum constant (newer
# llama.cpp: one ``load_mode`` field). "mlock" is MMAP_MLOCK: aiogguf's mlock mode maps
# and then locks, as that one does; plain MLOCK locks buffers it read into.
_LOAD_MODE_ENUM: dict[str, str] = {
    "none": "LLAMA_LOAD_MODE_NONE",
    "mmap": "LLAMA_LOAD_MODE_MMAP",
    "mlock": "LLAMA_LOAD_MODE_MMAP_MLOCK",
    "direct_io": "LLAMA_LOAD_MODE_DIRECT_IO",
}
# The same modes as the boolean fields of older llama.cpp; a field the struct lacks
# means the mode needs it is not there (``use_direct_io`` came late).
_LOAD_MODE_BOOLS: dict[str, dict[str, bool]] = {
    "none": {"use_mmap": False, "use_mlock": False, "use_direct_io": False},
    "mmap": {"use_mmap": True, "use_mlock": False, "use_direct_io": False},
    "mlock": {"use_mmap": True, "use_mlock": True, "use_direct_io": False},
    "direct_io": {"use_mmap": False, "use_mlock": False, "use_direct_io": True},
}
_REQUIRED_BOOLS: dict[str, tuple[str, ...]] = {
    "none": ("use_mmap",),
    "mmap": ("use_mmap",),
    "mlock": ("use_mmap", "use_mlock"),
    "direct_io": ("use_direct_io",),
}


def llama_mode_settings(
    fields: Sequence[str], enum_values: Mapping[str, int]
) -> dict[str, dict[str, int | bool]]:
    """The ``llama_model_params`` fields to set for each load mode this llama.cpp has.

    ``fields``: the struct's field names; ``enum_values``: the ``LLAMA_LOAD_MODE_*``
    constants the bindings define. A mode that is missing from the result is not
    supported by this version.
    """
    if "load_mode" in fields:
        return {
            mode: {"load_mode": enum_values[const]}
            for mode, const in _LOAD_MODE_ENUM.items()
            if const in enum_values
        }
    settings: dict[str, dict[str, int | bool]] = {}
    for mode, values in _LOAD_MODE_BOOLS.items():
        if all(f in fields for f in _REQUIRED_BOOLS[mode]):
            settings[mode] = {k: v for k, v in values.items() if k in fields}
    return settings


# --- cases ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    """One comparison: llama.cpp in ``llama_mode`` against aiogguf with ``overrides``,
    on the model (``file="model"``) or the reference file, from a page cache in the
    state ``cache`` names (``CACHE_STATES``). ``warm_up``: the aiogguf worker prepares
    its process with ``aiogguf.warm_up`` before the clock starts, as a server does before
    serving and as the llama.cpp worker calls ``llama_backend_init``; without it the
    case times a process's very first load."""

    name: str
    title: str
    cache: str
    llama_mode: str
    check_tensors: bool
    overrides: Mapping[str, Any]
    file: str = "model"
    warm_up: bool = True


# What the page cache holds of the file before each load of a case. The same cached
# bytes cost a mapping load very different amounts by the size of the pages that hold
# them, and a file's history decides that size: each state is made anew
# (``_PageCache``) rather than taken as found.
CACHE_STATES: dict[str, str] = {
    "warm": "all of it, as a read in file order leaves it (large folios where the kernel "
    "and filesystem make them)",
    "pages": "all of it, in 4 KiB pages (read with readahead off: kernels and filesystems "
    "without large folios)",
    "cold": "none of it",
}


def _aio(mode: str, check_tensors: bool = False, **more: Any) -> dict[str, Any]:
    return {"mode": mode, "check_tensors": check_tensors, "n_gpu_layers": 0, **more}


CASES: tuple[Case, ...] = (
    Case("warm_none", "warm, none, checks off", "warm", "none", False, _aio("none")),
    Case(
        "warm_none_readers1",
        "warm, none, aiogguf readers=1",
        "warm",
        "none",
        False,
        _aio("none", readers=1),
    ),
    Case("warm_none_checks", "warm, none, checks on", "warm", "none", True, _aio("none", True)),
    Case("warm_mmap", "warm, mmap", "warm", "mmap", False, _aio("mmap")),
    Case("warm_mlock", "warm, mlock", "warm", "mlock", False, _aio("mlock")),
    Case(
        "warm_mmap_first",
        "warm, mmap, aiogguf without warm_up",
        "warm",
        "mmap",
        False,
        _aio("mmap"),
        warm_up=False,
    ),
    Case("pages_mmap", "warm, 4 KiB pages, mmap", "pages", "mmap", False, _aio("mmap")),
    Case("pages_mlock", "warm, 4 KiB pages, mlock", "pages", "mlock", False, _aio("mlock")),
    Case(
        "cold_direct_vs_none",
        "cold, llama.cpp none vs aiogguf direct",
        "cold",
        "none",
        False,
        _aio("direct"),
    ),
    Case("cold_none", "cold, none vs none", "cold", "none", False, _aio("none")),
    Case(
        "cold_direct_io",
        "cold, llama.cpp DIRECT_IO vs aiogguf direct",
        "cold",
        "direct_io",
        False,
        _aio("direct"),
    ),
    Case(
        "reference_none",
        "reference file, warm, none",
        "warm",
        "none",
        False,
        _aio("none"),
        "reference",
    ),
    Case(
        "reference_mmap",
        "reference file, warm, mmap",
        "warm",
        "mmap",
        False,
        _aio("mmap"),
        "reference",
    ),
    Case(
        "reference_none_first",
        "reference file, warm, none, aiogguf without warm_up",
        "warm",
        "none",
        False,
        _aio("none"),
        "reference",
        warm_up=False,
    ),
)
CASE_NAMES = tuple(c.name for c in CASES)
SIDES = ("llama.cpp", "aiogguf")


# --- one load, in a worker process -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed load: wall seconds, the process's CPU seconds and page faults during
    it (all threads), its peak RSS, and the loader's warnings."""

    seconds: float
    user_s: float
    sys_s: float
    minflt: int
    majflt: int
    peak_rss_bytes: int
    warnings: tuple[str, ...] = field(default=())

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sample:
        return cls(**{**data, "warnings": tuple(data.get("warnings", ()))})


class _Clock:
    """Wall time, CPU time and faults between ``start`` and ``stop``."""

    def start(self) -> None:
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._t = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        seconds = time.perf_counter() - self._t
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "seconds": seconds,
            "user_s": ru.ru_utime - self._ru.ru_utime,
            "sys_s": ru.ru_stime - self._ru.ru_stime,
            "minflt": ru.ru_minflt - self._ru.ru_minflt,
            "majflt": ru.ru_majflt - self._ru.ru_majflt,
        }


def _peak_rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _llama_bindings() -> Any:
    import llama_cpp  # pyright: ignore[reportMissingImports]  (optional: the benchmark's rival)

    return llama_cpp


def _enum_values(llama_cpp: Any) -> dict[str, int]:
    return {
        const: int(getattr(llama_cpp, const))
        for const in _LOAD_MODE_ENUM.values()
        if hasattr(llama_cpp, const)
    }


def _struct_fields(llama_cpp: Any) -> list[str]:
    return [name for name, *_ in llama_cpp.llama_model_params._fields_]


def _llama_info() -> dict[str, Any]:
    """The installed bindings: versions, the params struct and the modes it supports."""
    import ctypes

    llama_cpp = _llama_bindings()
    fields = _struct_fields(llama_cpp)
    commit = None
    try:
        # ggml_commit is in the C API but not in the bindings; libllama links libggml-base.
        fn = llama_cpp.llama_cpp._lib.ggml_commit
        fn.restype = ctypes.c_char_p
        commit = fn().decode()
    except (AttributeError, OSError):
        pass
    return {
        "version": getattr(llama_cpp, "__version__", None),
        "commit": commit,
        "params_fields": fields,
        "load_modes": sorted(llama_mode_settings(fields, _enum_values(llama_cpp))),
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }


_CALLBACKS: list[Any] = []


def _llama_load(path: str, mode: str, check_tensors: bool, extra_bufts: bool) -> dict[str, Any]:
    llama_cpp = _llama_bindings()
    kept: list[str] = []

    # Replaces the bindings' own logger: llama.cpp would print its whole load log to
    # stderr. Warnings and errors are kept (a failed mlock is only a warning there).
    def log(level: int, text: bytes, user_data: Any) -> None:
        if level in (_LOG_WARN, _LOG_ERROR):
            kept.append(text.decode(errors="replace").strip())

    # Held for the life of the process: llama.cpp keeps the pointer.
    _CALLBACKS.append(llama_cpp.llama_log_callback(log))
    llama_cpp.llama_log_set(_CALLBACKS[-1], None)
    llama_cpp.llama_backend_init()
    settings = llama_mode_settings(_struct_fields(llama_cpp), _enum_values(llama_cpp))
    if mode not in settings:
        raise RuntimeError(f"this llama.cpp has no load mode {mode!r}")
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.vocab_only = False
    params.check_tensors = check_tensors
    if "use_extra_bufts" in _struct_fields(llama_cpp):
        params.use_extra_bufts = extra_bufts
    for name, value in settings[mode].items():
        setattr(params, name, value)
    clock = _Clock()
    clock.start()
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    out = clock.stop()
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}: " + " | ".join(kept[-6:]))
    llama_cpp.llama_model_free(model)
    return {**out, "peak_rss_bytes": _peak_rss_bytes(), "warnings": kept}


def _aiogguf_load(path: str, overrides: Mapping[str, Any], warm_up: bool) -> dict[str, Any]:
    import warnings

    import anyio

    # The loader, imported before the clock starts, as llama.cpp's library is.
    from aiogguf import load
    from aiogguf import warm_up as prepare

    warnings.simplefilter("ignore")  # the report carries the load's warnings

    async def main() -> dict[str, Any]:
        if warm_up:
            await prepare(**overrides)
        clock = _Clock()
        clock.start()
        async with load(path, **overrides) as model:
            out = clock.stop()
            found = list(model.report.warnings)
        return {**out, "peak_rss_bytes": _peak_rss_bytes(), "warnings": found}

    result: dict[str, Any] = anyio.run(main)
    return result


def worker_main(task: Mapping[str, Any]) -> dict[str, Any]:
    """One task of a worker process: ``info``, ``llama`` or ``aiogguf`` (a timed load)."""
    if task["task"] == "info":
        return _llama_info()
    if task["task"] == "llama":
        return _llama_load(
            task["path"], task["mode"], task["check_tensors"], task.get("extra_bufts", False)
        )
    return _aiogguf_load(task["path"], task["overrides"], task.get("warm_up", True))


def run_worker(task: Mapping[str, Any], *, cwd: str | None = None) -> dict[str, Any]:
    """``worker_main(task)`` in a fresh interpreter. Raises ``RuntimeError`` with the
    worker's last stderr lines if it fails."""
    # -P: the working directory never shadows a module (a repository root holds io/).
    proc = subprocess.run(
        [sys.executable, "-P", os.path.abspath(__file__), "--worker", json.dumps(task)],
        capture_output=True,
        text=True,
        timeout=_WORKER_TIMEOUT_S,
        check=False,
        cwd=cwd,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-8:]
        raise RuntimeError(
            f"worker {task['task']} failed (exit {proc.returncode}): " + " / ".join(tail)
        )
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


# --- the page cache ----------------------------------------------------------------------


def drop_cache(path: Path) -> str | None:
    """Evict ``path`` from the page cache (``aiogguf.testing.baselines.evict``)."""
    from aiogguf.testing.baselines import evict

    return evict(path)


class _PageCache:
    """The harness's ``PageCache`` (``CACHE_STATES``), then the spacer and the pause of
    ``settle`` after each state it makes."""

    def __init__(self, evictable: bool) -> None:
        from aiogguf.testing.baselines import PageCache

        self._cache = PageCache(evictable)

    def prepare(self, path: Path, cache: str, settle_s: float) -> None:
        from aiogguf.testing.bench import settle

        self._cache.make(path, cache)
        settle(settle_s, touch_bytes=path.stat().st_size, near=path)


# --- summaries and the table -------------------------------------------------------------


def side_summary(samples: Sequence[Sample]) -> dict[str, Any]:
    """Median, min and max of one loader's loads in a case, with its median CPU time and
    page faults, largest peak RSS, and every distinct warning."""
    seconds = [s.seconds for s in samples]
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "runs_s": seconds,
        "user_s": statistics.median(s.user_s for s in samples),
        "sys_s": statistics.median(s.sys_s for s in samples),
        "minflt": statistics.median(s.minflt for s in samples),
        "majflt": statistics.median(s.majflt for s in samples),
        "peak_rss_bytes": max(s.peak_rss_bytes for s in samples),
        "warnings": sorted({w for s in samples for w in s.warnings}),
    }


def case_summary(
    case: Case, llama: Sequence[Sample], aio: Sequence[Sample], path: Path
) -> dict[str, Any]:
    """One case's entry of the JSON: both sides and the time ratio aiogguf / llama.cpp
    (of the medians; ``paired_ratios`` are each run's own)."""
    left, right = side_summary(llama), side_summary(aio)
    return {
        "title": case.title,
        "path": str(path),
        "cache": case.cache,
        "llama_cpp": {"mode": case.llama_mode, "check_tensors": case.check_tensors, **left},
        "aiogguf": {"overrides": dict(case.overrides), "warm_up": case.warm_up, **right},
        "ratio": right["median_s"] / left["median_s"],
        "paired_ratios": [a.seconds / b.seconds for a, b in zip(aio, llama, strict=False)],
    }


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _span(side: Mapping[str, Any]) -> str:
    lo, hi = side["min_s"], side["max_s"]
    if hi < 1:
        return f"{lo * 1e3:.1f}–{hi * 1e3:.1f}"
    return f"{lo:.2f}–{hi:.2f}"


def format_table(result: Mapping[str, Any]) -> str:
    """The result as a Markdown table, one row per case, after a few header lines."""
    llama = result["llama_cpp"]
    lines = [
        f"llama.cpp: llama-cpp-python {llama['version']}, commit {llama['commit'] or 'unknown'}, "
        f"load modes {', '.join(llama['load_modes'])}",
        f"model: {result['model']['path']} ({result['model']['size_bytes'] / 2**30:.2f} GiB); "
        f"reference: {result['reference']['path'] or 'none'}",
        f"{result['runs']} runs per case, medians (min–max); cold cache: {result['cold_cache']}; "
        f"load average {result['load_average'][0]:.2f} → {result['load_average'][1]:.2f} "
        f"on {result['cpus']} CPUs",
        "",
        "| case | llama.cpp | aiogguf | time ratio | sys s (llama.cpp / aiogguf) |",
        "|---|---|---|---|---|",
    ]
    for c in result["cases"].values():
        left, right = c["llama_cpp"], c["aiogguf"]
        lines.append(
            f"| {c['title']} | {_duration(left['median_s'])} ({_span(left)}) "
            f"| {_duration(right['median_s'])} ({_span(right)}) | {c['ratio']:.2f} "
            f"| {left['sys_s']:.2f} / {right['sys_s']:.2f} |"
        )
    for name, why in result["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | |")
    for name, c in result["cases"].items():
        for side in SIDES:
            key = "llama_cpp" if side == "llama.cpp" else "aiogguf"
            for w in c[key]["warnings"][:3]:
                lines.append(f"{name}, {side} warned: {w[:160]}")
    return "\n".join(lines)


# --- the run -----------------------------------------------------------------------------


def pick_reference(where: Path, probe: Callable[[Path], bool]) -> Path | None:
    """The largest llama-architecture, single-file GGUF in ``where`` (or ``where`` itself)
    that ``probe`` (a llama.cpp load) accepts."""
    if where.is_file():
        return where if probe(where) else None
    import gguf

    candidates = []
    for p in where.glob("*.gguf"):
        reader = gguf.GGUFReader(p)
        arch = reader.fields.get("general.architecture")
        split = reader.fields.get("split.count")
        if arch is None or bytes(arch.parts[-1]).decode() != "llama":
            continue
        if split is not None and int(split.parts[-1][0]) > 1:
            continue
        candidates.append(p)
    for p in sorted(candidates, key=lambda q: q.stat().st_size, reverse=True):
        if probe(p):
            return p
    return None


def _probe(extra_bufts: bool, say: Callable[[str], None]) -> Callable[[Path], bool]:
    def probe(path: Path) -> bool:
        task = {"task": "llama", "path": str(path), "mode": "mmap", "check_tensors": False}
        try:
            run_worker({**task, "extra_bufts": extra_bufts}, cwd=str(path.parent))
        except RuntimeError as exc:
            say(f"llama.cpp refuses {path}: {exc}")
            return False
        return True

    return probe


def run(
    cases: Sequence[Case],
    files: Mapping[str, Path],
    runs: int,
    settle_s: float,
    extra_bufts: bool,
    say: Callable[[str], None],
    page_cache: _PageCache,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Every case ``runs`` times, the two loaders alternating (and swapping who goes
    first each run), each load after ``page_cache`` has put the file in the case's
    cache state. Returns the case summaries and the cases skipped, with why."""
    samples: dict[str, dict[str, list[Sample]]] = {c.name: {s: [] for s in SIDES} for c in cases}
    skipped: dict[str, str] = {}
    for r in range(runs):
        say(f"run {r + 1}/{runs}")
        for case in cases:
            if case.name in skipped:
                continue
            path = files[case.file]
            order = SIDES if r % 2 else SIDES[::-1]
            for side in order:
                if side == "llama.cpp":
                    task: dict[str, Any] = {
                        "task": "llama",
                        "mode": case.llama_mode,
                        "check_tensors": case.check_tensors,
                        "extra_bufts": extra_bufts,
                    }
                else:
                    task = {
                        "task": "aiogguf",
                        "overrides": dict(case.overrides),
                        "warm_up": case.warm_up,
                    }
                try:
                    page_cache.prepare(path, case.cache, settle_s)
                    out = run_worker({**task, "path": str(path)}, cwd=str(path.parent))
                except RuntimeError as exc:
                    skipped[case.name] = f"{side}: {exc}"
                    say(f"  {case.name}: {side} failed, case dropped: {exc}")
                    break
                sample = Sample.from_json(out)
                samples[case.name][side].append(sample)
                say(
                    f"  {case.name:<20} {side:<9} {_duration(sample.seconds):>10} "
                    f"(user {sample.user_s:.2f} s, sys {sample.sys_s:.2f} s)"
                )
    summaries = {
        c.name: case_summary(
            c, samples[c.name]["llama.cpp"], samples[c.name]["aiogguf"], files[c.file]
        )
        for c in cases
        if c.name not in skipped
    }
    return summaries, skipped


def _parse_cases(text: str) -> list[Case]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASE_NAMES)}"
        )
    return [c for c in CASES if c.name in names]


def _peer_installed() -> bool:
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="4GiB", help="synthetic model size (default 4GiB)")
    parser.add_argument("--dir", default="/work/bench-data", help="where the model is kept")
    parser.add_argument("--path", help="use this GGUF file instead of a synthetic model")
    parser.add_argument(
        "--reference",
        default=str(_REFERENCE_DIR),
        help="folder of small reference files (the largest llama one llama.cpp loads is "
        "used) or one file",
    )
    parser.add_argument("--runs", type=int, default=5, help="loads per loader and case")
    parser.add_argument(
        "--cases",
        type=_parse_cases,
        default=list(CASES),
        help=f"comma list (default all): {', '.join(CASE_NAMES)}",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the JSON here")
    parser.add_argument(
        "--settle", type=float, default=3.0, help="seconds of pause before each load"
    )
    parser.add_argument(
        "--extra-bufts",
        action="store_true",
        help="let llama.cpp repack weights into its CPU kernels' layouts (its default; "
        "off here, so that both sides do a load and nothing else)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker_main(json.loads(args.worker))), flush=True)
        return 0
    if not _peer_installed():
        print(INSTALL_HINT, file=sys.stderr)
        return EXIT_NO_PEER

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        info = run_worker({"task": "info"})
    except RuntimeError as exc:
        print(f"llama-cpp-python does not work here: {exc}\n{INSTALL_HINT}", file=sys.stderr)
        return EXIT_NO_PEER
    say(f"llama-cpp-python {info['version']}, llama.cpp load modes: {info['load_modes']}")

    from aiogguf.testing.synth_cache import ensure_bench_model

    if args.path:
        model_path = Path(args.path)
    else:
        t0 = time.perf_counter()
        model_path, written = ensure_bench_model(args.dir, args.size)
        say(f"{'wrote' if written else 'reusing'} {model_path} ({time.perf_counter() - t0:.1f} s)")

    probe = _probe(args.extra_bufts, say)
    cases: list[Case] = args.cases
    skipped: dict[str, str] = {}
    if any(c.file == "model" for c in cases) and not probe(model_path):
        print(f"llama.cpp cannot load {model_path}; see its errors above", file=sys.stderr)
        return 1
    reference = None
    if any(c.file == "reference" for c in cases):
        reference = pick_reference(Path(args.reference), probe)
    files = {"model": model_path, **({"reference": reference} if reference else {})}
    cold_how = drop_cache(model_path)
    for c in cases:
        if c.file not in files:
            skipped[c.name] = f"no reference file llama.cpp loads in {args.reference}"
        elif c.cache != "warm" and cold_how is None:
            skipped[c.name] = "the page cache cannot be dropped here (warm cases only)"
        elif c.llama_mode not in info["load_modes"]:
            skipped[c.name] = f"this llama.cpp has no {c.llama_mode} load mode"
    active = [c for c in cases if c.name not in skipped]

    load_before = os.getloadavg()[0]
    page_cache = _PageCache(evictable=cold_how is not None)
    summaries, failed = run(
        active, files, args.runs, args.settle, args.extra_bufts, say, page_cache
    )
    result = {
        "llama_cpp": {**info, "extra_bufts": args.extra_bufts},
        "model": {"path": str(model_path), "size_bytes": model_path.stat().st_size},
        "reference": {
            "path": str(reference) if reference else None,
            "size_bytes": reference.stat().st_size if reference else None,
        },
        "runs": args.runs,
        "settle_s": args.settle,
        "cold_cache": cold_how or "unavailable (warm cases only)",
        "cache_states": {
            **CACHE_STATES,
            **({} if cold_how else {"warm": "as found: the file cannot be evicted here"}),
        },
        "cpus": os.cpu_count(),
        "load_average": [load_before, os.getloadavg()[0]],
        "cases": summaries,
        "skipped": {**skipped, **failed},
    }
    text = json.dumps(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(format_table(result))
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
