"""`aiogguf load PATH`: load a model with a progress bar and print the report."""

from __future__ import annotations

import argparse

from rich.console import Console

from aiogguf.cli.extras import say_missing_gpu_extra
from aiogguf.cli.loading import load_with_progress, render_report
from aiogguf.cli.options import add_manifest_option, add_placement_options, config_from_args

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``load`` command's flags."""
    parser.add_argument("path", help="GGUF file (the first split of a split model)")
    add_placement_options(parser)
    add_manifest_option(parser)
    parser.add_argument(
        "--no-check", action="store_true", help="skip tensor validation (check_tensors=false)"
    )


def run(args: argparse.Namespace) -> int:
    """Load a model as configured and print the load's report."""
    config = config_from_args(args, check_tensors=False if args.no_check else None)
    say_missing_gpu_extra(args, config)
    console = Console(stderr=False)
    report = load_with_progress(args.path, config, console)
    render_report(report, console)
    return 0
