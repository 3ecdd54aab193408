"""GPU check: full offload of an ~8 GiB model, against the pinned copy peak of the GPU.

One script, sized to finish in under 5 minutes on one H200:

1. writes (or reuses) an ~8 GiB synthetic model on local disk;
2. measures the pinned host-to-device copy bandwidth with CuPy (the ceiling);
3. loads the model with every layer on the GPU (``n_gpu_layers=-1``) in modes ``none``
   and ``direct`` through the public API;
4. verifies every byte of every tensor: a position-weighted fingerprint computed on the
   device (CuPy) must equal the one computed on the host from the file;
5. prints GB/s per mode and its ratio to the pinned copy peak.

    python bench/gpu_check.py [--dir /tmp/aiogguf-gpu] [--size 8GiB] [--cold] [--json]

``--cold`` drops the file's pages from the page cache before each load
(``POSIX_FADV_DONTNEED``), so the loads read from the disk. Without CuPy or a GPU it
says so and exits with status 2; everything but the measurements imports without CuPy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from aiogguf.io.devices.cupy_backend import cupy_devices, import_cupy
from aiogguf.synth import ensure_synthetic_model
from aiogguf.units import parse_size

GB = 1e9
MiB = 1024**2
# Fingerprint: sum over 8-byte little-endian words w[i] of w[i] * (i mod P + 1), mod 2**64.
# Position weights make swapped, shifted or misplaced chunks show; P keeps weights small.
_P = 65521
_CHUNK_BYTES = 64 * MiB


def fingerprint(xp: Any, data: Any) -> int:
    """Fingerprint of a 1-D uint8 array of ``xp`` (numpy, numpy.memmap or cupy)."""
    n = int(data.size)
    body = n - n % 8
    total = 0
    for start in range(0, body, _CHUNK_BYTES):
        part = data[start : min(start + _CHUNK_BYTES, body)]
        if xp is not np and int(part.data.ptr) % 8:
            part = part.copy()  # 8-byte loads on a GPU must be aligned
        words = part.view(xp.uint64)
        index = xp.arange(start // 8, start // 8 + words.size, dtype=xp.uint64)
        weights = index % xp.uint64(_P) + xp.uint64(1)
        total += int((words * weights).sum())  # uint64 arithmetic wraps mod 2**64
    if body < n:
        tail = bytes(data[body:].get() if xp is not np else data[body:])
        total += int.from_bytes(tail, "little") * ((body // 8) % _P + 1)
    return total % 2**64


def pinned_copy_peak(cupy: Any, nbytes: int = 1024**3, repeats: int = 5) -> float:
    """Best host-to-device copy rate (GB/s) from pinned memory on GPU 0, one stream."""
    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(0):
        host = cupy.cuda.alloc_pinned_memory(nbytes)
        np.frombuffer(host, np.uint8, nbytes)[:] = 1  # fault the pages in
        dev = cupy.cuda.Memory(nbytes)
        stream = cupy.cuda.Stream(non_blocking=True)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        best = 0.0
        for _ in range(repeats):
            start.record(stream)
            runtime.memcpyAsync(dev.ptr, host.ptr, nbytes, runtime.memcpyHostToDevice, stream.ptr)
            end.record(stream)
            end.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, end)
            best = max(best, nbytes / (ms / 1000.0) / GB)
        del host, dev
    return best


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def host_fingerprints(model: Any) -> dict[str, int]:
    """Fingerprint of every tensor's bytes, read from the files."""
    maps = [np.memmap(f.path, dtype=np.uint8, mode="r") for f in model.index.files]
    out: dict[str, int] = {}
    for entry in model.index.tensors:
        data = maps[entry.file_index][entry.offset : entry.offset + entry.nbytes]
        out[entry.name] = fingerprint(np, data)
    return out


def verify(cupy: Any, model: Any, expected: dict[str, int]) -> tuple[int, int, list[str]]:
    """``(tensors on a GPU, bytes on a GPU, names whose fingerprint differs)``."""
    on_gpu = gpu_bytes = 0
    bad: list[str] = []
    for entry in model.index.tensors:
        array = model.tensors[entry.name]
        if isinstance(array, cupy.ndarray):
            on_gpu += 1
            gpu_bytes += entry.nbytes
            with cupy.cuda.Device(array.device.id):
                got = fingerprint(cupy, array.reshape(-1).view(cupy.uint8))
        else:
            got = fingerprint(np, np.asarray(array).reshape(-1).view(np.uint8))
        if got != expected[entry.name]:
            bad.append(entry.name)
    return on_gpu, gpu_bytes, bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/aiogguf-gpu", help="where the model is written")
    parser.add_argument("--size", default="8GiB", help="tensor bytes of the model")
    parser.add_argument("--modes", default="none,direct")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before loads")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    cupy = import_cupy()
    if cupy is None or not cupy_devices():
        print("gpu_check: needs CuPy and a CUDA device", file=sys.stderr)
        return 2
    from aiogguf.api import load_sync  # the public API; imported late: it is the subject

    size = parse_size(args.size)
    path = Path(args.dir) / f"gpu-check-{size // MiB}MiB.gguf"
    t = time.perf_counter()
    synth, written = ensure_synthetic_model(path, size_bytes=size, seed=0)
    write_s = time.perf_counter() - t
    log = (lambda *a: None) if args.json else print
    log(
        f"model: {path} ({synth.tensor_bytes / GB:.2f} GB of tensors, {synth.n_tensors} "
        f"tensors; {'written' if written else 'reused'} in {write_s:.1f} s)"
    )

    peak = pinned_copy_peak(cupy)
    log(f"pinned host-to-device copy peak (1 GiB, one stream): {peak:.2f} GB/s")

    results: dict[str, Any] = {
        "model_bytes": synth.tensor_bytes,
        "pinned_peak_gbps": peak,
        "cold": args.cold,
        "modes": {},
    }
    expected: dict[str, int] | None = None
    failed = False
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if args.cold:
            drop_page_cache(path)
        t = time.perf_counter()
        with load_sync(path, n_gpu_layers=-1, mode=mode) as model:
            load_s = time.perf_counter() - t
            if expected is None:
                t = time.perf_counter()
                expected = host_fingerprints(model)
                log(f"host fingerprints of the file: {time.perf_counter() - t:.1f} s")
            on_gpu, gpu_bytes, bad = verify(cupy, model, expected)
            report = str(model.report) if model.report is not None else ""
        rate = synth.tensor_bytes / load_s / GB
        failed |= bool(bad) or on_gpu == 0
        results["modes"][mode] = {
            "seconds": load_s,
            "gbps": rate,
            "ratio_to_peak": rate / peak if peak else None,
            "tensors_on_gpu": on_gpu,
            "bytes_on_gpu": gpu_bytes,
            "mismatched": bad,
        }
        log(
            f"{mode:>6}: {load_s:.2f} s, {rate:.2f} GB/s = {rate / peak:.0%} of the pinned "
            f"peak; {on_gpu}/{synth.n_tensors} tensors ({gpu_bytes / GB:.2f} GB) on the GPU; "
            + ("every byte verified" if not bad else f"{len(bad)} MISMATCHED: {bad[:5]}")
        )
        if report and not args.json:
            print(report)
    if args.json:
        print(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
