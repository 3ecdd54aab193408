"""`aiogguf demo`: write a synthetic llama-shaped model (no download), load it, and
print the report. The model is kept in a cache folder and reused by later runs.

The model's writer needs ``gguf`` (the ``demo`` extra); it is imported only when the
command runs."""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from rich.console import Console
from rich.markup import escape

from aiogguf._units import counted, format_bytes
from aiogguf.cli.extras import needs_demo_extra
from aiogguf.cli.loading import load_with_progress, render_report
from aiogguf.cli.options import add_placement_options, config_from_args, positive_size
from aiogguf.errors import shown_path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` command's flags."""
    parser.add_argument("--size", default="1GiB", help="model size (default 1GiB)")
    parser.add_argument(
        "--dir", help="where to keep the model (default: $XDG_CACHE_HOME/aiogguf or ~/.cache)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    add_placement_options(parser)


def run(args: argparse.Namespace) -> int:
    """Make (or reuse) the synthetic demo model and load it."""
    with needs_demo_extra("the demo's synthetic model"):
        from aiogguf.testing.synth_cache import default_demo_path, ensure_synthetic_model
    console = Console()
    # A bad argument is the user's error (exit 2 with one line), not a crash.
    size = positive_size(args.size, "--size")
    path = default_demo_path(args.dir, size_bytes=size, seed=args.seed)
    t0 = time.perf_counter()
    try:
        with console.status(f"writing a {format_bytes(size)} synthetic model to {path}"):
            synth, written = ensure_synthetic_model(path, size_bytes=size, seed=args.seed)
    except OSError as exc:
        # A full disk (or a folder it may not write): the half-written model is removed,
        # so it takes no space, and the CLI says why in one line (exit 2).
        with contextlib.suppress(OSError):
            os.unlink(path)
        if exc.filename is None:
            exc.filename = os.fspath(path)
        raise
    took = time.perf_counter() - t0
    verb = f"wrote in {took:.1f} s" if written else "reusing"
    console.print(
        f"{verb} [bold]{escape(shown_path(path))}[/]: {counted(synth.n_layer, 'layer')}, "
        f"{counted(synth.n_tensors, 'tensor')}, "
        f"{format_bytes(synth.tensor_bytes)}"
    )
    config = config_from_args(args)
    report = load_with_progress(path, config, console)
    render_report(report, console)
    return 0
