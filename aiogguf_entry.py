"""The ``aiogguf`` console script's entry point.

It lives outside the ``aiogguf`` package so that it takes Ctrl-C over before anything
heavy is imported: ``import aiogguf`` imports the loader (about half a second, so that a
load inside a running event loop imports nothing on the loop's thread), and the CLI then
imports every command's parser. Without this, a Ctrl-C in that time ends the process
with Python's traceback and signal status -2. Nothing is open or started yet then, so
the process just ends: one line, status 130. ``aiogguf.cli.console_main`` takes over.
"""

from __future__ import annotations

import os
import signal
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType


def _interrupted_while_importing(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"aiogguf: interrupted\n")
    os._exit(130)


def main() -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupted_while_importing)
    from aiogguf.cli import console_main

    return console_main()
