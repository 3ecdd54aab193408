"""The ``aiogguf`` command line. Each subcommand lives in its own module with
``add_arguments(parser)`` and ``run(args) -> int``.

The console script enters through ``aiogguf_entry`` (outside this package), which takes
Ctrl-C over before ``import aiogguf``; ``console_main`` keeps it while the commands'
modules import, ``main`` handles it once a command runs (``_exit_promptly_on_interrupt``),
and ``console_main`` again while the interpreter ends.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from types import FrameType
from typing import Any, TextIO

from aiogguf._run import interrupt_run
from aiogguf.cli.extras import MissingExtraError
from aiogguf.errors import GGUFError, LoadWarning, shown_path

__all__ = ["main"]

# name → (module, one-line help). Modules are imported only to build their parser.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("aiogguf.cli.demo", "write a synthetic model, load it and print the report"),
    "inspect": ("aiogguf.cli.inspect", "show a model's files, metadata and tensors"),
    "plan": ("aiogguf.cli.plan", "show where every tensor would go (dry run)"),
    "load": ("aiogguf.cli.load", "load a model with a progress bar and print the report"),
    "validate": ("aiogguf.cli.validate", "load with checks on and list every bad tensor"),
    "hash": ("aiogguf.cli.hash", "hash a model once and write its manifest"),
    "verify": ("aiogguf.cli.verify", "check a model against a sha256 or a manifest"),
    "bench": ("aiogguf.cli.bench", "measure load throughput against this machine's limits"),
    "config": ("aiogguf.cli.config", "print the effective configuration"),
    "serve": ("aiogguf.cli.serve", "run the HTTP load server"),
    "cluster": (
        "aiogguf.cli.cluster",
        "plan or load a model over a Ray cluster (beyond one machine)",
    ),
}

EXIT_OK, EXIT_FAILURE, EXIT_INVALID, EXIT_WARNED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# How long an interrupted command may take to unwind before the process is ended.
INTERRUPT_GRACE_S = 0.8
_interrupt_reported = threading.Event()


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C while nothing of the command runs (its modules import, or it is over):
    the process ends at once, one line, no traceback."""
    os.write(2, b"aiogguf: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def console_main() -> int:
    """``main`` for the console script and ``python -m aiogguf``: Ctrl-C at any moment
    exits 130 with one line."""
    if threading.current_thread() is not threading.main_thread():
        return main()
    signal.signal(signal.SIGINT, _interrupted)
    try:
        return main()
    finally:
        # The command is over: a Ctrl-C while the interpreter waits for threads ends the
        # process at once. Once it tears down, Python puts the default action back (a
        # Ctrl-C there would kill it, status -2, in silence) unless the signal is
        # ignored: atexit runs before that.
        signal.signal(signal.SIGINT, _interrupted)
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``aiogguf`` parser, with a subcommand for each of ``COMMANDS``.

    ``commands``: the subcommands whose flags are added, each importing its module (the
    others are listed with their help line only); default every one. ``main`` builds
    the one on the command line: ``aiogguf inspect`` never imports the loader.
    """
    parser = argparse.ArgumentParser(
        prog="aiogguf", description="Load GGUF models at hardware speed."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action=_VersionAction, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if commands is not None and name not in commands:
            continue
        module = importlib.import_module(module_name)
        # SUPPRESS as default: an absent sub-level flag must not reset ``aiogguf --debug``.
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named on a command line: the first argument that is not an option
    (the top-level options take no value), or None."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return argv[i + 1] if i + 1 < len(argv) else None
        if not arg.startswith("-"):
            return arg
    return None


class _VersionAction(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked
    (``importlib.metadata`` reads every installed distribution's records)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        sys.stdout.write(f"aiogguf {_version()}\n")
        parser.exit()


def _version() -> str:
    """The installed distribution's version (the package's ``__version__``, which the CLI,
    a layer below the package's re-exports, does not import)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("aiogguf")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _exit_promptly_on_interrupt(command: str) -> None:
    """Make Ctrl-C end this process within a second, whatever it is doing.

    SIGINT still raises ``KeyboardInterrupt`` in the main thread, so the command unwinds
    and says "interrupted". But a worker thread blocked in a system call (an ``open`` or
    a read on a hung filesystem) cannot be cancelled: the load's cleanup waits for it,
    and so does the interpreter at exit (anyio's worker threads are not daemons). A
    daemon watchdog, armed by the first SIGINT, ends the process with status 130 if it
    is still there after ``INTERRUPT_GRACE_S``; the kernel releases what it held.
    Installed only by the console script: the process is then ours to end.
    """
    armed = threading.Event()

    def watchdog() -> None:
        time.sleep(INTERRUPT_GRACE_S)
        if not _interrupt_reported.is_set():
            print(f"aiogguf {command}: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if not armed.is_set():
            armed.set()
            threading.Thread(target=watchdog, name="aiogguf-interrupt", daemon=True).start()
        interrupt_main_thread()

    signal.signal(signal.SIGINT, on_sigint)
    if command != "serve":  # which stops on SIGTERM by itself, with status 0
        # SIGTERM as Ctrl-C: the command unwinds (a download records what it wrote).
        signal.signal(signal.SIGTERM, on_sigint)


def interrupt_main_thread() -> None:
    """What Ctrl-C does once a command runs (the SIGINT handler calls this on the main
    thread): cancel the command's event loop run, which unwinds and raises
    ``KeyboardInterrupt`` (``aiogguf._run.interrupt_run``), or, while no loop runs, raise
    ``KeyboardInterrupt`` here. Raised inside a running loop, it could land between a
    task's creating a coroutine and scheduling it, and the interpreter would warn, as it
    ends, of a coroutine never awaited."""
    if not interrupt_run():
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status.

    ``argv`` None (the console script, ``python -m aiogguf``): the command line, and
    Ctrl-C ends the process with status 130 within a second. A list: those arguments
    (for tests and embedding), and signals are left alone.

    Exit statuses: 0 done, 1 a failure of the program, 2 bad input (a value, a file, a
    full disk: one line), 3 done with warnings (``plan --strict``), 130 interrupted.
    """
    command = _command_in(sys.argv[1:] if argv is None else argv)
    args = build_parser(() if command is None else (command,)).parse_args(argv)
    if argv is None and threading.current_thread() is threading.main_thread():
        _exit_promptly_on_interrupt(args.command)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line(args.command)
            status: int = args._module.run(args)
    except GGUFError as exc:
        if args.debug:
            raise
        print(f"aiogguf {args.command}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except MissingExtraError as exc:
        print(f"aiogguf {args.command}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print(f"aiogguf {args.command}: interrupted", file=sys.stderr, flush=True)
        _interrupt_reported.set()
        return EXIT_INTERRUPTED
    except OSError as exc:
        # A file the command could not read or write (a full disk, a missing folder):
        # the input's fault, said in one line; a bug shows up as any other exception.
        if args.debug:
            raise
        print(f"aiogguf {args.command}: {_os_error_line(exc)}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:
        if args.debug:
            raise
        print(f"aiogguf {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return status


def _os_error_line(exc: OSError) -> str:
    """``PATH: why`` (``/tmp/m.gguf: No space left on device``), on one line."""
    why = " ".join((exc.strerror or str(exc) or type(exc).__name__).split())
    name = exc.filename if exc.filename is not None else None
    return f"{shown_path(name)}: {why}" if name is not None else why


def _warning_line(command: str) -> Callable[..., None]:
    """``warnings.showwarning`` while a command runs: each warning as one line on stderr,
    ``aiogguf COMMAND: warning: ...`` (a ``LoadWarning`` is the load telling its user;
    Python's own format adds the source line that warned, on a second line)."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        kind = "" if issubclass(category, LoadWarning) else f"{category.__name__}: "
        text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
        print(f"aiogguf {command}: warning: {kind}{text}", file=file or sys.stderr, flush=True)

    return show
