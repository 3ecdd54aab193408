"""aiogguf against the loaders a user would pick instead, and the machine's limit, on the
same bytes in the same run: the README's peer table, for a user to rerun.

Each peer reads one synthetic model (``aiogguf.testing.synth_cache``, ``--size``) into
host memory in a fresh process, from a warm page cache, after the same spacer and pause
as ``bench/load.py`` (``aiogguf.testing.bench.settle``); the peers alternate, every
other run in the reverse order. Peers:

- ``aiogguf_checks_on``: ``aiogguf.load(mode="none", n_gpu_layers=0)`` (the default
  config: each tensor checked); ``aiogguf_checks_off``: the same, ``check_tensors=False``.
- ``safetensors``: ``safetensors.numpy.load_file`` (a mapping) and a copy of each tensor,
  of a ``.safetensors`` file written beside the model with the same bytes (each tensor as
  ``U8`` of its bytes).
- ``gguf_py``: ``gguf.GGUFReader`` and ``np.array`` of each tensor (a copy).
- ``runai``: Run:ai's model streamer (``runai_model_streamer.SafetensorsStreamer``,
  its default threads, CPU) on the ``.safetensors`` file, and a copy of each tensor.
- ``llama_cpp``: llama.cpp's own loader, ``use_mmap`` off (``bench/vs_llamacpp.py``'s
  worker; checks off, its default).
- ``limit``: two threads (one per core, up to 16) ``preadv`` the file 64 MiB at a time
  into fresh 4 KiB-page memory (``aiogguf.testing.baselines.preadv_fresh_gbps``), its
  pages faulted in by the reads or each chunk's backed in one call first, the faster of
  the two in each run (which one won is printed).

A peer whose package is missing is skipped with one line saying how to install it.
Prints the load average before and after, each peer's median GB/s (tensor bytes over the
time from the call to the last byte in memory), its min-max, its ratio to the limit
(median of the per-run ratios) and how many times faster aiogguf with checks on is.
Not part of the test run.

    python bench/peers.py [--size 2GiB] [--runs 5] [--dir /work/bench-data]
                          [--peers aiogguf_checks_on,...] [--settle 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

MiB = 1 << 20
BENCH = Path(__file__).resolve().parent
_WORKER_TIMEOUT_S = 900.0

# peer → (the module it needs, how to install it), for the ones that are optional.
NEEDS: dict[str, tuple[str, str]] = {
    "safetensors": ("safetensors", "pip install safetensors"),
    "gguf_py": ("gguf", "pip install gguf"),
    "runai": ("runai_model_streamer", "pip install runai-model-streamer torch"),
    "llama_cpp": ("llama_cpp", "pip install -e '.[peer]' (builds llama.cpp from source)"),
}
PEERS = (
    "aiogguf_checks_on",
    "aiogguf_checks_off",
    "safetensors",
    "gguf_py",
    "runai",
    "llama_cpp",
    "limit",
)
LABELS = {
    "aiogguf_checks_on": "aiogguf `none`, checks on (default)",
    "aiogguf_checks_off": "aiogguf `none`, checks off",
    "safetensors": "safetensors `load_file` + a copy of each tensor",
    "gguf_py": "gguf-py `GGUFReader` + a copy of each tensor",
    "runai": "Run:ai model streamer (CPU, default threads) + a copy of each tensor",
    "llama_cpp": "llama.cpp's loader, `use_mmap` off",
    "limit": "two threads `preadv` 64 MiB into fresh memory (the limit)",
}


# --- the workers (a fresh process each: this script with --worker) ------------------------


def _safetensors_copy(path: str) -> tuple[float, int]:
    """``load_file`` as its users call it: safetensors' torch one where torch is installed
    (it maps the file and makes each tensor from the mapping), else its numpy one (which
    reads the whole file into bytes first); then a copy of each tensor, as a load that
    keeps the weights needs."""
    try:
        from safetensors.torch import load_file  # pyright: ignore[reportMissingImports]  (optional: a peer)
    except ImportError:
        import numpy as np
        from safetensors.numpy import load_file as load_numpy  # pyright: ignore[reportMissingImports]  (optional: a peer)

        start = time.perf_counter()
        arrays = [np.array(a) for a in load_numpy(path).values()]
        return time.perf_counter() - start, sum(a.nbytes for a in arrays)
    start = time.perf_counter()
    tensors = [t.clone() for t in load_file(path).values()]
    return time.perf_counter() - start, sum(t.numel() * t.element_size() for t in tensors)


def _runai_copy(path: str) -> tuple[float, int]:
    from runai_model_streamer import SafetensorsStreamer  # pyright: ignore[reportMissingImports]  (optional: a peer)

    start = time.perf_counter()
    copies = []
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(path)
        for _, tensor in streamer.get_tensors():
            copies.append(tensor.clone())
    seconds = time.perf_counter() - start
    return seconds, sum(t.numel() * t.element_size() for t in copies)


def worker_main(task: dict[str, Any]) -> dict[str, Any]:
    """One timed read of a peer that ``aiogguf.testing.bench`` has no task for."""
    seconds, nbytes = {"safetensors": _safetensors_copy, "runai": _runai_copy}[task["peer"]](
        task["path"]
    )
    return {"seconds": seconds, "nbytes": nbytes}


def _run_worker(task: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-P", os.path.abspath(__file__), "--worker", json.dumps(task)],
        capture_output=True,
        text=True,
        timeout=_WORKER_TIMEOUT_S,
        check=False,
        cwd=os.path.dirname(task["path"]),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " / ".join(proc.stderr.strip().splitlines()[-6:])
        raise RuntimeError(f"{task['peer']} failed (exit {proc.returncode}): {tail}")
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


# --- the safetensors twin -----------------------------------------------------------------


def write_safetensors_twin(gguf_path: Path) -> Path:
    """``<model>.safetensors`` beside the model, with the same tensor bytes (each tensor
    as ``U8`` of its byte count, in file order), written once and reused; the header is
    padded so that the data starts on a 4 KiB boundary, as the GGUF's data is aligned."""
    from aiogguf import inspect_sync

    out = gguf_path.with_suffix(".safetensors")
    index = inspect_sync(gguf_path)
    tensors = sorted(index.tensors, key=lambda t: t.offset)
    data_start = tensors[0].offset if tensors else 0
    header: dict[str, Any] = {}
    for t in tensors:
        begin = t.offset - data_start
        header[t.name] = {
            "dtype": "U8",
            "shape": [t.nbytes],
            "data_offsets": [begin, begin + t.nbytes],
        }
    data_end = max((t.offset + t.nbytes for t in tensors), default=data_start)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)
    size = 8 + len(raw) + (data_end - data_start)
    if out.exists() and out.stat().st_size == size:
        return out
    tmp = out.with_suffix(".safetensors.part")
    with open(gguf_path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(len(raw).to_bytes(8, "little"))
        dst.write(raw)
        src.seek(data_start)
        left = data_end - data_start
        while left:
            chunk = src.read(min(left, 64 * MiB))
            if not chunk:
                raise RuntimeError(f"{gguf_path} ended early")
            dst.write(chunk)
            left -= len(chunk)
    os.replace(tmp, out)
    return out


# --- the run ------------------------------------------------------------------------------


def _vs_llamacpp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vs_llamacpp", BENCH / "vs_llamacpp.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def installed(peer: str) -> bool:
    """Whether the package a peer needs is importable here."""
    need = NEEDS.get(peer)
    if need is None:
        return True
    try:
        return importlib.util.find_spec(need[0]) is not None
    except (ImportError, ValueError):
        return False


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(BENCH), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return "?"
    return done.stdout.strip() or "?"


def run(
    path: Path, peers: Sequence[str], runs: int, settle_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """``runs`` rounds of every peer in ``peers`` (alternated), with the limit each round."""
    from aiogguf import inspect_sync
    from aiogguf.io.pagecache import drop_from_cache
    from aiogguf.testing.baselines import GB, PageCache
    from aiogguf.testing.bench import (
        LIMIT_THREADS,
        limit_in_subprocess,
        load_in_subprocess,
        measure_in_subprocess,
        settle,
    )

    nbytes = inspect_sync(path).totals.nbytes
    twin = write_safetensors_twin(path) if {"safetensors", "runai"} & set(peers) else None
    cache = PageCache(evictable=drop_from_cache(path))
    llama = _vs_llamacpp() if "llama_cpp" in peers else None
    limit_name = f"preadv_fresh{'_1t' if LIMIT_THREADS == 1 else ''}"
    limit_kinds: list[str] = []  # per run, which memory the limit's faster run filled

    def measure(peer: str) -> float:
        """One timed read by ``peer``, in GB/s of tensor bytes (the limit: file bytes)."""
        source = twin if peer in ("safetensors", "runai") and twin is not None else path
        cache.make(source, "warm")
        settle(settle_s, touch_bytes=source.stat().st_size, near=source)
        if peer == "limit":
            # The faster of the pages faulted in by the read and backed in one call per
            # chunk first (as a load's readers back them): which is faster depends on the
            # machine (a VM that hands freed memory back favours backing).
            plain = limit_in_subprocess(limit_name, path)
            cache.make(source, "warm")
            settle(settle_s, touch_bytes=source.stat().st_size, near=source)
            backed = limit_in_subprocess(f"{limit_name}_backed", path)
            limit_kinds.append("backed" if backed > plain else "faulted")
            return max(plain, backed)
        if peer.startswith("aiogguf"):
            overrides = {"mode": "none", "n_gpu_layers": 0}
            overrides["check_tensors"] = peer == "aiogguf_checks_on"
            return load_in_subprocess(path, overrides).gbps
        if peer == "gguf_py":
            out = measure_in_subprocess({"task": "gguf_py", "path": os.fspath(path)})
            return float(out["nbytes"]) / out["seconds"] / GB
        if peer == "llama_cpp":
            assert llama is not None
            task = {
                "task": "llama",
                "path": os.fspath(path),
                "mode": "none",
                "check_tensors": False,
            }
            out = llama.run_worker(task, cwd=str(path.parent))
            return nbytes / out["seconds"] / GB
        out = _run_worker({"peer": peer, "path": os.fspath(source)})
        return float(out["nbytes"]) / out["seconds"] / GB

    loadavg = [os.getloadavg()]
    gbps: dict[str, list[float]] = {p: [] for p in peers}
    ratios: dict[str, list[float]] = {p: [] for p in peers}
    for r in range(runs):
        order = list(peers) if r % 2 == 0 else list(reversed(peers))
        say(f"run {r + 1}/{runs} (load average {os.getloadavg()[0]:.2f})")
        this_run: dict[str, float] = {}
        for peer in order:
            this_run[peer] = measure(peer)
            gbps[peer].append(this_run[peer])
            say(f"  {peer:<20} {this_run[peer]:6.2f} GB/s")
        if "limit" in this_run:
            for peer, value in this_run.items():
                ratios[peer].append(value / this_run["limit"])
    loadavg.append(os.getloadavg())
    summary = {
        peer: {
            "gbps": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "of_limit": statistics.median(ratios[peer]) if ratios[peer] else None,
            "runs": values,
        }
        for peer, values in gbps.items()
    }
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "commit": _commit(),
        "model": os.fspath(path),
        "tensor_bytes": nbytes,
        "runs": runs,
        "load_average": loadavg,
        "limit_won_by": limit_kinds,
        "peers": summary,
    }


def format_table(result: dict[str, Any]) -> str:
    """The README's table: each peer's median GB/s, its ratio to the limit, and how
    many times faster aiogguf with checks on is."""
    peers: dict[str, Any] = result["peers"]
    ours = peers.get("aiogguf_checks_on", {}).get("gbps")
    (b1, _, _), (a1, _, _) = result["load_average"]
    lines = [
        f"{result['date']}, {result['machine']}, aiogguf {result['commit']}, "
        f"{result['tensor_bytes'] / 2**30:.1f} GiB, warm page cache, {result['runs']} runs "
        f"in fresh processes alternated, medians; load average {b1:.2f} → {a1:.2f}; "
        f"the limit's faster memory per run: {', '.join(result.get('limit_won_by', [])) or '—'}",
        "",
        "| loader, into host memory | GB/s | of the limit | aiogguf (checks on) is |",
        "|---|---:|---:|---:|",
    ]
    for peer, s in peers.items():
        of_limit = "—" if s["of_limit"] is None else f"{s['of_limit']:.2f}"
        faster = "—" if ours is None or peer == "aiogguf_checks_on" else f"{ours / s['gbps']:.2f}×"
        label = LABELS[peer]
        if peer == "limit":
            label, of_limit = f"**{label}**", "1"
        lines.append(f"| {label} | {s['gbps']:.2f} | {of_limit} | {faster} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB", help="model size (default 2GiB)")
    parser.add_argument("--dir", default="/work/bench-data", help="where the model is kept")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma list (default all)")
    parser.add_argument("--settle", type=float, default=3.0, help="pause before each (s)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker_main(json.loads(args.worker))))
        return 0
    asked = [p for p in args.peers.split(",") if p]
    unknown = [p for p in asked if p not in PEERS]
    if unknown:
        parser.error(f"--peers: unknown {','.join(unknown)} (known: {','.join(PEERS)})")
    peers = []
    for peer in asked:
        if installed(peer):
            peers.append(peer)
        else:
            module, how = NEEDS[peer]
            print(f"skipped {peer}: {module} is not installed ({how})", flush=True)

    from aiogguf.testing.synth_cache import ensure_bench_model

    path, written = ensure_bench_model(args.dir, args.size)
    print(f"{'wrote' if written else 'reusing'} {path}", flush=True)
    result = run(path, peers, args.runs, args.settle, lambda text: print(text, flush=True))
    print()
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
