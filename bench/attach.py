"""Attach against a warm load: how fast a fresh process gets a model a server holds.

Writes (or reuses) a synthetic model, starts ``aiogguf serve --socket --no-http`` on it
and makes the model resident there (a first attach loads it, shareable). Then ``--runs``
times, in fresh processes, alternating the order every run: ``attach`` (a process
attaches over the socket and reads every tensor's first byte), and the same process
work done by a warm ``load`` in mode ``none`` and in mode ``mmap`` (the file is in the
page cache: read once before the runs), and ``handshake``: the protocol alone (connect,
ask, receive the share's descriptors, map nothing), what attach costs beyond opening
the share. Each process times its own work from just
before the call to the last first byte (imports excluded), and the whole process from
outside (spawn to exit). Prints the medians, the ratios (warm none / attach, warm mmap /
attach) and the load average, and whether the issue's targets hold: attach at least
50x faster than warm ``none``, and faster than warm ``mmap``. Not part of the test run.

    python bench/attach.py [--size 2GiB] [--runs 5] [--dir /work/bench-data] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiogguf.testing.synth_cache import ensure_bench_model

WORKER = r"""
import sys, time
how, path, sock = sys.argv[1:4]
import os
import aiogguf
from aiogguf.resident._protocol import Connection
# Imported before the clock starts, as an engine imports at module level.
attach_sync, load_sync = aiogguf.attach_sync, aiogguf.load_sync
start = time.perf_counter()
if how == "handshake":
    # The protocol alone: connect, ask, get the share's descriptors; nothing mapped.
    conn = Connection.open()
    conn.connect(sock)
    conn.send({"version": 1, "path": path, "config": {"mode": "mmap"}})
    while (reply := conn.receive(30))[0]["type"] == "progress":
        pass
    for fd in reply[1]:
        os.close(fd)
    conn.close()
    print(f"{time.perf_counter() - start:.6f} 0")
    sys.exit(0)
if how == "attach":
    handle = attach_sync(path, socket=sock, config={"mode": "mmap"})
else:
    handle = load_sync(path, mode=how, n_gpu_layers=0, check_tensors=False)
with handle as model:
    first = bytes(model.raw(name)[0] for name in model.tensors)
    work = time.perf_counter() - start
    n = len(first)
print(f"{work:.6f} {n}")
"""


def _worker(how: str, path: Path, sock: Path) -> tuple[float, float, int]:
    """(seconds of the work, seconds of the whole process, tensors touched)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, how, str(path), str(sock)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    whole = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench/attach.py: {how} failed: {proc.stderr.strip()[-2000:]}")
    work, n = proc.stdout.split()
    return float(work), whole, int(n)


def _read_through(path: Path) -> None:
    """The file in the page cache: the warm loads' starting state."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _start_server(path: Path, sock: Path) -> subprocess.Popen[str]:
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "aiogguf", "serve", "--no-http"),
            *("--root", str(path.parent), "--socket", str(sock)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    if "attach socket" not in line:
        server.kill()
        raise SystemExit(f"bench/attach.py: the server did not start: {line!r}")
    return server


def run(path: Path, runs: int, say: Any) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="aiogguf-bench-attach-"))
    sock = folder / "s.sock"
    server = _start_server(path, sock)
    try:
        _read_through(path)
        # The first attach makes the model resident (the server loads it).
        first, _, n = _worker("attach", path, sock)
        say(f"resident after a first attach that loaded it: {first:.3f} s, {n} tensors")
        samples: dict[str, list[tuple[float, float]]] = {
            how: [] for how in ("attach", "handshake", "none", "mmap")
        }
        loadavg: list[tuple[float, float, float]] = []
        for i in range(runs):
            order = ["attach", "handshake", "none", "mmap"]
            for how in order if i % 2 == 0 else list(reversed(order)):
                work, whole, _ = _worker(how, path, sock)
                samples[how].append((work, whole))
                say(f"run {i + 1}/{runs} {how:6s} work {work * 1e3:9.2f} ms  process {whole:.3f} s")
            loadavg.append(os.getloadavg())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        for stream in (server.stdout, server.stderr):
            if stream is not None:
                stream.close()
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()
    medians = {
        how: {
            "work_s": statistics.median(w for w, _ in values),
            "process_s": statistics.median(p for _, p in values),
        }
        for how, values in samples.items()
    }
    attach = medians["attach"]["work_s"]
    ratios = {
        "none_over_attach": medians["none"]["work_s"] / attach,
        "mmap_over_attach": medians["mmap"]["work_s"] / attach,
    }
    return {
        "model": str(path),
        "bytes": path.stat().st_size,
        "runs": runs,
        "samples": samples,
        "medians": medians,
        "ratios": ratios,
        "targets": {
            "attach_50x_faster_than_warm_none": ratios["none_over_attach"] >= 50,
            "attach_faster_than_warm_mmap": ratios["mmap_over_attach"] > 1,
        },
        "load_average_after_each_run": loadavg,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB", help="the model's size (default: 2GiB)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each (default: 5)")
    parser.add_argument("--dir", default="/work/bench-data", help="where the model is kept")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path, written = ensure_bench_model(args.dir, args.size)
    say = (lambda _: None) if args.json else print
    say(f"model {path} ({'written' if written else 'reused'}), {path.stat().st_size} bytes")
    result = run(path, args.runs, say)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print("median over runs: work (in the process, from the call) and the whole process")
    for how, m in result["medians"].items():
        print(f"  {how:6s} {m['work_s'] * 1e3:9.2f} ms   process {m['process_s']:.3f} s")
    r = result["ratios"]
    print(f"warm none / attach: {r['none_over_attach']:.1f}x (target >= 50x)")
    print(f"warm mmap / attach: {r['mmap_over_attach']:.2f}x (target > 1x)")
    print(f"load average after each run: {result['load_average_after_each_run']}")
    print(f"targets: {result['targets']}")


if __name__ == "__main__":
    main()
