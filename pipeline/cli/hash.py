"""``aiogguf hash PATH [-o MANIFEST] [--format aiogguf|llama]``: hash a model once and
write its manifest (format §8): aiogguf's JSON beside the model by default
(``MODEL.gguf.manifest.json``; one for every shard of a split set), or llama.cpp's
``llama-gguf-hash`` text (``MODEL.gguf.gguf-hash.txt``). ``-o -`` writes to stdout. A URL
or ``hf://`` name is read whole (an ``hf://`` file through the hub's cache, checked
against the hub's sha256); its manifest goes in the current folder by default."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import Progress

from aiogguf._units import format_bytes
from aiogguf.cli.loading import byte_columns
from aiogguf.integrity._hashing import hash_model_llama_sync, hash_model_sync
from aiogguf.integrity._llama_hash import format_llama
from aiogguf.integrity._manifest import SIDECAR_SUFFIX, manifest_json
from aiogguf.remote._sources import file_name, is_remote

__all__ = ["add_arguments", "byte_progress", "run", "write_atomically"]

SUFFIXES = {"aiogguf": SIDECAR_SUFFIX, "llama": ".gguf-hash.txt"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hash`` command's flags."""
    parser.add_argument(
        "path", help="GGUF file, URL or hf:// name (the first split of a split model)"
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="MANIFEST",
        help="where to write (default: beside the model; - for stdout)",
    )
    parser.add_argument(
        "--format",
        choices=sorted(SUFFIXES),
        default="aiogguf",
        help="aiogguf's JSON manifest, or llama.cpp's llama-gguf-hash text",
    )


@contextmanager
def byte_progress(console: Console, description: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar in bytes on a terminal (nothing elsewhere); yields the callback
    that ``hash_model`` and ``verify_model`` take."""
    with Progress(*byte_columns(), console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        yield update


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a file beside it and a rename: a reader never
    sees half a manifest, and an interrupted write leaves the old one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".aiogguf-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def run(args: argparse.Namespace) -> int:
    """Write a file's hash manifest (beside it, to ``-o`` or to stdout)."""
    to_stdout = args.output == "-"
    console = Console(stderr=True) if to_stdout else Console()
    path = os.fspath(args.path)
    # A remote model's manifest goes in the current folder, named after its file.
    beside = file_name(path) if is_remote(path) else path
    output = args.output or beside + SUFFIXES[args.format]
    started = time.perf_counter()
    with byte_progress(console, file_name(path)) as progress:
        if args.format == "llama":
            digests = hash_model_llama_sync(args.path, progress=progress)
            text = format_llama(digests)
            n_tensors = sum(len(d.tensors) for d in digests)
            summary = f"{_count(len(digests), 'file')}, {_count(n_tensors, 'tensor')}"
        else:
            manifest = hash_model_sync(args.path, progress=progress)
            text = manifest_json(manifest)
            nbytes = sum(f.size for f in manifest.files)
            blocks = sum(len(f.blocks) for f in manifest.files)
            summary = (
                f"{_count(len(manifest.files), 'file')}, {_count(len(manifest.tensors), 'tensor')}"
                f", {_count(blocks, 'block')}, {format_bytes(nbytes)}, set {manifest.set_id[:16]}"
            )
    seconds = time.perf_counter() - started
    if to_stdout:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_atomically(output, text)
    where = "stdout" if to_stdout else output
    console.print(
        f"[bold green]wrote[/] {where}: {summary} in {seconds:.2f} s",
        highlight=False,
        soft_wrap=True,
    )
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
