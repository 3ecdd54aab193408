"""The ``aiogguf`` console script's entry point.

It lives outside the ``aiogguf`` package because it runs before the package's
``__init__``, and does two things there:

- It asks the package for its re-exports on demand (``exports_on_demand``, read by
  ``aiogguf/__init__``). A library's ``import aiogguf`` imports the loader (0.3 s) so
  that a load inside a running event loop imports nothing on the loop's thread; the
  command line needs no such promise, since each command imports what it needs at its
  own import, before any loop starts, and ``aiogguf inspect`` then starts as fast as
  gguf-py's ``gguf-dump``.
- It takes Ctrl-C over before anything is imported: without this, a Ctrl-C while the
  command's modules import ends the process with Python's traceback and signal status
  -2. Nothing is open or started yet then, so the process just ends: one line, status
  130. ``aiogguf.cli.console_main`` takes over.
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


# Set by ``main`` before ``import aiogguf``; only the console script's process sets it.
exports_on_demand = False


def main() -> int:
    global exports_on_demand
    exports_on_demand = True
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupted_while_importing)
    from aiogguf.cli import console_main

    return console_main()
