"""The GIL a load holds per byte it loads, and the rate that caps a load at.

On a GPU host a load's transfer threads (one per core, up to 16) share one GIL, so the
Python that runs per byte caps a load at 1 / (GIL seconds per GB) GB/s, whatever the
thread count. A 2-core machine cannot show that cap as a rate; it can measure the budget.

Per case, a fresh process: ``aiogguf.warm_up`` with the case's settings, a pure-Python
spinner thread (``_spinner_loop``) started beside it, so that the GIL always has a
holder and a sample names who holds it (without a contender, a thread that let the GIL
go still reads as its last holder), a full collection (the imports' collector debt,
which a long-running process has paid; the passes during the loads are counted), then
``py-spy record --gil`` attached to it and
``--loads`` warm loads of the synthetic model (page cache filled first), each model
closed before the next. The samples of the spinner are not counted, nor those of the
simulated device's own bookkeeping, which a GPU does not cost the host (``EXCLUDED``:
the sim's copy-engine thread and its ring fingerprints). What is left, divided by the
sample rate and by the GB loaded, is the GIL ms per GB; 1 / that is the ceiling.

Cases: full offload (``n_gpu_layers=-1``, mode ``none``) to one simulated H200 that moves
no bytes (``keep_bytes=false``), and the host load (``n_gpu_layers=0``, mode ``none``),
each with checks on (the default) and off. Targets (issue 23): checks on <= 20 ms/GB (a
ceiling of 50 GB/s), checks off <= 6 ms/GB.

``--rounds N``: every case N times, in fresh processes, each round in another order
(rotated), and the median round of each case reported (with every round's figure): on a
shared VM one round of a case moves by half between runs.

``--convoy``: a warm host ``none`` load alone, with a pure-Python busy thread beside it
at CPython's default switch interval (5 ms), and with the same busy loop in another
process (the control: it takes a core as the thread does, but not the GIL), alternated,
in one fresh process per checks setting; beside the thread the load must take at most 3x
its time alone.

    python bench/gil_budget.py [--size 1GiB] [--loads 3] [--rate 1000] [--dir DIR]
                               [--cases host_none,...] [--rounds 1] [--json PATH]
    python bench/gil_budget.py --convoy [--size 2GiB] [--runs 3] [--json PATH]
    python bench/gil_budget.py --quick   # 32 MiB, one load: a dry run

Prints a table (stderr) and the JSON (stdout). Needs ``py-spy`` (the ``bench`` extra)
and the right to attach to a child process (ptrace).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GB = 1e9
MiB = 1024**2
TARGET_ON_MS = 20.0  # GIL ms per GB with checks on: a ceiling of 50 GB/s
TARGET_OFF_MS = 6.0  # with checks off
CONVOY_TARGET = 3.0  # load time beside a busy thread / alone
SPINNER = "_spinner_loop"
# Samples not counted, by the frame that marks them: what the simulated device does that
# a GPU does without the host (its copy engine is a host thread; it fingerprints every
# copy's source twice to catch a broken ring).
EXCLUDED = {
    "SimCopyStream._run": "the sim's copy-engine thread (a GPU's DMA engine)",
    "SimCopyStream.copy_async": (
        "the sim's copy queue: it fingerprints the source (its ring check) and wakes its "
        "copy-engine thread, where a driver's cudaMemcpyAsync only queues the copy"
    ),
}
CASES: dict[str, dict[str, Any]] = {
    "sim_offload_checks_on": {"n_gpu_layers": -1, "check_tensors": True},
    "sim_offload_checks_off": {"n_gpu_layers": -1, "check_tensors": False},
    "host_none_checks_on": {"n_gpu_layers": 0, "check_tensors": True},
    "host_none_checks_off": {"n_gpu_layers": 0, "check_tensors": False},
}
# Counted samples of the load's one-off front (parse, index, plan, layout, the checks'
# set-up): a cost per load, not per byte, shown apart.
FRONT = "Front.parse_and_plan"
TOP = 8
TIMEOUT_S = 900.0


# --- the child ----------------------------------------------------------------------------


def _spinner_loop(stop: threading.Event) -> None:
    """Pure Python, never blocking: it holds the GIL whenever no one else does."""
    n = 0
    while not stop.is_set():
        n += 1


def _busy_process() -> subprocess.Popen[bytes]:
    """The spinner's loop in a process of its own: a core taken, the GIL left alone."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _child(task: Mapping[str, Any]) -> None:
    """One case: warm up, start the spinner, say ``ready``; on ``go``, load ``loads``
    times and print the timings; on ``exit``, end. Convoy: the loads alone and beside a
    busy thread, alternated."""
    import anyio

    import aiogguf

    path, overrides = task["path"], dict(task["overrides"])
    if task.get("load_nice") is not None:
        import aiogguf.io.workers

        aiogguf.io.workers.LOAD_NICE = int(task["load_nice"])
    if task.get("switch_interval_s"):
        sys.setswitchinterval(float(task["switch_interval_s"]))

    async def one_load() -> tuple[float, int]:
        began = time.perf_counter()
        async with aiogguf.load(path, **overrides) as model:
            took = time.perf_counter() - began
            nbytes = model.report.nbytes
        return took, nbytes

    async def main() -> None:
        await aiogguf.warm_up(None, **overrides)
        await one_load()  # the process's first load: not measured
        stop = threading.Event()
        if task.get("convoy"):
            out: dict[str, list[float]] = {"alone_s": [], "busy_s": [], "process_s": []}
            nbytes = 0
            for _ in range(int(task["loads"])):
                took, nbytes = await one_load()
                out["alone_s"].append(took)
                spinner = threading.Thread(target=_spinner_loop, args=(stop,), daemon=True)
                spinner.start()
                took, nbytes = await one_load()
                stop.set()
                spinner.join()
                stop.clear()
                out["busy_s"].append(took)
                # The control: the same loop in another process takes a core as the
                # thread does, but not the GIL.
                busy = _busy_process()
                try:
                    took, nbytes = await one_load()
                finally:
                    busy.kill()
                    busy.wait()
                out["process_s"].append(took)
            print(json.dumps({**out, "nbytes": nbytes, "switch_s": sys.getswitchinterval()}))
            return
        spinner = threading.Thread(target=_spinner_loop, args=(stop,), daemon=True)
        spinner.start()
        # The collector's debt of the imports and the warm-up paid before the window: a
        # full pass then walks the whole process with the GIL held, a cost of the
        # process's heap, not of a load. What the loads' own allocations bring on is
        # counted (``gc``) and its time stays in the samples.
        gc.collect()
        passes: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
        started: list[float] = []

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                tally = passes[info["generation"]]
                tally[0] += 1
                tally[1] += (time.perf_counter() - started.pop()) * 1e3

        print("ready", flush=True)
        sys.stdin.readline()  # "go": py-spy is attached
        gc.callbacks.append(on_gc)
        seconds, nbytes = [], 0
        for _ in range(int(task["loads"])):
            took, n = await one_load()
            seconds.append(took)
            nbytes += n
        gc.callbacks.remove(on_gc)
        print(json.dumps({"seconds": seconds, "nbytes": nbytes, "gc": passes}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # "exit": py-spy has stopped
        stop.set()

    anyio.run(main)


# --- the parent ---------------------------------------------------------------------------


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _spawn(task: Mapping[str, Any]) -> subprocess.Popen[str]:
    # -P: the repository root holds a folder named io that would shadow the stdlib.
    return subprocess.Popen(
        [sys.executable, "-P", os.path.abspath(__file__), "--child", json.dumps(task)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def count_samples(raw: str) -> dict[str, Any]:
    """Sort ``py-spy -f raw`` lines (``frame;frame;... count``) into the spinner's, the
    excluded ones (by ``EXCLUDED``'s keys) and the counted ones, with the counted ones'
    innermost frames (file and function, lines dropped) and their threads."""
    spinner = total = counted = front = 0
    excluded = collections.Counter[str]()
    functions = collections.Counter[str]()
    threads = collections.Counter[str]()
    for line in raw.splitlines():
        stack, _, n_text = line.rpartition(" ")
        if not stack or not n_text.isdigit():
            continue
        n = int(n_text)
        total += n
        frames = stack.split(";")
        names = [frame.split(" (", 1)[0] for frame in frames]
        if SPINNER in names:
            spinner += n
            continue
        marker = next((key for key in EXCLUDED if key in names), None)
        if marker is not None:
            excluded[marker] += n
            continue
        counted += n
        front += n if FRONT in names else 0
        functions[_where(frames[-1])] += n
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        threads[thread.rstrip("0123456789").rstrip("-") or thread] += n
    return {
        "total": total,
        "spinner": spinner,
        "excluded": dict(excluded),
        "counted": counted,
        "front": front,
        "functions": functions.most_common(TOP),
        "threads": threads.most_common(),
    }


def _drain(proc: subprocess.Popen[str], sampling: threading.Event, said: list[str]) -> None:
    """Read py-spy's messages; ``sampling`` is set once it samples."""
    assert proc.stdout is not None
    for line in proc.stdout:
        said.append(line)
        if "Sampling process" in line:
            sampling.set()
    sampling.set()  # ended: the caller looks at the exit status


def _where(frame: str) -> str:
    """``fn (path/file.py:12)`` -> ``fn (file.py)``."""
    name, _, place = frame.partition(" (")
    file = place.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({os.path.basename(file)})" if file else name


def measure_case(
    name: str,
    path: Path,
    overrides: Mapping[str, Any],
    *,
    loads: int,
    rate: int,
    spy: str,
    keep_raw: str | None = None,
    load_nice: int | None = None,
) -> dict[str, Any]:
    """One case in a fresh process, sampled by py-spy; never raises."""
    task = {"path": str(path), "overrides": dict(overrides), "loads": loads, "load_nice": load_nice}
    child = _spawn(task)
    assert child.stdin is not None
    assert child.stdout is not None
    result: dict[str, Any] = {"case": name, "overrides": dict(overrides)}
    with tempfile.TemporaryDirectory(prefix="aiogguf-gil-") as folder:
        raw_path = Path(folder) / "samples.raw"
        spy_proc: subprocess.Popen[bytes] | None = None
        try:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("the child did not start")
            spy_proc = subprocess.Popen(
                [
                    *(spy, "record", "--gil", "--threads", "--nonblocking"),
                    *("-r", str(rate), "-f", "raw", "-o", str(raw_path), "--pid", str(child.pid)),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            sampling = threading.Event()
            spy_said: list[str] = []
            threading.Thread(
                target=_drain, args=(spy_proc, sampling, spy_said), daemon=True
            ).start()
            if not sampling.wait(30) or spy_proc.poll() is not None:
                raise RuntimeError(f"py-spy did not start: {''.join(spy_said)[-500:]}")
            began = time.perf_counter()
            child.stdin.write("go\n")
            child.stdin.flush()
            timings = json.loads(child.stdout.readline())
            time.sleep(0.2)  # the loads' last callbacks
            result["sampled_s"] = time.perf_counter() - began
            spy_proc.send_signal(signal.SIGINT)
            spy_proc.wait(timeout=60)
            child.stdin.write("exit\n")
            child.stdin.flush()
            child.wait(timeout=60)
            raw = raw_path.read_text()
            if keep_raw is not None:
                Path(keep_raw).mkdir(parents=True, exist_ok=True)
                (Path(keep_raw) / f"{name}.raw").write_text(raw)
            samples = count_samples(raw)
        except Exception as exc:  # recorded, the next case runs
            result["error"] = f"{type(exc).__name__}: {exc}"
            return result
        finally:
            for proc in (spy_proc, child):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    gb = timings["nbytes"] / GB
    # py-spy falls behind its rate on a busy machine (it stops the process for each
    # sample): the rate it reached is what a sample stands for. The spinner holds the
    # GIL whenever no one else does, so nearly every instant of the window is a sample.
    seen_rate = samples["total"] / result["sampled_s"]
    ms_per_gb = samples["counted"] / seen_rate * 1e3 / gb if gb and seen_rate else None
    target = TARGET_ON_MS if overrides.get("check_tensors", True) else TARGET_OFF_MS
    result.update(
        gb_loaded=gb,
        load_s=timings["seconds"],
        samples=samples,
        seen_rate=seen_rate,
        ms_per_gb_at_nominal_rate=samples["counted"] / rate * 1e3 / gb if gb else None,
        gil_ms_per_gb=ms_per_gb,
        # Collector passes during the loads, per generation: [count, ms].
        gc_passes=timings.get("gc"),
        front_ms_per_load=samples["front"] / seen_rate * 1e3 / loads if seen_rate else None,
        rest_ms_per_gb=(
            (samples["counted"] - samples["front"]) / seen_rate * 1e3 / gb
            if gb and seen_rate
            else None
        ),
        # No sample at all (a quick run of a few milliseconds): no GIL time was seen.
        ceiling_gbps=None if ms_per_gb is None else 1e3 / ms_per_gb if ms_per_gb else math.inf,
        target_ms_per_gb=target,
        met=ms_per_gb is not None and ms_per_gb <= target,
    )
    return result


def convoy(path: Path, overrides: Mapping[str, Any], *, runs: int) -> dict[str, Any]:
    """Loads alone and beside a busy thread, alternated, in one fresh process."""
    task = {"path": str(path), "overrides": dict(overrides), "loads": runs, "convoy": True}
    child = _spawn(task)
    try:
        out, _ = child.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return {"overrides": dict(overrides), "error": f"timed out after {TIMEOUT_S:.0f} s"}
    if child.returncode:
        return {"overrides": dict(overrides), "error": f"child exited {child.returncode}"}
    data = json.loads(out.strip().splitlines()[-1])
    alone, busy = statistics.median(data["alone_s"]), statistics.median(data["busy_s"])
    process = statistics.median(data["process_s"])
    ratio = busy / alone
    return {
        "overrides": dict(overrides),
        **data,
        "alone_median_s": alone,
        "busy_median_s": busy,
        "process_median_s": process,
        "ratio": ratio,
        # What the core alone costs, and what the GIL adds on top of it.
        "process_ratio": process / alone,
        "gil_ratio": busy / process,
        "target": CONVOY_TARGET,
        "met": ratio <= CONVOY_TARGET,
    }


def median_rounds(name: str, rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One case over its rounds: its median round (the lower of two, for an even count)
    with every round's figure beside it (``rounds_ms_per_gb``, in the order run); an
    error if any round failed."""
    failed = [r["error"] for r in rounds if "error" in r]
    if failed:
        return {"case": name, "overrides": dict(rounds[0]["overrides"]), "error": failed[0]}
    figures = [r["gil_ms_per_gb"] for r in rounds]
    middle = statistics.median_low(figures)
    chosen = dict(rounds[figures.index(middle)])
    chosen["rounds_ms_per_gb"] = figures
    chosen["rounds_front_ms_per_load"] = [r["front_ms_per_load"] for r in rounds]
    return chosen


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_table(result: Mapping[str, Any]) -> None:
    cases = result.get("cases") or []
    if cases:
        _say(
            f"\n{'case':<24}{'GIL ms/GB':>10}{'ceiling GB/s':>14}{'target':>8}  met?"
            f"  (front, ms per load; the rest, ms/GB)"
        )
        for c in cases:
            if "error" in c:
                _say(f"{c['case']:<24}  ERROR {c['error']}")
                continue
            _say(
                f"{c['case']:<24}{_num(c['gil_ms_per_gb']):>10}{_num(c['ceiling_gbps']):>14}"
                f"{c['target_ms_per_gb']:>8.0f}  {'yes' if c['met'] else 'NO ':<4}"
                f"  ({_num(c['front_ms_per_load'])}; {_num(c['rest_ms_per_gb'])})"
            )
        if any("rounds_ms_per_gb" in c for c in cases):
            _say(
                f"\nthe median of {result['rounds']} rounds; "
                "every round, GIL ms/GB (front, ms per load):"
            )
            for c in cases:
                if "rounds_ms_per_gb" in c:
                    pairs = zip(c["rounds_ms_per_gb"], c["rounds_front_ms_per_load"], strict=True)
                    _say(f"  {c['case']:<24}" + ", ".join(f"{g:.1f} ({f:.1f})" for g, f in pairs))
        for c in cases:
            if "error" in c:
                continue
            s = c["samples"]
            excluded = ", ".join(f"{k} {v}" for k, v in s["excluded"].items()) or "none"
            _say(
                f"\n{c['case']}: {s['counted']} samples counted of {s['total']} "
                f"({c['seen_rate']:.0f}/s seen; spinner {s['spinner']}; excluded: {excluded}); "
                f"{c['gb_loaded']:.2f} GB in {len(c['load_s'])} loads, "
                f"median {statistics.median(c['load_s']):.2f} s"
            )
            passes = c.get("gc_passes") or {}
            _say(
                "  collector passes during the loads (count, ms): "
                + ", ".join(f"gen {g} {n}, {ms:.1f}" for g, (n, ms) in passes.items())
            )
            for fn, n in s["functions"]:
                _say(f"  {n:>6}  {fn}")
            _say("  by thread: " + ", ".join(f"{t} {n}" for t, n in s["threads"]))
    for c in result.get("convoy") or []:
        if "error" in c:
            _say(f"convoy {c['overrides']}: ERROR {c['error']}")
            continue
        _say(
            f"\nconvoy, checks {'on' if c['overrides'].get('check_tensors', True) else 'off'}: "
            f"alone {c['alone_median_s']:.2f} s, beside a busy thread {c['busy_median_s']:.2f} s "
            f"(switch interval {c['switch_s'] * 1e3:g} ms): {c['ratio']:.2f}x "
            f"(target <= {c['target']:g}x: {'met' if c['met'] else 'MISSED'}); beside a busy "
            f"process (a core, not the GIL) {c['process_median_s']:.2f} s: "
            f"{c['process_ratio']:.2f}x, so the GIL's part is {c['gil_ratio']:.2f}x"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", default=None, help="tensor bytes (1GiB; --convoy 2GiB)")
    parser.add_argument("--loads", type=int, default=None, help="loads sampled per case (3)")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    parser.add_argument("--dir", default="/var/tmp/aiogguf-gil", help="where the model is kept")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument(
        "--rounds", type=int, default=1, help="each case this many times, rotated; the median"
    )
    parser.add_argument("--convoy", action="store_true", help="the busy-thread benchmark")
    parser.add_argument("--runs", type=int, default=3, help="--convoy: loads each way")
    parser.add_argument("--quick", action="store_true", help="32 MiB, one load per case")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON to PATH")
    parser.add_argument("--keep-raw", metavar="DIR", help="keep py-spy's samples in DIR")
    parser.add_argument(
        "--load-nice",
        type=int,
        default=None,
        help="nice levels the load threads run below the process (default: LOAD_NICE)",
    )
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0

    from aiogguf._units import parse_size
    from aiogguf.testing.baselines import warm_file
    from aiogguf.testing.synth_cache import ensure_synthetic_model

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_sim import sim_spec

    default_size = "32MiB" if args.quick else ("2GiB" if args.convoy else "1GiB")
    size = parse_size(args.size or default_size)
    loads = args.loads or (1 if args.quick else 3)
    path = Path(args.dir) / f"gil-{size // MiB}MiB.gguf"
    t = time.perf_counter()
    synth, written = ensure_synthetic_model(path, size_bytes=size, seed=0)
    _say(f"{'wrote' if written else 'reusing'} {path} ({time.perf_counter() - t:.1f} s)")
    warm_file(path)
    result: dict[str, Any] = {
        "path": str(path),
        "tensor_bytes": synth.tensor_bytes,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    errors: list[str] = []
    if args.convoy:
        runs = 1 if args.quick else args.runs
        result["convoy"] = []
        for checks in (True, False):
            overrides = {"mode": "none", "n_gpu_layers": 0, "check_tensors": checks}
            c = convoy(path, overrides, runs=runs)
            result["convoy"].append(c)
            if "error" in c:
                errors.append(f"convoy checks {checks}: {c['error']}")
    else:
        spy = _py_spy()
        if spy is None:
            _say("gil_budget: py-spy not found (pip install -e '.[bench]')")
            return 2
        spec, _, _ = sim_spec({"keep_bytes": "false"})
        result["sim_spec"] = spec
        result["rate"] = rate = args.rate
        result["loads"] = loads
        result["excluded"] = EXCLUDED
        names = args.cases.split(",")
        unknown = [name for name in names if name not in CASES]
        if unknown or args.rounds < 1:
            _say(
                f"gil_budget: unknown cases {unknown} (known: {', '.join(CASES)})"
                if unknown
                else "gil_budget: --rounds must be at least 1"
            )
            return 2
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for r in range(args.rounds):
            # Each round in another order: a case is not always the one after the same.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                overrides = {"mode": "none", **CASES[name]}
                if overrides["n_gpu_layers"]:
                    overrides["sim_gpus"] = [spec]
                _say(f"{name} ..." if args.rounds == 1 else f"round {r + 1}: {name} ...")
                rounds[name].append(
                    measure_case(
                        name,
                        path,
                        overrides,
                        loads=loads,
                        rate=rate,
                        spy=spy,
                        keep_raw=args.keep_raw,
                        load_nice=args.load_nice,
                    )
                )
        result["rounds"] = args.rounds
        result["cases"] = [
            runs[0] if args.rounds == 1 else median_rounds(name, runs)
            for name, runs in rounds.items()
        ]
        for c in result["cases"]:
            if "error" in c:
                errors.append(f"{c['case']}: {c['error']}")
    result["load_average_after"] = os.getloadavg()
    result["errors"] = errors
    print_table(result)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
