"""``run``: an async call run to its end in a fresh event loop, for the ``_sync`` twins
of the API and for the command line, and ``interrupt_run``, which Ctrl-C calls."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

__all__ = ["interrupt_run", "run"]


def run(fn: Any, *args: Any, name: str = "a blocking call") -> Any:
    """Run ``fn(*args)`` in a fresh event loop, on uvloop when it is installed.

    On the main thread, ``interrupt_run`` (a SIGINT handler calls it) cancels the run's
    root task, as ``asyncio.run`` does on Ctrl-C, and the run then raises
    ``KeyboardInterrupt``: the work unwinds through its task groups, every task it
    started runs its cleanup, and none is dropped unstarted.

    Raises ``RuntimeError`` naming the async twin when this thread runs a loop already
    (``name``: the caller, for the message): a second loop cannot start there."""
    # Imported here: the command line imports this module for ``interrupt_run`` alone,
    # and a command that runs no loop (``aiogguf inspect``) need not import asyncio.
    import asyncio

    import anyio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            f"aiogguf.{name}() runs an event loop of its own and this thread already runs "
            "one: inside a loop use the async API (`async with aiogguf.load(...)`, "
            "`await aiogguf.inspect(...)`), or call it from another thread"
        )
    options: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    else:
        options["use_uvloop"] = True
    if threading.current_thread() is not threading.main_thread():
        return anyio.run(fn, *args, backend_options=options)

    async def root() -> Any:
        _main_run.task = asyncio.current_task()
        try:
            return await fn(*args)
        finally:
            _main_run.task = None

    _main_run.interrupted = False
    try:
        result = anyio.run(root, backend_options=options)
    except asyncio.CancelledError:
        if _main_run.interrupted:
            raise KeyboardInterrupt from None
        raise
    if _main_run.interrupted:
        raise KeyboardInterrupt  # the work caught its cancellation and went on
    return result


@dataclass(slots=True)
class _MainRun:
    """The root task of the ``run`` on the main thread, while there is one."""

    task: asyncio.Task[Any] | None = None
    interrupted: bool = False


_main_run = _MainRun()


def interrupt_run() -> bool:
    """Cancel the ``run`` in progress on the main thread and return True; False when
    there is none. For a SIGINT handler (which runs on the main thread, between two
    steps of the code running there): the cancellation is delivered at the root task's
    next ``await``, and ``run`` raises ``KeyboardInterrupt`` once the work has unwound."""
    task = _main_run.task
    if task is None or task.done():
        return False
    _main_run.interrupted = True
    task.cancel()
    # A loop asleep in its selector wakes for the cancellation.
    task.get_loop().call_soon_threadsafe(_nothing)
    return True


def _nothing() -> None:
    pass
