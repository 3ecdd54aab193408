"""Runs gguf-py's own scripts (they ship in the ``gguf`` package, ``gguf/scripts/``) with
gguf-py's ``GGUFReader`` or ``aiogguf.compat._reader.GGUFReader`` in its place.

In-process (``run_script``): the script's file is executed as ``__main__`` with
``sys.argv`` set, its stdout captured, the records of gguf-py's loggers (``gguf*``: the
scripts' ``gguf-dump``, ``gguf-set-metadata``… and the package's own) formatted as
``logging.basicConfig`` formats them, and a ``SystemExit`` or an escaping exception
recorded, not raised. A handler of our own on the root logger makes the scripts'
``basicConfig`` calls no-ops, so no run changes the next one's logging.

As a process: ``python tests/gguf_scripts.py READER SCRIPT ARG...`` runs the script as
its own ``__main__`` would, with the reader swapped first: its stdout and stderr are
the script's own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import gguf.gguf_reader

from aiogguf import compat

SCRIPTS = Path(gguf.__file__).resolve().parent / "scripts"
READERS: dict[str, type[Any]] = {
    "gguf-py": gguf.gguf_reader.GGUFReader,
    "aiogguf": compat.GGUFReader,
}


@dataclass(frozen=True)
class Outcome:
    """What one run of a script showed: ``exit_code`` is ``None`` when ``main()``
    returned, ``SystemExit``'s code otherwise; ``error`` the type and message of an
    exception that escaped ``main()``."""

    exit_code: int | str | None
    stdout: str
    log: str
    error: str | None


@contextlib.contextmanager
def reader_swapped(cls: Callable[..., Any]) -> Iterator[None]:
    """``gguf.GGUFReader`` (what ``import gguf`` and ``from gguf import GGUFReader``
    find) and ``gguf.gguf_reader.GGUFReader`` are ``cls`` inside."""
    saved = gguf.GGUFReader, gguf.gguf_reader.GGUFReader
    gguf.GGUFReader = gguf.gguf_reader.GGUFReader = cls  # type: ignore[misc]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.gguf_reader.GGUFReader = saved  # type: ignore[misc]


class _GgufOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("gguf")


def run_script(reader: Callable[..., Any], script: str, argv: Sequence[str]) -> Outcome:
    """Run ``gguf/scripts/<script>.py argv...`` in this process, ``reader`` (a class, or
    a function that returns a reader) in place of gguf-py's ``GGUFReader``."""
    path = SCRIPTS / f"{script}.py"
    out = io.StringIO()
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    handler.addFilter(_GgufOnly())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if "--verbose" in argv else logging.INFO)
    exit_code: int | str | None = None
    error: str | None = None
    saved_argv = sys.argv
    sys.argv = [str(path), *argv]
    try:
        with reader_swapped(reader), contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        exit_code = code if isinstance(code, int | str) else 0 if code is None else 1
    except Exception as exc:  # the outcome to compare, whatever the script raised
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sys.argv = saved_argv
        root.removeHandler(handler)
        root.setLevel(level)
    return Outcome(exit_code, out.getvalue(), log.getvalue(), error)


def main() -> None:
    reader, script, *argv = sys.argv[1:]
    path = SCRIPTS / f"{script}.py"
    sys.argv = [str(path), *argv]
    with reader_swapped(READERS[reader]):
        runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    main()
