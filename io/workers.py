"""Threads of a load's own for its blocking reads and checks, at a lower CPU priority.

On a machine with few cores, threads that copy or scan gigabytes keep every core busy;
the event loop's thread then waits for a core whenever it wakes up, and the server that
embeds the load answers late. These threads run at a higher ``nice`` value than the rest
of the process, so the scheduler hands the loop's thread a core first; throughput is
unchanged when the loop is idle. The threads belong to one load: started when it starts,
joined when it ends (anyio's shared worker threads are not reniced: they run the
embedding application's work too, and an unprivileged process may not lower a thread's
nice value again).

A thread takes its next call from a queue as soon as it is free, and hands its result to
the loop without waiting for the loop to take it: with more calls submitted than threads,
no thread waits for the loop thread, which on a busy 2-core machine may itself be waiting
for a core (anyio's worker threads get every call through the loop).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["LoadThreads"]

T = TypeVar("T")

# How much less CPU weight the threads get: nice 5 is about a third of the loop's weight.
LOAD_NICE = 5


@dataclass(slots=True)
class _Call(Generic[T]):
    fn: Callable[[], T]
    done: anyio.Event = field(default_factory=anyio.Event)
    value: T | None = None
    error: BaseException | None = None


class LoadThreads:
    """``async with LoadThreads(n) as threads: await threads.run_sync(fn, *args)``.

    ``run_sync`` returns once ``fn`` has finished — also when the caller is cancelled
    meanwhile, since ``fn`` writes into memory the caller owns — and then raises the
    cancellation.
    """

    def __init__(self, count: int, *, nice: int = LOAD_NICE, name: str = "aiogguf-reader"):
        self._count = max(count, 1)
        self._nice = nice
        self._name = name
        self._queue: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._token: anyio.lowlevel.EventLoopToken | None = None

    async def __aenter__(self) -> LoadThreads:
        self._token = anyio.lowlevel.current_token()
        for i in range(self._count):
            thread = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for _ in self._threads:
            self._queue.put(None)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on one of the threads; its result, or its exception."""
        call: _Call[T] = _Call(lambda: fn(*args))
        self._queue.put(call)
        with anyio.CancelScope(shield=True):
            await call.done.wait()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]

    def _work(self) -> None:
        with contextlib.suppress(OSError):  # a hint only: containers may forbid it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while (call := self._queue.get()) is not None:
            try:
                call.value = call.fn()
            except BaseException as exc:  # handed to the awaiting task, which raises it
                call.error = exc
            # Scheduled, not waited for: the thread goes on to the next call at once.
            token = self._token
            assert token is not None
            token.backend_class.run_sync_soon(call.done.set, (), token.native_token)
