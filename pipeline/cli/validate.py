"""`aiogguf validate PATH`: load with every check on and list every bad tensor."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiogguf._units import counted
from aiogguf.cli.extras import say_missing_gpu_extra
from aiogguf.cli.loading import load_with_progress
from aiogguf.cli.options import add_manifest_option, add_placement_options, config_from_args
from aiogguf.errors import TensorValidationError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``validate`` command's flags."""
    parser.add_argument("path", help="GGUF file (the first split of a split model)")
    add_placement_options(parser)
    add_manifest_option(parser)


def run(args: argparse.Namespace) -> int:
    """Load a model with every tensor checked; exit 2 if any is invalid."""
    config = config_from_args(args, check_tensors=True, keep_invalid=False)
    say_missing_gpu_extra(args, config)
    console = Console()
    try:
        report = load_with_progress(args.path, config, console)
    except TensorValidationError as exc:
        title = escape(counted(len(exc.failures), "bad tensor"))
        table = Table(title=title, title_justify="left")
        for col in ("tensor", "type", "problem", "first index", "bad"):
            table.add_column(col)
        for f in exc.failures:
            first = "" if f.first_index is None else str(f.first_index)
            # Names and problems come from the file: text, not rich markup.
            table.add_row(escape(f.name), f.type_name, escape(f.problem), first, str(f.count))
        console.print(table)
        return 2
    console.print(f"[bold green]ok:[/] {counted(report.validated, 'tensor')} valid")
    return 0
