"""`aiogguf bench`: sweep load mode × chunk size × readers × queue depth on a synthetic
model, against this machine's limits measured in the same run; write JSON and a plot.

Each load runs in a fresh process; each run measures a mode's limits right before that
mode's loads, so both see the same (possibly busy) machine, and a load is judged by the
fastest of its mode's limits (``none``: ``preadv`` into fresh 4 KiB-page and huge-page
memory, one thread for one reader; ``direct``: ``O_DIRECT`` into fresh memory). Warm
loads find the file cached in one stated way (read in file order, then mapped once);
``--cold`` drops it from the page cache before every load (``direct`` bypasses it anyway).

The harness (``aiogguf.testing``) is imported when the command runs, never when the
parser is built; writing the synthetic model needs ``gguf`` (the ``demo`` extra),
benchmarking a file given with ``--path`` does not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from aiogguf._config import load_config
from aiogguf._units import format_bytes
from aiogguf.cli.extras import needs_demo_extra
from aiogguf.cli.options import positive_int, positive_size
from aiogguf.errors import ConfigError

__all__ = ["SETTLE_DEFAULT_S", "add_arguments", "render", "run"]

if TYPE_CHECKING:
    from aiogguf.testing.bench import SweepResult

# aiogguf.testing.bench.SETTLE_S, restated so that building the parser imports no harness
# (a test holds the two equal).
SETTLE_DEFAULT_S = 3.0
# (size, chunk sizes, readers, queue depths, runs): the full sweep and --quick.
# Queue depth no longer changes a load (``pipeline.queue_depth``): one value by default.
FULL = ("1GiB", "1MiB,4MiB,16MiB,64MiB,256MiB", "1,2,4", "8", 3)
QUICK = ("256MiB", "4MiB,64MiB", "2", "8", 1)
JSON_NAME, PLOT_NAME = "aiogguf-bench.json", "aiogguf-bench.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's flags."""
    parser.add_argument(
        "--quick", action="store_true", help="small model, few points, one run (< 2 minutes)"
    )
    parser.add_argument(
        "--size", help=f"synthetic model size (default {FULL[0]}, quick {QUICK[0]})"
    )
    parser.add_argument(
        "--dir", help="where the model is kept (default: $XDG_CACHE_HOME/aiogguf or ~/.cache)"
    )
    parser.add_argument("--path", help="benchmark this GGUF file instead of a synthetic model")
    parser.add_argument(
        "--cold", action="store_true", help="drop the file from the page cache before each run"
    )
    parser.add_argument(
        "--out", metavar="DIR", help=f"write {JSON_NAME} and {PLOT_NAME} there (default: nothing)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG plot here")
    parser.add_argument("--runs", type=int, help=f"runs per point (default {FULL[4]}, quick 1)")
    parser.add_argument("--modes", help="comma list of load modes (default all)")
    parser.add_argument("--chunk-sizes", metavar="LIST", help=f"default {FULL[1]}")
    parser.add_argument("--readers", metavar="LIST", help=f"default {FULL[2]}")
    parser.add_argument("--queue-depths", metavar="LIST", help=f"default {FULL[3]}")
    parser.add_argument("--config", metavar="FILE", help="base TOML config for every load")
    parser.add_argument("--no-check", action="store_true", help="loads with check_tensors=false")
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_DEFAULT_S,
        metavar="SECONDS",
        help="pause before each limit and load (default %(default)g; see bench/load.py)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(
            flag, "command line", f"expected integers like 1,2,4, got {text!r}"
        ) from exc
    if not values or min(values) < 1:
        raise ConfigError(flag, "command line", f"expected integers >= 1, got {text!r}")
    return values


def _modes(text: str | None) -> list[str]:
    from aiogguf.testing.bench import MODES

    if text is None:
        return list(MODES)
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(
            "--modes", "command line", f"expected some of {','.join(MODES)}, got {text!r}"
        )
    return modes


def run(args: argparse.Namespace) -> int:
    """Sweep the load settings over a synthetic model and print (or plot) the rates."""
    from aiogguf.testing.bench import grid, plot_sweep, run_sweep

    console = Console()
    size_text, chunks_text, readers_text, depths_text, runs = QUICK if args.quick else FULL
    if args.config is not None:
        load_config(args.config)  # a bad file fails here, not in every worker
    modes = _modes(args.modes)
    chunk_list = (args.chunk_sizes or chunks_text).split(",")
    chunks = [positive_size(v, "--chunk-sizes") for v in chunk_list if v.strip()]
    readers = _ints(args.readers or readers_text, "--readers")
    depths = _ints(args.queue_depths or depths_text, "--queue-depths")
    runs = positive_int(args.runs, "--runs") if args.runs is not None else runs
    if args.settle < 0:
        raise ConfigError("--settle", "command line", f"must be >= 0, got {args.settle}")
    if args.path:
        path = Path(args.path)
    else:
        with needs_demo_extra("the benchmark's synthetic model"):
            from aiogguf.testing.synth_cache import default_demo_path, ensure_synthetic_model
        size = positive_size(args.size or size_text, "--size")
        path = default_demo_path(args.dir, size_bytes=size)
        t0 = time.perf_counter()
        with console.status(f"writing a {format_bytes(size)} synthetic model to {path}"):
            _, written = ensure_synthetic_model(path, size_bytes=size)
        verb = f"wrote in {time.perf_counter() - t0:.1f} s" if written else "reusing"
        console.print(f"{verb} {path}")
    points = grid(modes, chunks, readers, depths)
    console.print(
        f"{len(points)} points × {runs} run(s){', cold cache' if args.cold else ''}; "
        f"every limit and load in a fresh process after a {args.settle:g} s pause"
    )

    def say(text: str) -> None:
        if not args.quiet:
            console.print(text, highlight=False)

    result = run_sweep(
        path,
        points,
        runs=runs,
        cold=args.cold,
        check_tensors=False if args.no_check else None,
        config=args.config,
        settle_s=args.settle,
        say=say,
    )
    json_path, plot_path = _outputs(args)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_path}")
    if plot_path is not None:
        skipped = plot_sweep(result, str(plot_path))
        console.print(skipped if skipped else f"wrote {plot_path}")
    render(result, console)
    return 0


def _outputs(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """Where to write the results and the plot: only where ``--json``, ``--plot`` or
    ``--out`` say (a benchmark run from any folder leaves nothing there unasked)."""
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else (out / JSON_NAME if out else None)
    plot_path = Path(args.plot) if args.plot else (out / PLOT_NAME if out else None)
    return json_path, plot_path


def render(result: SweepResult, console: Console) -> None:
    """The limits, every point, and the best setting per mode."""
    from aiogguf.testing.bench import LIMIT_NOTES

    limits = Table(title=f"limits (median of {result.runs} run(s))")
    limits.add_column("limit")
    limits.add_column("GB/s", justify="right")
    limits.add_column("what")
    for name, gbps in result.limits.items():
        limits.add_row(name, f"{gbps:.2f}", LIMIT_NOTES.get(name, ""))
    console.print(limits)
    points = Table(
        title=f"{result.size_bytes / 1e9:.2f} GB model, median of {result.runs} run(s); "
        "ratio = GB/s / the point's limit (the fastest of its mode's, see above)"
    )
    columns = ("mode", "chunk", "readers", "queue", "GB/s", "limit", "limit GB/s", "ratio")
    for col in (*columns, "lag p99 ms"):
        points.add_column(col, justify="left" if col in ("mode", "limit") else "right")
    for p in result.points:
        data = p.to_json()
        points.add_row(
            p.point.mode,
            format_bytes(p.point.chunk_bytes),
            str(p.point.readers),
            str(p.point.queue_depth),
            f"{p.gbps:.2f}",
            p.limit,
            f"{p.limit_gbps:.2f}",
            f"{p.ratio:.2f}",
            f"{data['loop_lag_p99_ms']:.1f}",
        )
    console.print(points)
    best = Table(title="best setting per mode")
    for col in ("mode", "chunk", "readers", "queue", "GB/s", "limit GB/s", "ratio"):
        best.add_column(col, justify="left" if col == "mode" else "right")
    for mode, p in result.best().items():
        best.add_row(
            mode,
            format_bytes(p.point.chunk_bytes),
            str(p.point.readers),
            str(p.point.queue_depth),
            f"{p.gbps:.2f}",
            f"{p.limit_gbps:.2f} ({p.limit})",
            f"{p.ratio:.2f}",
        )
    console.print(best)
    if result.cold:
        ok = "yes" if result.cold_drop_ok else "NO (some loads were warm)"
        console.print(f"page cache dropped before every load: {ok}")
    for note in result.notes:
        console.print(f"note: {note}")
