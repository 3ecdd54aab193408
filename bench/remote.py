"""Loading over HTTP against the link's own limits, measured in the same run.

A loopback HTTP server (aiohttp's ``FileResponse``: Range, ETag, If-Match) runs in a
process of its own (it shares no GIL with what is measured) and plays a slow link: each
answer starts ``--latency-ms`` after its request (one round trip), and its body goes
out ``--window`` bytes per round trip, as a TCP sender whose window is full sends it, so
one connection moves at most ``window / latency`` (4 MiB, the default, is Linux's
default cap on a socket's send buffer: 200 MiB/s at 20 ms). Each window is one
``sendfile``: the server spends no CPU per byte in Python. Not modelled: TCP's slow
start, the connect's round trip. The file is read into the page cache first, and one
untimed pass of concurrent GETs warms the server, so that every run meets the same
server.

Then ``--runs`` times, in alternated order, each in a fresh process:

- ``raw``: plain concurrent ranged GETs with ``http.client`` into fresh memory (its
  pages taken inside the clock, as the load's are), as many at once and as big as the
  load's (``remote_in_flight`` connections, each taking a job of the load's size and
  asking for it in requests of ``remote_request_size``), at the CPU priority of the
  load's readers (``LOAD_NICE``): the link's limit for that way of reading;
- ``single``: one GET of the whole file on one connection (a browser's, curl's), at
  the same priority;
- ``load``: ``aiogguf.load(url)`` (mode ``none``, checks on, host memory) after
  ``warm_up``, timed from the call to the model in hand (header round trips included).

Prints the medians (GB/s of the file's size), the ratios load/raw and load/single
(medians of each run's ratio), and the machine's load average before and after (a
busy or small machine shares its cores between server and loader: the concurrent
reads are then bound by the CPU, not the link). Not part of the test run.

    python bench/remote.py [--size 2GiB] [--latency-ms 20] [--window 4MiB] [--runs 3]
                           [--dir /work/bench-data] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
KINDS = ("raw", "single", "load")
_KEPT: list[Any] = []


# -- the server, in a process of its own -------------------------------------------


def _serve(root: str, latency_s: float, window: int, ports: Any) -> None:
    from aiohttp import web

    class PacedFile(web.FileResponse):
        """aiohttp's file response (Range, ETag, If-Match as it answers them), its body
        sent as a window-limited TCP sender sends it: ``window`` bytes per round trip,
        each by ``sendfile`` (nothing per byte in Python, so the server's CPU stays out
        of what is measured)."""

        async def _sendfile(
            self, request: web.BaseRequest, fobj: Any, offset: int, count: int
        ) -> Any:
            writer = await web.StreamResponse.prepare(self, request)
            loop, transport = asyncio.get_running_loop(), request.transport
            assert transport is not None
            due = loop.time()
            while count > 0:
                n = min(window, count)
                await loop.sendfile(transport, fobj, offset, n)
                offset, count, due = offset + n, count - n, due + latency_s
                if count:
                    await asyncio.sleep(due - loop.time())
            await web.StreamResponse.write_eof(self)
            return writer

    async def handle(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(latency_s)  # the request's way there and the answer's back
        return PacedFile(Path(root) / request.match_info["name"])

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/{name}", handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=256)
        await site.start()
        server = site._server
        assert server is not None
        ports.put(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(main())


# -- what is measured, each in a fresh process -------------------------------------


def _fresh_memory(nbytes: int) -> memoryview:
    """Never-touched memory in the pages the load's host image takes (``huge_pages =
    "auto"``): its pages are taken as the bytes land, inside the clock."""
    from aiogguf.io.buffers import HostBuffer, huge_pages_pay

    buffer = HostBuffer(nbytes, huge_pages=huge_pages_pay())
    _KEPT.append(buffer)  # for the process's life: it measures once, then exits
    return buffer.memoryview


def _get_into(conn: http.client.HTTPConnection, path: str, view: memoryview, start: int) -> None:
    headers = {"Range": f"bytes={start}-{start + len(view) - 1}"} if start >= 0 else {}
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    if response.status != (206 if start >= 0 else 200):
        raise RuntimeError(f"GET {path}: {response.status} {response.reason}")
    done = 0
    while done < len(view):
        got = response.readinto(view[done:])
        if not got:
            raise RuntimeError(f"GET {path}: the body ended at byte {done}")
        done += got


class _Clock:
    """Wall and CPU time (every thread of the process) since it was made."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> dict[str, float]:
        return {
            "seconds": time.perf_counter() - self.wall,
            "cpu_s": time.process_time() - self.cpu,
        }


def _raw(port: int, path: str, size: int, cuts: tuple[int, int, int]) -> dict[str, Any]:
    from aiogguf.io.workers import at_load_priority

    clock = _Clock()
    dest = _fresh_memory(size)
    connections, job_bytes, request_bytes = cuts
    starts = iter(range(0, size, job_bytes))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        at_load_priority()
        conn = http.client.HTTPConnection("127.0.0.1", port)
        try:
            while True:
                with lock:
                    start = next(starts, None)
                if start is None:
                    return
                end = min(start + job_bytes, size)
                for lo in range(start, end, request_bytes):
                    hi = min(lo + request_bytes, end)
                    _get_into(conn, path, dest[lo:hi], lo)
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    measured = clock.read()
    if errors:
        raise errors[0]
    return measured


def _single(port: int, path: str, size: int) -> dict[str, Any]:
    from aiogguf.io.workers import at_load_priority

    at_load_priority()
    clock = _Clock()
    dest = _fresh_memory(size)
    conn = http.client.HTTPConnection("127.0.0.1", port)
    try:
        _get_into(conn, path, dest, -1)
    finally:
        conn.close()
    return clock.read()


def _load(url: str) -> dict[str, Any]:
    import aiogguf

    aiogguf.warm_up_sync(mode="none")
    clock = _Clock()
    with aiogguf.load_sync(url, mode="none") as model:
        measured = clock.read()
        report = model.report
        return {
            **measured,
            "requests": sum(f.reads for f in report.files),
            "tensors_checked": report.validated,
            "reads_s": [f.end_s - f.start_s for f in report.files],
        }


def _measure(task: dict[str, Any], results: Any) -> None:
    try:
        kind, port, path, size = task["kind"], task["port"], task["path"], task["size"]
        # Imported before any clock starts.
        import aiogguf.io.buffers
        import aiogguf.io.workers  # noqa: F401

        if kind == "raw":
            measured = _raw(port, path, size, task["cuts"])
        elif kind == "single":
            measured = _single(port, path, size)
        else:
            measured = _load(f"http://127.0.0.1:{port}{path}")
        results.put(measured)
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def _in_process(ctx: Any, target: Any, *args: Any, timeout_s: float = 600.0) -> Any:
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue), daemon=True)
    proc.start()
    try:
        return proc, queue.get(timeout=timeout_s)
    except BaseException:
        proc.kill()
        raise


# -- the run -----------------------------------------------------------------------


def load_cuts(size: int) -> tuple[int, int, int]:
    """The load's defaults for a file of ``size`` bytes: (connections, job bytes, request
    bytes), as ``jobs.job_bytes`` cuts host jobs (a chunk, or less to give every reader
    one) and ``HttpSource`` asks for a job (``remote_request_size`` at a time)."""
    from aiogguf._config import load_config
    from aiogguf._jobs import MIN_SPREAD_BYTES

    pipeline = load_config(None).pipeline
    readers = pipeline.remote_in_flight
    spread = max(-(-size // readers), MIN_SPREAD_BYTES)
    job_bytes = min(pipeline.chunk_size, spread)
    return readers, job_bytes, min(job_bytes, pipeline.remote_request_size)


def run(path: Path, runs: int, latency_ms: float, window: int, say: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    size = path.stat().st_size
    connections, job_bytes, request_bytes = load_cuts(size)
    load_before = os.getloadavg()
    server, port = _in_process(
        ctx, _serve, str(path.parent), latency_ms / 1000, window, timeout_s=60
    )
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    try:
        # Untimed: the server's first answers (its code paths, its first connections)
        # are paid before the first measured kind, which would otherwise pay them alone.
        warm = {"kind": "raw", "port": port, "path": f"/{path.name}", "size": size}
        warm["cuts"] = (connections, job_bytes, request_bytes)
        warm["size"] = min(size, connections * request_bytes)
        _in_process(ctx, _measure, warm)[0].join(60)
        for i in range(runs):
            for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
                task = {
                    "kind": kind,
                    "port": port,
                    "path": f"/{path.name}",
                    "size": size,
                    "cuts": (connections, job_bytes, request_bytes),
                }
                proc, result = _in_process(ctx, _measure, task)
                proc.join(60)
                if "error" in result:
                    raise SystemExit(f"{kind}: {result['error']}")
                result["gbps"] = size / result["seconds"] / 1e9
                samples[kind].append(result)
                wall, gbps, cpu = result["seconds"], result["gbps"], result["cpu_s"]
                say(f"run {i + 1}/{runs} {kind:6} {wall:.3f} s {gbps:.3f} GB/s, CPU {cpu:.2f} s")
    finally:
        server.kill()
        server.join(10)
    load_after = os.getloadavg()

    def median(kind: str, key: str = "gbps") -> float:
        return statistics.median(s[key] for s in samples[kind])

    def ratio(other: str) -> float:
        return statistics.median(
            a["gbps"] / b["gbps"] for a, b in zip(samples["load"], samples[other], strict=True)
        )

    return {
        "size_bytes": size,
        "latency_ms": latency_ms,
        "window_bytes": window,
        "connections": connections,
        "job_bytes": job_bytes,
        "request_bytes": request_bytes,
        "runs": runs,
        "cpus": os.cpu_count(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
        "gbps": {kind: median(kind) for kind in KINDS},
        "runs_gbps": {kind: [s["gbps"] for s in samples[kind]] for kind in KINDS},
        "cpu_s": {kind: median(kind, "cpu_s") for kind in KINDS},
        "load_requests": samples["load"][0].get("requests"),
        "load_over_raw": ratio("raw"),
        "load_over_single": ratio("single"),
    }


def print_table(result: dict[str, Any]) -> None:
    size_mib = result["size_bytes"] / MiB
    print(
        f"\n{size_mib:.0f} MiB over loopback, {result['latency_ms']:g} ms round trip, "
        f"{result['window_bytes'] / MiB:g} MiB window per connection; "
        f"{result['connections']} connections, jobs of {result['job_bytes'] / MiB:.1f} MiB "
        f"in requests of {result['request_bytes'] / MiB:.1f} MiB "
        f"(the load's reads: {result['load_requests']}); "
        f"{result['runs']} runs, medians"
    )
    print("| read | GB/s | runs | CPU s (all threads) |")
    print("|---|---|---|---|")
    names = {
        "raw": "raw: concurrent ranged GETs",
        "single": "one connection, one GET",
        "load": "aiogguf load (none, checks on)",
    }
    for kind in KINDS:
        runs = ", ".join(f"{g:.3f}" for g in result["runs_gbps"][kind])
        cpu = result["cpu_s"][kind]
        print(f"| {names[kind]} | {result['gbps'][kind]:.3f} | {runs} | {cpu:.2f} |")
    print(f"load / raw: {result['load_over_raw']:.2f} (target >= 0.8)")
    print(f"load / single: {result['load_over_single']:.2f} (target >= 5)")
    before = " ".join(f"{x:.2f}" for x in result["loadavg_before"])
    after = " ".join(f"{x:.2f}" for x in result["loadavg_after"])
    print(f"machine: {result['cpus']} CPUs, load average {before} before, {after} after")


def main() -> None:
    from aiogguf._units import parse_size
    from aiogguf.testing.baselines import warm_file
    from aiogguf.testing.synth_cache import ensure_bench_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A model of the size people fetch from the hub (a 2.28 GiB one is #28's example);
    # the header's round trip is a fixed cost that weighs more on a smaller one.
    parser.add_argument("--size", default="2GiB", help="model size (default 2GiB)")
    parser.add_argument("--dir", default="/work/bench-data", help="where the model is kept")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="round trip (20)")
    parser.add_argument("--window", default="4MiB", help="bytes in flight per connection")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON to FILE")
    args = parser.parse_args()

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    t0 = time.perf_counter()
    path, written = ensure_bench_model(args.dir, args.size)
    say(f"{'wrote' if written else 'reusing'} {path} ({time.perf_counter() - t0:.1f} s)")
    # The server's reads come from the page cache in every run: the first kind measured
    # would otherwise pay the disk alone.
    warm_file(path)
    result = run(path, args.runs, args.latency_ms, parse_size(args.window), say)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    sys.exit(main())
