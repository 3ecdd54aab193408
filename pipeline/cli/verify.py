"""``aiogguf verify PATH (--sha256 HEX | --manifest FILE)``: check a model against the
hub's sha256 of a file (its LFS oid) or a manifest (aiogguf's JSON or llama.cpp's
``llama-gguf-hash`` text), reading each file once with a progress bar. A mismatch is an
``IntegrityError`` (one line, exit status 2), as is a manifest of another model."""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from aiogguf._units import format_bytes
from aiogguf.cli.hash import byte_progress
from aiogguf.integrity._hashing import verify_model_sync, verify_sha256_sync
from aiogguf.remote._sources import file_name

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``verify`` command's flags."""
    parser.add_argument(
        "path", help="GGUF file, URL or hf:// name (the first split of a split model)"
    )
    against = parser.add_mutually_exclusive_group(required=True)
    against.add_argument("--sha256", metavar="HEX", help="the file's sha256 (the hub's oid)")
    against.add_argument(
        "--manifest", metavar="FILE", help="a manifest from aiogguf hash or llama-gguf-hash"
    )


def run(args: argparse.Namespace) -> int:
    """Check a file against a sha256 or a hash manifest."""
    console = Console()
    with byte_progress(console, file_name(os.fspath(args.path))) as progress:
        if args.sha256 is not None:
            report = verify_sha256_sync(args.path, args.sha256, progress=progress)
        else:
            report = verify_model_sync(args.path, args.manifest, progress=progress)
    rate = report.nbytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
    console.print(
        f"[bold green]ok:[/] {format_bytes(report.nbytes)} in {report.files} "
        f"file{'' if report.files == 1 else 's'} match the {report.against} "
        f"({report.seconds:.2f} s, {rate:.2f} GB/s)",
        highlight=False,
        soft_wrap=True,
    )
    return 0
